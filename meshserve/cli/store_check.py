"""The check of a local mesh's Redis stores before any service starts (``Mesh.start``).

The gateway pings its task store itself before it loads its tokenizer
(``run_gateway``), but a local mesh starts the gateway last, after every executor
has loaded the model (tens of seconds): a typo in a ``redis://`` URL or a stopped
Redis was reported that late. ``check_stores`` pings each Redis the gateway will
be given (``--task-store``, and ``--result-cache`` when a ``--config`` file's
``[gateway]`` table names one) first, once each with a short bound
(``gateway.redis_task_store.ping``), and checks that the task store's Redis can
serve it, as the gateway's own start does.
"""

from __future__ import annotations

from typing import Sequence

from meshserve.urls import redact_url

STORE_FLAGS = ("--task-store", "--result-cache")
"""The gateway's flags that name a store: ``memory`` or a Redis URL."""


def redis_stores(gateway_args: Sequence[str]) -> dict[str, str]:
    """Flag → URL of each Redis store in a gateway's arguments, as the gateway reads
    them (the last value of a flag given twice wins); ``memory`` is left out."""
    out: dict[str, str] = {}
    for flag in STORE_FLAGS:
        values = [gateway_args[i + 1] for i, a in enumerate(gateway_args[:-1]) if a == flag]
        if values and values[-1] != "memory":
            out[flag] = values[-1]
    return out


async def check_stores(stores: dict[str, str]) -> None:
    """Pings each store of ``stores`` (flag → URL), in order; checks the task store's
    Redis can serve it as the gateway will at start (``check_serves_tasks``: version
    6.2 or later, the create script loads).

    Raises:
        ConnectionError: one did not answer, or the task store's cannot serve it; one
            line naming its flag, URL (without its user and password, ``redact_url``)
            and the reason, e.g. ``--task-store redis://127.0.0.1:6390/0: PING failed:
            Error 111 connecting to 127.0.0.1:6390. Connect call failed ...`` or
            ``--task-store redis://***@127.0.0.1:6390/0: SCRIPT LOAD failed: this user
            has no permissions to run the 'script|load' command``.
    """
    if not stores:
        return
    from gateway.redis_task_store import ping

    for flag, url in stores.items():
        try:
            await ping(url, serves_tasks=flag == "--task-store")
        except ConnectionError as exc:
            raise ConnectionError(f"{flag} {redact_url(url)}: {exc}") from None
