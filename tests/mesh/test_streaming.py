"""Text through the whole mesh: UTF-8-safe streaming (C03) and stop strings (C02)."""

import pytest

from meshserve.client import build_request, generate

pytestmark = pytest.mark.model


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


async def test_streamed_multibyte_text_is_exact(mesh, tokenizer):
    """Case C03: text with characters split across tokens streams as exact UTF-8: the
    pieces join to the decoded text, no piece holds half a character."""
    req = build_request(chat=[("user", "Reply with exactly: 你好 🙂🚀 Café")], max_tokens=48, temperature=0)
    out = await generate(mesh.stub, req)
    full = decode(tokenizer, out.token_ids)
    # the case is met: some character of the output is split across tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in out.token_ids), full
    assert "".join(out.pieces) == full == out.text
    for piece in out.pieces:
        piece.encode("utf-8")  # valid UTF-8 (no lone surrogates)
        if "\ufffd" in piece:
            assert "\ufffd" in full
    assert "\ufffd" not in full or full.count("\ufffd") == sum(p.count("\ufffd") for p in out.pieces)
    again = await generate(mesh.stub, req)
    assert again.token_ids == out.token_ids and again.text.encode() == out.text.encode()


async def _reference(mesh, tokenizer):
    req = build_request(chat=[("user", "What is the capital of France? Answer in one word.")], max_tokens=32,
                        temperature=0, ignore_eos=True)
    ref = await generate(mesh.stub, req)
    return ref, decode(tokenizer, ref.token_ids)


def _stop_cases(tokenizer, ids):
    """(S1, S2) from the first token of 4+ characters that has a predecessor."""
    for i in range(1, len(ids)):
        t = tokenizer.decode([ids[i]])
        prev = tokenizer.decode([ids[i - 1]])
        if len(t) >= 4 and len(prev) >= 2 and ids[i] not in tokenizer.all_special_ids \
                and ids[i - 1] not in tokenizer.all_special_ids:
            return t[:-1], prev[-2:] + t[:2]
    raise AssertionError(f"no token of 4+ characters in {ids}")


def _completing_index(tokenizer, ids, stop):
    for k in range(1, len(ids) + 1):
        if stop in decode(tokenizer, ids[:k]):
            return k
    raise AssertionError("stop string never completed")


async def test_stop_string_ending_inside_a_token(mesh, tokenizer):
    """Case C02: a stop string that ends inside a token, and one that spans two: the
    text ends before it, the tokens up to the one completing it are sent."""
    ref, text = await _reference(mesh, tokenizer)
    for stop in _stop_cases(tokenizer, ref.token_ids):
        req = build_request(chat=[("user", "What is the capital of France? Answer in one word.")], max_tokens=32,
                            temperature=0, ignore_eos=True, stop=[stop])
        out = await generate(mesh.stub, req)
        assert out.text == text[: text.index(stop)], stop
        assert stop not in out.text
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.stop_token_id is None
        assert len(out.token_ids) == _completing_index(tokenizer, ref.token_ids, stop)
        assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    await mesh.wait_idle()


async def test_stop_token_ids_and_eos(mesh, tokenizer):
    """The stop token's id is returned, its text is not, unless include_stop_str_in_output
    (vLLM's rule); the model's own EOS ends a request and leaves no text either."""
    ref, _ = await _reference(mesh, tokenizer)
    stop_id = ref.token_ids[3]
    chat = [("user", "What is the capital of France? Answer in one word.")]
    out = await generate(mesh.stub, build_request(chat=chat, max_tokens=32, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_id]))
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert (out.stop_token_id, out.stop_reason) == (stop_id, "")  # vLLM's stop_reason: the id
    assert out.text == tokenizer.decode(ref.token_ids[:first], skip_special_tokens=True)
    kept = await generate(mesh.stub, build_request(chat=chat, max_tokens=32, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[stop_id], include_stop_str_in_output=True))
    assert (kept.token_ids, kept.text) == (out.token_ids, tokenizer.decode(ref.token_ids[: first + 1],
                                                                           skip_special_tokens=True))
    assert len(kept.text) > len(out.text)
    eos = tokenizer.eos_token_id
    natural = await generate(mesh.stub, build_request(chat=[("user", "Say OK.")], max_tokens=64, temperature=0))
    assert natural.finish_reason == "stop", natural.text  # the model's own end, not the length
    assert natural.token_ids[-1] == eos
    assert (natural.stop_token_id, natural.stop_reason) == (None, "")  # the EOS: no stop reason
    listed = await generate(mesh.stub, build_request(chat=[("user", "Say OK.")], max_tokens=64, temperature=0,
                                                     stop_token_ids=[eos]))
    assert (listed.token_ids, listed.stop_token_id) == (natural.token_ids, None)  # the EOS comes first
    assert tokenizer.eos_token not in natural.text
