"""The golden comparison rule itself: divergence only at a near tie, at most one prompt."""

from __future__ import annotations

import pytest

from tests.support.reference import ReferenceOutput, assert_greedy_matches, golden_lengths


def ref(tokens: list[int], gaps: list[float]) -> ReferenceOutput:
    """A reference whose runner-up at each position is token ``t + 1`` with logit ``10 - gap``."""
    return ReferenceOutput(tokens, [(t, t + 1) for t in tokens], [(10.0, 10.0 - g) for g in gaps])


def test_exact_match_passes():
    assert assert_greedy_matches([[1, 2, 3]], [ref([1, 2, 3], [1.0] * 3)]) == []


def test_divergence_at_near_tie_to_the_runner_up_is_accepted_once():
    refs = [ref([1, 2, 3], [1.0, 5e-5, 1.0]), ref([4, 5, 6], [1.0, 1.0, 5e-5])]
    [d] = assert_greedy_matches([[1, 3, 9], [4, 5, 6]], refs)
    assert (d.prompt_index, d.position, d.ours, d.reference, d.near_tie) == (0, 1, 3, 2, True)
    with pytest.raises(AssertionError, match="too many"):
        assert_greedy_matches([[1, 3, 9], [4, 5, 7]], refs)


def test_divergence_away_from_a_tie_or_to_another_token_fails():
    with pytest.raises(AssertionError, match="away from a near tie"):
        assert_greedy_matches([[1, 3, 3]], [ref([1, 2, 3], [1.0, 2e-4, 1.0])])
    with pytest.raises(AssertionError, match="away from a near tie"):
        assert_greedy_matches([[1, 7, 3]], [ref([1, 2, 3], [1.0, 1e-6, 1.0])])  # 7 is not in the top 2


def test_length_mismatch_fails():
    with pytest.raises(AssertionError, match="tokens, reference"):
        assert_greedy_matches([[1, 2]], [ref([1, 2, 3], [1.0] * 3)])


def test_golden_lengths_span_5_to_600():
    lengths = golden_lengths()
    assert len(lengths) == 16 and lengths[0] == 5 and lengths[-1] == 600 and lengths == sorted(lengths)
