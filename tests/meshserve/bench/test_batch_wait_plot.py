"""The --max-batch-wait-ms curve from a folder of bench reports: medians per wait, in
wait order, other targets skipped, a plot and a table written."""

from __future__ import annotations

import json

import pytest

from meshserve.bench import batch_wait_plot


def _report(path, target: str, wait: float, tps: float, ttft50: float, ttft99: float) -> None:
    path.write_text(json.dumps({
        "target": target, "workload": "synthetic", "concurrency": 4, "dtype": "float32", "request_rate": None,
        "output_tokens_per_s": tps, "ttft_p50_s": ttft50, "ttft_p99_s": ttft99,
        "engine": {"enable_prefix_caching": True, "max_batch_wait_ms": wait}}))


def test_curve_takes_the_median_of_each_wait_in_wait_order(tmp_path):
    _report(tmp_path / "a.json", "engine", 20, 10.0, 0.5, 0.9)
    _report(tmp_path / "b.json", "engine", 0, 12.0, 0.2, 0.4)
    _report(tmp_path / "c.json", "engine", 0, 14.0, 0.4, 0.6)
    _report(tmp_path / "d.json", "engine", 0, 30.0, 0.3, 0.5)
    _report(tmp_path / "e.json", "mesh", 5, 99.0, 9.0, 9.0)
    rows = batch_wait_plot.curve(tmp_path)
    assert [(r["wait_ms"], r["runs"], r["output_tokens_per_s"], r["ttft_p50_s"], r["ttft_p99_s"]) for r in rows] == [
        (0.0, 3, 14.0, 0.3, 0.5), (20.0, 1, 10.0, 0.5, 0.9)]
    png, md = batch_wait_plot.write(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.read_text().splitlines()[2:4] == ["| 0 | 3 | 14.0 | 300 | 500 |", "| 20 | 1 | 10.0 | 500 | 900 |"]


def test_a_folder_without_engine_reports_is_an_error(tmp_path):
    _report(tmp_path / "e.json", "mesh", 5, 99.0, 9.0, 9.0)
    with pytest.raises(ValueError, match="no closed-loop engine report"):
        batch_wait_plot.curve(tmp_path)
    assert batch_wait_plot.main([str(tmp_path)]) == 2
