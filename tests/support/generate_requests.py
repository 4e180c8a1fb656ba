"""What ``meshserve generate`` sends, recorded in place of the gateway (its CLI tests)."""

import meshserve.client
from meshserve.client import Completion


def recording_requests(monkeypatch) -> list:
    """The requests ``generate`` sends from now on (each answered ``ok``)."""
    sent = []

    async def recording(stub, request, metadata=(), timeout=None, on_delta=None) -> list[Completion]:
        sent.append(request)
        return [Completion(index=0, text="ok", finish_reason="stop")]

    monkeypatch.setattr(meshserve.client, "generate_choices", recording)
    monkeypatch.delenv("MESHSERVE_API_KEY", raising=False)
    return sent
