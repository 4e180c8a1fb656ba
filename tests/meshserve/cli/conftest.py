"""Fixtures of the ``meshserve`` command's tests."""

import pytest

from meshserve.cli.launcher import Mesh


@pytest.fixture
def spawned(monkeypatch):
    """The services ``up`` starts; the first one ends the start (``error: spawned NAME``),
    so a test sees whether the checks let it get that far."""
    names = []

    def spawn(self, name, args, cpus=None, env=None):
        names.append(name)
        raise RuntimeError(f"spawned {name}")

    monkeypatch.setattr(Mesh, "_spawn", spawn)
    return names
