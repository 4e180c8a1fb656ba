"""Fixtures of the ``meshserve`` command's tests."""

import pytest

import meshserve.client
from meshserve.cli.launcher import Mesh
from meshserve.client import Completion


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


def recording_requests(monkeypatch) -> list:
    """The requests ``generate`` sends from now on (each answered ``ok``)."""
    sent = []

    async def recording(stub, request, metadata=(), timeout=None, on_delta=None) -> list[Completion]:
        sent.append(request)
        return [Completion(index=0, text="ok", finish_reason="stop")]

    monkeypatch.setattr(meshserve.client, "generate_choices", recording)
    monkeypatch.delenv("MESHSERVE_API_KEY", raising=False)
    return sent
