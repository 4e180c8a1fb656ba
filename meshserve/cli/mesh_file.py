"""The mesh config file of ``meshserve up --config FILE``: per-service flags in TOML.

Each section names a service; each key is one of that service's flags, spelled
as on its command line without the leading dashes (``meshserve scheduler
--help`` lists them). A value becomes ``--key value``; ``true`` becomes the bare
flag (``false`` leaves it out); a list repeats the flag once per item::

    [scheduler]
    queue-policy = "sjf"
    pools = "pools.toml"

    [executor]
    device = "cuda"
    dtype = "bfloat16"
    max-batch-wait-ms = 2.0
    no-prefix-caching = true

    [gateway]
    http-port = 8000
    served-model-name = ["smol", "gpt-4o-mini"]

    [kvstore]
    memory = "2GiB"

The file's flags come after ``up``'s defaults and before the flags given to ``up``
on its command line, for each service: a flag given to ``up`` wins over the file,
and the file over ``up``'s defaults (each service keeps the last of a repeated
flag; a flag that takes several values, such as ``served-model-name``, gets the
file's and then ``up``'s). ``port`` and ``scheduler`` are refused: ``up`` gives each
service its port and the scheduler's address.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

SERVICES = ("scheduler", "executor", "gateway", "kvstore")
OWNED_BY_UP = ("port", "scheduler")  # up gives each service its port and the scheduler's address


def _args(section: str, table: dict) -> list[str]:
    """One section's flags as command-line arguments.

    Raises:
        ValueError: a value that is not a string, number, boolean or list of them.
    """
    out: list[str] = []
    for key, value in table.items():
        if key.replace("_", "-") in OWNED_BY_UP:
            raise ValueError(f"[{section}] {key}: up sets it for each service it starts (the gateway's port: "
                             "up's --port)")
        flag = "--" + key.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool):
                if v:
                    out.append(flag)
            elif isinstance(v, (str, int, float)):
                out += [flag, str(v)]
            else:
                raise ValueError(f"[{section}] {key}: expected a string, number, boolean or a list of them, "
                                 f"got {type(v).__name__}")
    return out


def read_mesh_file(path: str | Path) -> dict[str, list[str]]:
    """Service name → its extra command-line arguments, from a mesh config file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid TOML, an unknown section, or a bad value (the message
            names the file and the key).
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(data) - set(SERVICES)
    if unknown:
        raise ValueError(f"{path}: unknown sections {sorted(unknown)} (allowed: {', '.join(SERVICES)})")
    out = {}
    for service in SERVICES:
        table = data.get(service, {})
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [{service}] must be a table")
        try:
            out[service] = _args(service, table)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return out
