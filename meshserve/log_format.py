"""The one-line log format of meshserve's processes, naming the service that wrote
each line when several services share one terminal (``meshserve up`` without
``--log-dir``: ``[executor-1] 2026-01-02 03:04:05,678 executor.server INFO …``).

The launcher gives each service its name in ``$MESHSERVE_LOG_NAME``
(``LOG_NAME_ENV``); a parallel executor's ranks inherit it. Unset (a service run
alone, a container, ``up --log-dir``: one file per service), lines carry no name.
"""

from __future__ import annotations

import os

LOG_NAME_ENV = "MESHSERVE_LOG_NAME"
LINE_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def log_format(line_format: str = LINE_FORMAT) -> str:
    """``line_format`` (a ``logging.Formatter`` format) led by ``[NAME] `` when
    ``$MESHSERVE_LOG_NAME`` is set and not empty (read at each call, never at import)."""
    name = os.environ.get(LOG_NAME_ENV, "")
    return f"[{name.replace('%', '%%')}] {line_format}" if name else line_format
