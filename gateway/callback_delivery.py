"""Delivers one finished task's callback and records it in the task store (the
runner's ``on_final``; pure core over ``TaskStore`` and ``CallbackSender``).

The delivery is held by one gateway at a time: the record's ``callback_owner``
(set by the runner's final transition, or by ``TaskStore.claim_callback`` when
it takes over the delivery of a gateway that died mid-POST). Each attempt is
written fenced by that ownership (``callback_fence``), so a gateway whose
delivery was taken over records nothing more; a takeover goes on numbering from
the attempts recorded. The body is the task's final status without its
``callback`` field (``callback_body``), the same bytes on every attempt and
every gateway, so a receiver deduplicating by ``X-Meshserve-Task-Id`` sees one
logical delivery (``gateway.callbacks``).
"""

from __future__ import annotations

import logging
from typing import Callable

from google.protobuf import json_format
from prometheus_client import Counter

from gateway.callbacks import Attempt, CallbackSender
from gateway.task_store import FINISHED, TaskRecord, TaskStore
from meshserve.errors import MeshError
from meshserve.v1 import gateway_pb2

log = logging.getLogger(__name__)


def callback_body(status: gateway_pb2.TaskStatus) -> bytes:
    """The body POSTed to a task's callback: its final ``TaskStatus`` as JSON (protobuf's
    JSON mapping, compact), without the ``callback`` field."""
    status = gateway_pb2.TaskStatus.FromString(status.SerializeToString())
    status.ClearField("callback")
    return json_format.MessageToJson(status, indent=None).encode()


class CallbackDelivery:
    """``await delivery(record)``: POSTs the record's callback if this gateway holds it.

    Args:
        store: the task store (attempts and the outcome are written there).
        sender: the signed POSTs with their retries.
        owner: this gateway's id (the runner's ``owner``).
        status_of: a record's final ``TaskStatus`` (``gateway.task_api.to_status``).
        posts / outcomes: counters by ``outcome`` label (delivered, failed) of POSTs
            and of deliveries; None: not counted.
    """

    def __init__(self, store: TaskStore, sender: CallbackSender, owner: str,
                 status_of: Callable[[TaskRecord], gateway_pb2.TaskStatus],
                 posts: Counter | None = None, outcomes: Counter | None = None):
        self.store, self.sender, self.owner, self.status_of = store, sender, owner, status_of
        self.posts, self.outcomes = posts, outcomes

    async def __call__(self, record: TaskRecord) -> None:
        if not record.callback_pending or record.callback_owner != self.owner:
            return
        body = callback_body(self.status_of(record))

        async def on_attempt(attempt: Attempt) -> None:
            if self.posts is not None:
                self.posts.labels("delivered" if attempt.delivered else "failed").inc()
            changes = dict(callback_state="delivered" if attempt.delivered else "pending",
                           callback_error=attempt.error, callback_attempts=attempt.number)
            if attempt.delivered:
                changes["callback_owner"] = ""
            await self._write(record.task_id, f"attempt {attempt.number}", **changes)

        last = await self.sender.deliver(record.callback_url, record.task_id, body, on_attempt,
                                         first=record.callback_attempts + 1)
        if self.outcomes is not None:
            self.outcomes.labels("delivered" if last.delivered else "failed").inc()
        if not last.delivered:
            await self._write(record.task_id, "failure", callback_state="failed", callback_error=last.error,
                              callback_owner="")

    async def _write(self, task_id: str, what: str, **changes) -> None:
        try:
            await self.store.transition(task_id, FINISHED, None, callback_fence=self.owner, **changes)
        except MeshError as exc:
            log.warning("task %s: callback %s not recorded: %s", task_id, what, exc)
