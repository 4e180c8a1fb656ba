"""Output-length predictor: fallback levels, exact values, uncertainty and error."""

import math

import pytest

from scheduler.predictor import OutputLengthPredictor, Prediction, prompt_bucket


def test_prompt_bucket_is_floor_log2_of_length_plus_one():
    assert [prompt_bucket(n) for n in (0, 1, 2, 3, 6, 7, 100, 1000)] == [0, 1, 1, 2, 2, 3, 6, 9]


def test_prior_is_half_of_max_tokens():
    p = OutputLengthPredictor()
    assert p.predict("a", 100, 501) == Prediction(250, 1.0, "prior")
    assert p.predict("a", 100, 1) == Prediction(1, 1.0, "prior")
    assert p.stats() == {"num_observed": 0, "num_scored": 0, "mean_abs_error_tokens": None}


def test_fallback_hierarchy_and_exact_geometric_means():
    p = OutputLengthPredictor(min_samples=2)
    p.observe("a", 100, 9, predicted=50)   # bucket 6, x = ln 10
    p.observe("a", 100, 99)                # bucket 6, x = ln 100
    p.observe("a", 1000, 0, predicted=3)   # bucket 9, x = 0
    ln10 = math.log(10)
    # tenant+bucket: exp((ln 10 + ln 100) / 2) - 1 = sqrt(1000) - 1 = 30.62 -> 31
    got = p.predict("a", 100, 500)
    assert (got.tokens, got.level) == (31, "tenant+bucket") and got.log_std == pytest.approx(ln10 / 2)
    # bucket 9 has one sample (< 2): tenant level, exp(ln 1000 / 3) - 1 = 9
    got = p.predict("a", 1000, 500)
    assert (got.tokens, got.level) == (9, "tenant") and got.log_std == pytest.approx(ln10 * math.sqrt(2 / 3))
    assert p.predict("b", 100, 500).tokens == 9 and p.predict("b", 100, 500).level == "global"
    assert p.predict("a", 100, 20).tokens == 20  # capped at max_tokens
    # |50 - 9| and |3 - 0|: mean 22
    assert p.stats() == {"num_observed": 3, "num_scored": 2, "mean_abs_error_tokens": 22.0}


def test_min_samples_must_be_positive():
    with pytest.raises(ValueError):
        OutputLengthPredictor(min_samples=0)
