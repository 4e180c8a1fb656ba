"""The registry of connected executors and the KV blocks promised to each.

An executor reports its free blocks and the leases it holds. Between an
assignment and the report in which the executor first lists the new lease, the
scheduler counts that lease's prompt blocks as *pending* against the executor, so
two quick admissions cannot both take the same free blocks. A pending lease the
executor never reports (the gateway died before calling Execute) stops counting
after ``pending_timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Lease:
    """One admitted request on one executor.

    Attributes:
        lease_id: unique id, passed by the gateway to Execute and Release.
        request_id: the request's id.
        executor_id: where it runs.
        num_blocks: KV blocks its prompt needs (blocks).
        tenant: tenant name.
        assigned_at: clock time of the assignment (seconds).
        acked: True once the executor has listed the lease in a report.
        num_prompt_tokens: the request's prompt tokens (predictor feature).
        n: the request's choices.
        predicted_output_tokens: the predictor's answer per choice when queued
            (scored against the real length at release).
        num_hit_tokens: prompt tokens expected from the executor's prefix
            cache when it was routed (``scheduler.placement``).
        reported_tokens: tokens of the KV blocks its requests held at the
            executor's last per-lease report (blocks × block_size), or None.
        reserved_blocks: blocks admission reserved (``num_blocks`` starts
            there and follows the executor's per-lease reports, see
            ``scheduler.lease_table``).
        expires_at: clock time at which it expires unless renewed (seconds).
        listed: its executor listed it in its last report (its request is there).
    """

    lease_id: str
    request_id: str
    executor_id: str
    num_blocks: int
    tenant: str
    assigned_at: float
    acked: bool = False
    num_prompt_tokens: int = 0
    n: int = 1
    predicted_output_tokens: int | None = None
    num_hit_tokens: int = 0
    reported_tokens: int | None = None
    reserved_blocks: int = 0
    expires_at: float = float("inf")
    listed: bool = False


@dataclass
class ExecutorState:
    """What the scheduler knows of one executor (from Register and reports)."""

    executor_id: str
    address: str
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int
    pool: str = "default"
    kvstore_namespace: bytes = b""  # its blocks' namespace in the kvstore (empty: no kvstore)
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)
    listed_lease_ids: frozenset[str] = frozenset()  # the lease ids of its last report
    draining: bool = False  # asked to stop: nothing new is routed to it (scheduler.placement)

    def pending_blocks(self, now: float, pending_timeout_s: float) -> int:
        """Blocks of leases assigned here that its last report did not include yet."""
        return sum(
            lease.num_blocks
            for lease in self.leases.values()
            if not lease.acked and now - lease.assigned_at < pending_timeout_s
        )

    def available_blocks(self, now: float, pending_timeout_s: float) -> int:
        """Reported free blocks minus pending promises (may be negative)."""
        return self.num_free_blocks - self.pending_blocks(now, pending_timeout_s)


class ExecutorRegistry:
    """Executors by id; a lost Connect stream removes its executor at once."""

    def __init__(self) -> None:
        self._executors: dict[str, ExecutorState] = {}

    def __len__(self) -> int:
        return len(self._executors)

    def __iter__(self):
        return iter(list(self._executors.values()))

    def get(self, executor_id: str) -> ExecutorState | None:
        return self._executors.get(executor_id)

    def add(self, state: ExecutorState) -> None:
        """Registers (or re-registers, replacing) an executor; it starts fully free."""
        state.num_free_blocks = state.num_free_blocks or state.num_blocks
        self._executors[state.executor_id] = state

    def remove(self, executor_id: str) -> list[Lease]:
        """Drops an executor; returns the leases it held (``AdmissionCore.remove_executor``
        detaches them)."""
        state = self._executors.pop(executor_id, None)
        return list(state.leases.values()) if state else []

    def report(
        self, executor_id: str, num_free_blocks: int, num_running: int, num_waiting: int, lease_ids: set[str]
    ) -> None:
        """Applies a capacity report: leases it lists become acknowledged and listed,
        the executor's other leases not listed."""
        state = self._executors.get(executor_id)
        if state is None:
            return
        state.num_free_blocks = num_free_blocks
        state.num_running = num_running
        state.num_waiting = num_waiting
        state.listed_lease_ids = frozenset(lease_ids)
        for lease in state.leases.values():
            lease.listed = lease.lease_id in lease_ids
            lease.acked = lease.acked or lease.listed
