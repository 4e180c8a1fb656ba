"""The project's one percentile: linear interpolation (bench reports) and nearest rank
(simulators, policies benchmark)."""

import pytest

from meshserve.bench.stats import percentile


def test_percentile_exact_values():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 25) == 1.75
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 100) == 4.0
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50, empty=0.0) == 0.0


def test_percentile_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50, "nearest-rank") == 2.0
    assert percentile(list(range(1, 101)), 99, "nearest-rank") == 99
    assert percentile([5.0], 99, "nearest-rank") == 5.0
    with pytest.raises(ValueError):
        percentile([], 50, "nearest-rank")


def test_percentile_rejects_no_values_a_bad_q_or_method():
    assert percentile([4.0, 1.0, 3.0, 2.0], 0, "nearest-rank") == 1.0  # the first value, not an index of -1
    assert percentile([], 50, "nearest-rank", empty=0.0) == 0.0
    for args in (([], 50), ([1.0], -1), ([1.0], 101), ([1.0], 50, "midpoint")):
        with pytest.raises(ValueError):
            percentile(*args)


def test_interleaved_ms_runs_the_sides_in_turn_and_times_all_but_the_warm_up_round():
    from meshserve.bench.stats import interleaved_ms

    calls = []
    ms, results = interleaved_ms({"a": lambda: calls.append("a") or len(calls),
                                  "b": lambda: calls.append("b") or len(calls)}, 3)
    assert calls == ["a", "b"] * 4
    assert results == {"a": 7, "b": 8}
    assert set(ms) == {"a", "b"} and all(set(v) == {"wall", "cpu"} and min(v.values()) >= 0 for v in ms.values())
