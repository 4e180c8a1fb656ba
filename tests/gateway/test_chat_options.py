"""vLLM's chat extras in prompt building (``ChatOptions``): the ids equal transformers'
``apply_chat_template`` with the same arguments, user-typed control-token text stays
text, and contradictory options are refused with exact messages."""

from __future__ import annotations

import pytest

from gateway.prompt import PromptBuilder
from gateway.request import ChatOptions
from meshserve.errors import InvalidArgument

pytestmark = pytest.mark.model

QUESTION = ("user", "What is the capital of France?")
PREFILL = ("assistant", "The capital of France is")
CONTINUE = ChatOptions(add_generation_prompt=False, continue_final_message=True)
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# a template that shows names and one variable
NAMED_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}{% if m.name %} ({{ m.name }}){% endif %}: "
                  "{{ m['content'] }}\n{% endfor %}{% if mood %}[{{ mood }}]{% endif %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def builder(tokenizer) -> PromptBuilder:
    return PromptBuilder(tokenizer)


def hf(tokenizer, messages, **kwargs) -> list[int]:
    """transformers' own ids for the same messages and arguments."""
    return list(tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=True,
                                              return_dict=False, **kwargs))


def test_without_the_generation_prompt_the_prompt_ends_after_the_last_message(tokenizer, builder):
    ids = builder.from_chat([QUESTION], ChatOptions(add_generation_prompt=False))
    assert ids == hf(tokenizer, [QUESTION], add_generation_prompt=False)
    assert tokenizer.decode(ids) == SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert builder.from_chat([QUESTION]) == ids + tokenizer.encode("<|im_start|>assistant\n")


def test_continue_final_message_ends_right_after_its_content(tokenizer, builder):
    ids = builder.from_chat([QUESTION, PREFILL], CONTINUE)
    assert ids == hf(tokenizer, [QUESTION, PREFILL], continue_final_message=True)
    assert tokenizer.decode(ids) == (SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                     "<|im_start|>assistant\nThe capital of France is")
    assert len(ids) == 42


def test_a_continued_message_keeps_typed_control_token_text_as_text(tokenizer, builder, control_ids):
    ids = builder.from_chat([QUESTION, ("assistant", "Say <|im_end|> and")], CONTINUE)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nSay <|im_end|> and")
    assert [i for i in ids if i in control_ids] == [i for i in builder.from_chat([QUESTION, PREFILL], CONTINUE)
                                                    if i in control_ids]


def test_names_and_template_kwargs_reach_the_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", NAMED_TEMPLATE)
    builder = PromptBuilder(tokenizer)
    options = ChatOptions(template_kwargs='{"mood": "calm"}', names=("ann", None))
    ids = builder.from_chat([("user", "Hi"), ("assistant", "Hello")], options)
    assert tokenizer.decode(ids) == "user (ann): Hi\nassistant: Hello\n[calm]assistant:"


def test_the_default_template_ignores_names(tokenizer, builder):
    assert builder.from_chat([QUESTION], ChatOptions(names=("ann",))) == builder.from_chat([QUESTION])


@pytest.mark.parametrize("messages, options, message", [
    ([QUESTION, PREFILL], ChatOptions(continue_final_message=True),
     "continue_final_message cannot be used with add_generation_prompt: true (set add_generation_prompt to false)"),
    ([PREFILL, QUESTION], CONTINUE,
     "continue_final_message needs the last message to be the assistant's, got role 'user'"),
    ([QUESTION], ChatOptions(template_kwargs='{"tokenize": false}'),
     "chat_template_kwargs.tokenize is not a template variable meshserve passes on (it is a parameter of the "
     "rendering itself, or the messages)"),
    ([QUESTION], ChatOptions(template_kwargs='{"messages": []}'),
     "chat_template_kwargs.messages is not a template variable meshserve passes on (it is a parameter of the "
     "rendering itself, or the messages)"),
    ([QUESTION], ChatOptions(template_kwargs='{"self": 1}'),  # was a TypeError: "got multiple values for 'self'"
     "chat_template_kwargs.self is not a template variable meshserve passes on (it is a parameter of the "
     "rendering itself, or the messages)"),
    ([QUESTION], ChatOptions(template_kwargs='[1]'), "chat_template_kwargs: Input should be an object"),
    ([QUESTION], ChatOptions(template_kwargs='{"a": '), "chat_template_kwargs is not valid JSON: Expecting value "
     "(line 1, column 7)"),
    ([QUESTION], ChatOptions(template_kwargs='{"a": ' + "[" * 33 + "]" * 33 + "}"),
     "chat_template_kwargs: nests deeper than 32 levels of objects and arrays"),
    ([QUESTION], ChatOptions(template_kwargs='{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "chat_template_kwargs: nests deeper than 32 levels of objects and arrays"),
])
def test_contradictory_options_are_refused(builder, messages, options, message):
    with pytest.raises(InvalidArgument) as err:
        builder.from_chat(messages, options)
    assert str(err.value) == message


def test_a_template_that_does_not_render_the_final_message_cannot_continue_it(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}")
    with pytest.raises(InvalidArgument) as err:
        PromptBuilder(tokenizer).from_chat([QUESTION, PREFILL], CONTINUE)
    assert str(err.value).startswith("continue_final_message: the chat template does not render the final message "
                                     "so that it can be continued: continue_final_message is set but the final "
                                     "message does not appear in the chat")
