"""The one-time GGUF conversion says what it does: a first use logs the source, the
cache folder and the time taken; a second use converts nothing and logs nothing.
``up`` and ``demo`` show those lines on stderr (``show_model_conversion``)."""

from __future__ import annotations

import io
import logging

import pytest

from meshserve import model_files
from meshserve.cli.options import show_model_conversion

LOGGER = "meshserve.model_files"


@pytest.fixture
def conversion_logger():
    """The module's logger, its handlers, level and propagation restored afterwards."""
    logger = logging.getLogger(LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def _fake_convert(calls):
    def convert(gguf, out):  # stands in for transformers' dequantization: this test is about the log lines
        calls.append((gguf.name, out))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
    return convert


def test_first_use_logs_the_conversion_once(tmp_path, monkeypatch, conversion_logger):
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(model_files, "_convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    conversion_logger.addHandler(handler)
    conversion_logger.setLevel(logging.INFO)

    first = model_files.resolve_model(str(gguf))
    lines = stream.getvalue().splitlines()
    assert len(calls) == 1 and calls[0][1] == first.path
    assert len(lines) == 2
    assert lines[0] == (f"first use of tiny.gguf: dequantizing it to float32 safetensors in {first.path} "
                        "(once; tens of seconds for a small model)")
    assert lines[1].startswith("converted tiny.gguf in ") and lines[1].endswith(" s")

    again = model_files.resolve_model(str(gguf))
    assert again.path == first.path
    assert len(calls) == 1
    assert stream.getvalue().splitlines() == lines  # cached: no conversion, no new line


def test_show_model_conversion_prints_bare_lines_on_stderr_once(capsys, conversion_logger):
    show_model_conversion()
    show_model_conversion()  # idempotent: one handler, not two
    logging.getLogger(LOGGER).info("first use of x.gguf: dequantizing")
    assert capsys.readouterr().err == "first use of x.gguf: dequantizing\n"


def test_the_lines_go_to_the_stderr_of_the_moment_they_are_written(capsys, conversion_logger, monkeypatch):
    """An in-process `up` (a test runner's) set it up while stderr was a stream closed
    since: later lines still reach the current stderr (found by a fresh user's suite)."""
    import io

    earlier = io.StringIO()
    monkeypatch.setattr("sys.stderr", earlier)
    show_model_conversion()
    earlier.close()
    monkeypatch.undo()
    show_model_conversion()
    logging.getLogger(LOGGER).info("converted x.gguf in 1.0 s")
    assert capsys.readouterr().err == "converted x.gguf in 1.0 s\n"
