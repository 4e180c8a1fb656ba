"""Reading and editing a service's argument list (``["--flag", "value", ...]``) as the
service's own parser reads it: the last value of a flag given twice wins."""

from __future__ import annotations

from typing import Sequence


def last_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` in ``args`` (None when absent)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else None


def without(args: Sequence[str], flag: str) -> list[str]:
    """``args`` less every ``flag VALUE`` pair."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        else:
            out.append(a)
    return out
