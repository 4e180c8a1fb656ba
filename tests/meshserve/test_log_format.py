"""The log line format: led by the service's name when ``$MESHSERVE_LOG_NAME`` names one."""

import logging

from meshserve.log_format import LINE_FORMAT, LOG_NAME_ENV, log_format


def test_a_named_process_leads_each_line_with_its_name(monkeypatch):
    monkeypatch.setenv(LOG_NAME_ENV, "executor-1")
    assert log_format() == "[executor-1] %(asctime)s %(name)s %(levelname)s %(message)s"
    assert log_format("rank 2: %(message)s") == "[executor-1] rank 2: %(message)s"
    record = logging.LogRecord("executor.server", logging.INFO, __file__, 1, "registered as %s", ("executor-1",), None)
    assert logging.Formatter(log_format("%(levelname)s %(message)s")).format(record) == \
        "[executor-1] INFO registered as executor-1"


def test_an_unnamed_process_and_a_percent_sign_in_a_name(monkeypatch):
    monkeypatch.delenv(LOG_NAME_ENV, raising=False)
    assert log_format() == LINE_FORMAT == "%(asctime)s %(name)s %(levelname)s %(message)s"
    monkeypatch.setenv(LOG_NAME_ENV, "")
    assert log_format("%(message)s") == "%(message)s"
    monkeypatch.setenv(LOG_NAME_ENV, "50%")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hi", (), None)
    assert logging.Formatter(log_format("%(message)s")).format(record) == "[50%] hi"
