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

import sys
from typing import Mapping, Sequence

from meshserve.cli.arglists import last_value, without
from meshserve.urls import redact_url

STORE_ENV = {"--task-store": "MESHSERVE_TASK_STORE", "--result-cache": "MESHSERVE_RESULT_CACHE"}
"""The gateway's flags that name a store (``memory`` or a Redis URL) → the environment
variable each reads when the flag is not given. A URL with a password belongs in the
variable: a command line is visible to every user of the host (``ps``)."""


def gateway_stores(gateway_args: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Flag → value of each store flag as a gateway started with ``gateway_args`` in
    the environment ``environ`` reads it: the flag's last value when given, else its
    variable (``STORE_ENV``) when set; a flag with neither is left out."""
    out: dict[str, str] = {}
    for flag, var in STORE_ENV.items():
        value = last_value(gateway_args, flag) or environ.get(var)
        if value:
            out[flag] = value
    return out


def redis_stores(gateway_args: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Flag → URL of each Redis store a gateway reads (``gateway_stores``; ``memory``
    left out)."""
    return {flag: url for flag, url in gateway_stores(gateway_args, environ or {}).items() if url != "memory"}


def stores_in_env(gateway_args: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """A gateway's arguments with its store flags moved into its environment, so that a
    Redis password never shows on its command line.

    Returns:
        ``gateway_args`` without any store flag and its value, and variable → value
        (``STORE_ENV``) for each store the gateway reads (``gateway_stores``), to add
        to its environment: the same stores, read from there.
    """
    args = list(gateway_args)
    for flag in STORE_ENV:
        args = without(args, flag)
    return args, {STORE_ENV[flag]: value for flag, value in gateway_stores(gateway_args, environ).items()}


async def check_stores(stores: dict[str, str]) -> None:
    """Pings each store of ``stores`` (flag → URL), in order; checks the task store's
    Redis can serve it as the gateway will at start (``check_serves_tasks``: version
    6.2 or later, the create script loads), and prints a ``warning:`` line to stderr
    when its tasks would not survive a restart of it (``durability_warning``).

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
            warning = await ping(url, serves_tasks=flag == "--task-store")
        except ConnectionError as exc:
            raise ConnectionError(f"{flag} {redact_url(url)}: {exc}") from None
        if warning:
            print(f"warning: {flag} {redact_url(url)}: {warning}", file=sys.stderr)
