"""Stop strings on streamed pieces (case C02 at the unit level)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from meshserve.errors import InvalidArgument


def run(stop, pieces):
    """Feeds pieces until a match; returns (emitted text, match, index of the stopping piece)."""
    matcher = StopStringMatcher(stop)
    out = []
    for i, piece in enumerate(pieces):
        emit, match = matcher.feed(piece)
        out.append(emit)
        assert not any(s in "".join(out) for s in stop)
        if match is not None:
            assert matcher.flush() == ""
            return "".join(out), match, i
    return "".join(out) + matcher.flush(), None, None


def reference_cut(text, stop):
    """Independent reference: the occurrence that ends first, ties to the longest (earliest start)."""
    for end in range(1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[: end - len(s)], s
    return text, None


def test_stop_ending_inside_a_piece():
    """Case C02: a stop string that ends inside a streamed piece."""
    pieces = ["The", " capital", " of", " France", " is", " Paris", "."]
    assert run([" Fran"], pieces) == ("The capital of", " Fran", 3)


def test_stop_spanning_pieces():
    """Case C02: a stop string that spans pieces."""
    pieces = ["The", " capital", " of", " France", " is", " Paris", "."]
    assert run(["of F"], pieces) == ("The capital ", "of F", 3)
    assert run(["al of Fr"], pieces) == ("The capit", "al of Fr", 3)


def test_stop_across_single_character_pieces():
    """Case C02: a stop string over one-character pieces, after a false start."""
    assert run(["abc"], list("xxabxabcd")) == ("xxabx", "abc", 7)


def test_held_back_tail_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(["Paris."])
    assert matcher.feed("in Par") == ("in ", None)
    assert matcher.feed("is") == ("", None)
    assert matcher.feed(" and") == ("Paris and", None)
    assert matcher.flush() == ""


def test_several_stop_strings_first_completed_wins():
    pieces = ["one", " two", " three", " four"]
    assert run([" four", " two", "thr"], pieces) == ("one", " two", 1)
    # same end: the longer (earlier starting) one
    assert run(["wo", " two"], pieces) == ("one", " two", 1)
    # "cd" completes before "abcdef" could
    assert run(["abcdef", "cd"], ["ab", "cdef"]) == ("ab", "cd", 1)


def test_no_match_flush_returns_all():
    pieces = ["Paris", " is", " the", " capital", " of", " Franc"]
    matcher = StopStringMatcher(["France.", "xyz"])
    emitted = [matcher.feed(p) for p in pieces]
    assert all(match is None for _, match in emitted)
    assert "".join(e for e, _ in emitted) == "Paris is the capital of "
    assert matcher.flush() == "Franc"
    assert run([], pieces) == ("".join(pieces), None, None)


def test_feed_after_match_returns_nothing():
    matcher = StopStringMatcher(["b"])
    assert matcher.feed("abc") == ("a", "b")
    assert matcher.matched == "b"
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


def test_empty_stop_string_rejected():
    with pytest.raises(InvalidArgument, match=r"stop\[1\]"):
        StopStringMatcher(["ok", ""])


@pytest.mark.model
def test_stop_with_real_token_pieces(tokenizer):
    """Case C02's recipe on a fixed answer: S1 = a 4+ character token minus its last
    character (ends inside a token); S2 = last 2 characters of the token before +
    first 2 of it (spans tokens). The text is cut at S and the stream stops at
    the token that completed S."""
    answer = "The capital of France is Paris. It is famous for the Eiffel Tower."
    ids = tokenizer.encode(answer, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids] + [detok.finish()]
    assert "".join(pieces) == answer
    t = next(i for i in range(1, len(ids)) if len(pieces[i]) >= 4 and len(pieces[i - 1]) >= 2)
    s1 = pieces[t][:-1]
    s2 = pieces[t - 1][-2:] + pieces[t][:2]
    for stop in (s1, s2):
        text, match, at = run([stop], pieces)
        assert (text, match) == (answer[: answer.index(stop)], stop)
        assert stop not in text
        assert at == t  # the token that completed the stop string


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=40),
    stop=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_emitted_plus_flush_is_text_cut_at_first_stop(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, match, _ = run(stop, pieces)
    assert (emitted, match) == reference_cut(text, stop)
    if len(set(stop)) == 1 and stop[0] in text:
        assert emitted == text[: text.index(stop[0])]
    # all at once gives the same cut as streamed
    assert run(stop, [text])[:2] == (emitted, match)


def test_no_stop_ends_in_text_fed_without_can_stop():
    """The text of the first min_tokens tokens (``can_stop=False``) cannot end a stop
    string; the first occurrence ending after it stops, even one that began inside it."""
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("xab", can_stop=False) == ("xab", None)  # an "ab" inside: not a stop
    assert matcher.feed("yab") == ("y", "ab")
    spanning = StopStringMatcher(["abc"])
    assert spanning.feed("xab", can_stop=False) == ("x", None)  # "ab" held: it may begin "abc"
    assert spanning.feed("cz") == ("", "abc")


def reference_cut_after(text, stop, floor):
    """Independent reference: the first stop string ending after position ``floor``."""
    for end in range(floor + 1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[: end - len(s)], s
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=40),
    stop=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    floor=st.integers(0, 40),
)
def test_stream_with_a_protected_start_cuts_at_the_first_stop_ending_after_it(text, stop, cuts, floor):
    floor = min(floor, len(text))
    bounds = sorted({0, floor, len(text), *(c for c in cuts if c <= len(text))})
    matcher, out, match = StopStringMatcher(stop), [], None
    for a, b in zip(bounds, bounds[1:]):
        emit, match = matcher.feed(text[a:b], can_stop=b > floor)
        out.append(emit)
        if match is not None:
            break
    emitted = "".join(out) + (matcher.flush() if match is None else "")
    assert (emitted, match) == reference_cut_after(text, stop, floor)
