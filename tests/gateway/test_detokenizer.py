"""Incremental UTF-8-safe detokenization (case C03 at the unit level)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer

pytestmark = pytest.mark.model

MULTIBYTE_TEXT = "Café 你好 🙂🚀 ok"
MORE_TEXTS = [
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, 🏳️‍🌈",
    "日本語のテキストと한국어 텍스트, 中文：「你好，世界！」",
    "Ünïcödé ∑∫√π ≠ ≤ — ‘quotes’ “double” …",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀𓁐 🧬🦀🛰️",
    "tab\tnew\nline  spaces   ",
]


def stream(tokenizer, ids, chunks=1, **kwargs):
    """Pieces of ``ids`` fed ``chunks`` at a time, then the flush."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = [detok.add(ids[i : i + chunks]) for i in range(0, len(ids), chunks)]
    return pieces + [detok.finish()]


def assert_invariant(tokenizer, ids, pieces, skip_special_tokens=True):
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    for piece in pieces:
        piece.encode("utf-8")  # strict: no lone surrogates
    assert "".join(pieces).encode("utf-8") == full.encode("utf-8")
    return full


def test_multibyte_text_one_token_at_a_time(tokenizer):
    """Case C03: characters split across tokens are never streamed in halves."""
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    singles = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in singles)  # the case is real: some tokens hold partial characters
    pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert assert_invariant(tokenizer, ids, pieces) == MULTIBYTE_TEXT


@pytest.mark.parametrize("text", MORE_TEXTS)
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_emoji_and_cjk_stream_whole_characters(tokenizer, text, chunks):
    """Case C03: emoji sequences, CJK and other scripts, fed 1-3 tokens at a time."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, chunks)
    assert all("\ufffd" not in p for p in pieces)
    assert assert_invariant(tokenizer, ids, pieces) == text


def test_multibyte_text_after_a_prompt_context(tokenizer):
    """Case C03: the same with the prompt's tokens as the decoding context."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    pieces = stream(tokenizer, ids, prompt_token_ids=prompt_ids)
    assert all("\ufffd" not in p for p in pieces)
    assert assert_invariant(tokenizer, ids, pieces) == MULTIBYTE_TEXT


def test_partial_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok 你", add_special_tokens=False)
    cut = ids[:-1]  # "你" is two tokens: keep only its first
    assert tokenizer.decode(cut).endswith("\ufffd")
    pieces = stream(tokenizer, cut)
    assert "\ufffd" not in "".join(pieces[:-1])
    assert pieces[-1].endswith("\ufffd")
    assert_invariant(tokenizer, cut, pieces)


def test_malformed_bytes_in_the_middle_appear_where_decode_has_them(tokenizer):
    a = tokenizer.encode("你", add_special_tokens=False)
    b = tokenizer.encode("🚀 done", add_special_tokens=False)
    ids = a[:1] + b  # a lone lead byte, then a complete emoji
    full = tokenizer.decode(ids)
    assert "\ufffd" in full
    pieces = stream(tokenizer, ids)
    assert_invariant(tokenizer, ids, pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, skip):
    ids = tokenizer.encode("Hi 🙂<|im_end|>\n<|im_start|>", add_special_tokens=False)
    ids += [tokenizer.eos_token_id]
    pieces = stream(tokenizer, ids, skip_special_tokens=skip)
    full = assert_invariant(tokenizer, ids, pieces, skip_special_tokens=skip)
    assert (tokenizer.eos_token in full) is not skip


class CountingTokenizer:
    """``tokenizer``'s ``decode``, recording the most ids one call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_window_stays_small(tokenizer):
    """O(1) per token: every decode call sees a few ids, however long the output."""

    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode((MULTIBYTE_TEXT + " ") * 40, add_special_tokens=False)
    pieces = stream(counting, ids)
    assert len(ids) > 400
    assert counting.longest <= 6
    assert_invariant(tokenizer, ids, pieces)


def test_a_long_run_of_malformed_byte_tokens_keeps_the_window_bounded(tokenizer):
    """Token 111 (byte 0xA1) decodes to U+FFFD alone: a run of it keeps the text ending in
    U+FFFD, which held every token until the end (each call decoding all of them, 4,000
    tokens took 6 s). The settled part is emitted as the run goes on, text exact."""

    counting = CountingTokenizer(tokenizer)
    ids = [111] * 500 + tokenizer.encode(" ok 你好", add_special_tokens=False) + [111] * 500
    pieces = stream(counting, ids)
    assert counting.longest <= 2 * (MAX_HELD_TOKENS + 1)  # the held tokens and the text before them
    assert_invariant(tokenizer, ids, pieces)
    during_run = "".join(pieces[:500])  # emitted as the run went, at most MAX_HELD_TOKENS + 1 held
    assert set(during_run) == {"\ufffd"} and 500 - MAX_HELD_TOKENS - 1 <= len(during_run) <= 500 - 3


@settings(max_examples=60, deadline=None)
@given(data=st.data(), chunks=st.integers(1, 4), with_prompt=st.booleans())
def test_long_runs_of_byte_tokens_match_full_decode(tokenizer, data, chunks, with_prompt):
    """Case C03 with runs longer than MAX_HELD_TOKENS: partial characters, malformed
    bytes and U+FFFD itself, mixed with whole tokens."""
    byte_ids = tokenizer.encode("你好🙂🚀é\ufffd", add_special_tokens=False)
    token = st.one_of(st.sampled_from(byte_ids), st.sampled_from([111, 130, 160, 190]),
                      st.integers(0, len(tokenizer) - 1))
    ids = data.draw(st.lists(token, min_size=MAX_HELD_TOKENS, max_size=80))
    prompt = data.draw(st.lists(token, min_size=1, max_size=8)) if with_prompt else None
    pieces = stream(tokenizer, ids, chunks, prompt_token_ids=prompt)
    assert_invariant(tokenizer, ids, pieces)


def test_add_after_finish_raises(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    detok.add([42])
    detok.finish()
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add([42])


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), chunks=st.integers(1, 3))
def test_random_unicode_text_streams_exactly(tokenizer, text, chunks):
    """Case C03: any text (hypothesis) streams to exactly its decoding."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, chunks)
    full = assert_invariant(tokenizer, ids, pieces)
    if "\ufffd" not in full:  # (the GGUF tokenizer does not round-trip a few rare code points)
        assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), chunks=st.integers(1, 4), skip=st.booleans(), with_prompt=st.booleans())
def test_random_token_ids_match_full_decode(tokenizer, data, chunks, skip, with_prompt):
    """Arbitrary ids, malformed byte sequences and special tokens included."""
    vocab = len(tokenizer)
    byte_ids = tokenizer.encode("你好🙂🚀é", add_special_tokens=False)
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_ids), st.integers(0, 16))
    ids = data.draw(st.lists(token, max_size=30))
    prompt = data.draw(st.lists(token, min_size=1, max_size=8)) if with_prompt else None
    pieces = stream(tokenizer, ids, chunks, prompt_token_ids=prompt, skip_special_tokens=skip)
    assert_invariant(tokenizer, ids, pieces, skip_special_tokens=skip)


def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer (SentencePiece BPE with byte fallback, its decoder
    included), built in memory: ``<0x00>``..``<0xFF>`` are ids 3..258."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁ok", "ok", "a", "▁a", "你", "▁hello"]:
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("byte_runs", [
    [(0x98, 1), (0x7C, 4), (0x24, 6), (0x05, 3), (0x4E, 1)],  # one invalid byte: every byte of the run is U+FFFD
    [(0xA1, 500)],  # a guard (held whole before and after): a long run stays exact
    [(0xE4, 1), (0xBD, 1), (0xA0, 1), (0x41, 12)],  # a guard: 你 then A × 12, valid, one run
])
def test_a_run_of_byte_fallback_tokens_is_decoded_as_one_unit(byte_runs):
    """Found by a review: a SentencePiece byte-fallback decoder turns a run of ``<0xNN>``
    tokens into text as one unit, so a later byte changes the earlier ones; the settled
    emission of a long run must not cut inside such a run."""
    tokenizer = byte_fallback_tokenizer()
    ids = [3 + byte for byte, count in byte_runs for _ in range(count)]
    ids = tokenizer.convert_tokens_to_ids(["▁hello", "▁ok"]) + ids + tokenizer.convert_tokens_to_ids(["▁ok"])
    for chunks in (1, 3):
        assert_invariant(tokenizer, ids, stream(tokenizer, ids, chunks))
