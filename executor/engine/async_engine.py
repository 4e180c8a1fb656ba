"""AsyncEngine: runs ``LLMEngine.step()`` in one dedicated thread for asyncio servers.

(Over 400 lines: the command queues, the engine thread and the output dispatch keep one
ordering invariant together — an abort is applied before a reused id's outputs, a
reader's backlog is bounded — so they stay in one file; the n > 1 merge is in ``choices``.)

::

    event loop (gRPC)                         engine thread
    ─────────────────                         ─────────────
    generate(): check_request
    generate_choices(): (checked by the caller)
                put ("add") ────┐
    cancel:     put ("abort") ──┼──▶ _commands ──▶ add_checked / abort_request
                wake ───────────┘                  (in call order, start of each step)
                                               step() ──▶ outputs
    per-request asyncio.Queue ◀── call_soon_threadsafe(_dispatch, outputs, stats)

Only the engine thread touches the ``LLMEngine`` (it is not thread-safe), except
``check_request``, which reads immutable limits: the loop calls it first so that
``InvalidArgument`` is raised by ``generate`` before any output (the thread adds
it unchecked). ``generate_choices`` runs the ``n`` choices of a request the caller
checked, merged into one stream (``executor.engine.choices``). When there is no
work the thread sleeps on an event (no busy loop). ``on_stats`` runs in the loop
when the counters changed, at most every ``STATS_INTERVAL_S`` (a last change is
always delivered once the engine goes idle). The engine's prefix-cache events
(``LLMEngine.take_kv_events``) are drained by the thread after every step and
handed to ``on_kv_events`` in the loop, in order.

Slow consumers: a request's queue holds at most ``max_buffered_outputs``
outputs that its consumer has not taken. An output that would exceed the bound ends
the request instead: the consumer gets ``ResourceExhausted`` after the outputs
already queued, and the request is aborted at the start of the next step (its KV
blocks freed), so a reader that stalls can neither grow the executor's memory nor
keep its blocks and batch slot. A finished output is always queued (it ends the
request: at most one past the bound). Until the engine applied an abort, outputs it
made for the aborted request are dropped, so a new request reusing the id at once
(a retry) reads only its own. Every other request is untouched: outputs are
handed over with ``put_nowait``, the engine thread never waits on a consumer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from executor.engine.choices import merge_choices
from executor.engine.llm_engine import LLMEngine
from executor.engine.outputs import EngineStats, RequestOutput
from executor.engine.request import CheckedRequest
from meshserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from meshserve.sampling import SamplingParams

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05
DEFAULT_MAX_BUFFERED_OUTPUTS = 256
_ABORTED = object()  # in a dispatch: (request_id, _ABORTED), the engine applied an abort of that id


@dataclass(eq=False)
class _Stream:
    """One engine request's outputs not yet taken, and the caller's request it is of."""

    queue: asyncio.Queue
    request_id: str


class AsyncEngine:
    """An ``LLMEngine`` behind an asyncio interface.

    Args:
        engine: the engine; from ``start()`` on only the engine thread uses it.
        on_stats: called in the event loop with fresh ``EngineStats`` when they change
            (at most every ~50 ms).
        on_kv_events: called in the event loop with the prefix-cache events of
            each step that had some (a list, oldest first).
        max_buffered_outputs: outputs a request's consumer may leave untaken before
            the request is ended with ``ResourceExhausted`` (>= 1).

    Raises:
        ValueError: ``max_buffered_outputs`` < 1.
    """

    def __init__(self, engine: LLMEngine, on_stats: Callable[[EngineStats], None] | None = None,
                 on_kv_events: Callable[[list], None] | None = None,
                 max_buffered_outputs: int = DEFAULT_MAX_BUFFERED_OUTPUTS):
        if max_buffered_outputs < 1:
            raise ValueError(f"max_buffered_outputs must be >= 1, got {max_buffered_outputs}")
        self.engine = engine
        self.max_buffered_outputs = max_buffered_outputs
        self.num_overflowed = 0  # requests ended because their consumer fell behind
        self.max_buffered_seen = 0  # the largest backlog any request's queue reached
        self._on_stats = on_stats
        self._on_kv_events = on_kv_events
        # ("add", request_id, CheckedRequest, priority, trace_context) | ("abort", request_id), in call order
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}  # engine request id -> its open stream
        # ids with an abort queued but not yet applied by the engine thread (count per id):
        # outputs for such an id are the old request's, never a new request's of the same id
        self._aborting: dict[str, int] = {}
        self._stats = engine.stats()
        self._failure: BaseException | None = None
        self._failure_callbacks: list[Callable[[BaseException], None]] = []
        self._step_started_at: float | None = None  # ``clock()`` time the running step began
        # the clock ``step_running_s`` reads (seconds); tests set a fake one to wedge a step
        # without waiting in real time
        self.clock: Callable[[], float] = time.monotonic

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Calls ``callback(exc)`` in the event loop if the engine thread dies (a bug
        or a broken device): the owner stops serving and leaves the scheduler."""
        self._failure_callbacks.append(callback)

    def step_running_s(self) -> float:
        """Seconds the engine's current step has been running (0 between steps);
        a watchdog reads it from the event loop to detect a wedged step."""
        started = self._step_started_at
        return 0.0 if started is None else self.clock() - started

    def fail_requests(self, message: str) -> int:
        """Ends every open stream with ``Unavailable(message)`` (a wedged engine:
        callers retry elsewhere instead of hanging); their requests are aborted
        when the engine runs again. Returns the number of streams ended."""
        error = Unavailable(message)
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        return len(self._streams)

    @property
    def num_queued_commands(self) -> int:
        """Adds and aborts queued for the engine thread and not applied yet (it applies
        them, in call order, at the start of its next step)."""
        return self._commands.qsize()

    @property
    def failure(self) -> BaseException | None:
        """What killed the engine thread, or None while it runs."""
        return self._failure

    async def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.engine.kv_connector is not None:
            self.engine.kv_connector.set_waker(self._wake.set)  # a finished fetch wakes an idle engine
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Aborts every request, stops the thread, and ends open streams with "abort"."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        close = getattr(self.engine.kv_connector, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
            self.engine.set_kv_connector(None)
        for request_id, stream in list(self._streams.items()):
            stream.queue.put_nowait(RequestOutput(request_id, [], True, "abort"))

    def stats(self) -> EngineStats:
        """The latest counters (as of the engine thread's last step or idle moment)."""
        return self._stats

    def num_blocks_by_request(self, stats: EngineStats | None = None) -> dict[str, int]:
        """KV blocks held per caller's request with an open stream, in ``stats`` (default:
        the latest); an ``n`` > 1 request's choices are summed under its id."""
        out: dict[str, int] = {}
        for engine_id, blocks in (stats or self._stats).num_blocks_by_request:
            stream = self._streams.get(engine_id)
            if stream is not None:
                out[stream.request_id] = out.get(stream.request_id, 0) + blocks
        return out

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, trace_context: object = None) -> AsyncIterator[RequestOutput]:
        """Checks a request (``LLMEngine.check_request``), adds it and yields its outputs
        until one is ``finished``. ``params.n`` is not looked at: one engine request.

        ``trace_context`` (an OpenTelemetry context) parents the engine's kvstore spans.

        Raises:
            InvalidArgument: the request is invalid or its id is in use (before any output).
            Unavailable: the engine is not running, or its thread failed (the cause is
                logged and kept in ``failure``).
            ResourceExhausted: the consumer left ``max_buffered_outputs`` outputs
                untaken; the request was aborted.

        Cancelling the consumer (``CancelledError``, ``aclose()``) aborts the request;
        its blocks are freed at the start of the engine's next step.
        """
        self._check_can_add(request_id)
        checked = self.engine.check_request(prompt_token_ids, params)
        stream = self._add(request_id, request_id, checked, priority, trace_context)
        async with aclosing(self._read(request_id, stream)) as outs:
            async for out in outs:
                yield out

    async def generate_choices(self, request_id: str, request: CheckedRequest, priority: int = 0,
                               trace_context: object = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs the ``n`` choices of a request checked by ``LLMEngine.check_request``, one
        engine request each (``CheckedRequest.for_choice``), and yields ``(choice index,
        output)`` as they come until every choice finished (``merge_choices``: bounded).

        The choices' engine ids are internal (``"<request_id>#<index>"``, injective: a
        caller id ending in ``"#<k>"`` cannot take another request's choice).

        Raises:
            InvalidArgument: an empty request id, or a choice's id in use.
            Unavailable, ResourceExhausted: as ``generate`` (for any choice).

        Closing it aborts every unfinished choice; once closed, no stream of its choices
        is left open, so the id may be used again at once.
        """
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        engine_ids = [f"{request_id}#{index}" for index in range(request.sampling_params.n)]
        for engine_id in engine_ids:
            self._check_can_add(engine_id)
        streams = [self._add(engine_id, request_id, request.for_choice(index), priority, trace_context)
                   for index, engine_id in enumerate(engine_ids)]
        try:
            async with aclosing(merge_choices([self._read(engine_id, stream)
                                               for engine_id, stream in zip(engine_ids, streams)])) as outs:
                async for index, out in outs:
                    yield index, out
        finally:
            for engine_id, stream in zip(engine_ids, streams):
                self._release(engine_id, stream)  # a choice whose reader never started

    def _check_can_add(self, request_id: str) -> None:
        """Raises ``Unavailable`` (not running) or ``InvalidArgument`` (empty id, or in use)."""
        if self._thread is None or self._stopping or self._failure is not None:
            raise Unavailable("engine is not running")
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        if request_id in self._streams:
            raise InvalidArgument(f"request_id {request_id!r} is already in use by an unfinished request")

    def _add(self, engine_id: str, request_id: str, checked: CheckedRequest, priority: int,
             trace_context: object) -> _Stream:
        """Opens engine request ``engine_id``'s stream and queues its add for the thread."""
        stream = self._streams[engine_id] = _Stream(asyncio.Queue(), request_id)
        self._commands.put(("add", engine_id, checked, priority, trace_context))
        self._wake.set()
        return stream

    async def _read(self, engine_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """Yields the stream's outputs up to a finished one (raises an error put in it)."""
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item  # the finally aborts it (a no-op for a request the engine refused)
                finished = item.finished
                yield item
        finally:
            self._release(engine_id, stream, finished)

    def _release(self, engine_id: str, stream: _Stream, finished: bool = False) -> None:
        """Closes ``stream``, aborting its request unless finished; no-op if already closed."""
        if self._streams.get(engine_id) is stream:
            del self._streams[engine_id]
            if not finished:
                self._abort(engine_id)

    # -- event loop side ------------------------------------------------------

    def _dispatch(self, outputs: list, stats: EngineStats | None, kv_events: list | None = None) -> None:
        if kv_events and self._on_kv_events is not None:
            try:
                self._on_kv_events(kv_events)
            except Exception:  # noqa: BLE001 - a callback bug must not kill dispatch
                log.exception("on_kv_events callback failed")
        for item in outputs:
            request_id, value = item
            if value is _ABORTED:
                pending = self._aborting.get(request_id, 0) - 1
                if pending > 0:
                    self._aborting[request_id] = pending
                else:
                    self._aborting.pop(request_id, None)
                continue
            if request_id in self._aborting:
                continue  # produced for the aborted request before the engine applied the abort
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            backlog = stream.queue
            # a finished output ends the request (nothing left to abort): queued, one past the bound
            if (backlog.qsize() >= self.max_buffered_outputs and not isinstance(value, BaseException)
                    and not value.finished):
                self._overflow(request_id, backlog)
                continue
            backlog.put_nowait(value)
            self.max_buffered_seen = max(self.max_buffered_seen, backlog.qsize())
        if stats is not None and self._on_stats is not None:
            try:
                self._on_stats(stats)
            except Exception:  # noqa: BLE001 - a callback bug must not kill dispatch
                log.exception("on_stats callback failed")

    def _overflow(self, request_id: str, backlog: asyncio.Queue) -> None:
        """Ends a request whose consumer fell ``max_buffered_outputs`` behind: no more
        outputs are queued for it, its consumer reads ``ResourceExhausted`` after those
        queued, and the engine aborts it (freeing its blocks) at its next step."""
        del self._streams[request_id]
        self.num_overflowed += 1
        log.warning("request %s: its reader left %d outputs untaken; aborted", request_id, backlog.qsize())
        backlog.put_nowait(ResourceExhausted(
            f"the stream is read too slowly: {backlog.qsize()} messages were waiting "
            f"(bound {self.max_buffered_outputs}); the request was aborted", retry_after_s=1.0))
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        """Queues the abort of ``request_id``; until the engine thread applied it, outputs
        for that id are dropped (a new request may already reuse the id)."""
        self._aborting[request_id] = self._aborting.get(request_id, 0) + 1
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _fail(self, exc: BaseException) -> None:
        # callers see UNAVAILABLE (retry elsewhere); the cause is logged with its traceback
        self.fail_requests(f"engine failed: {type(exc).__name__}: {exc}")
        for callback in self._failure_callbacks:
            try:
                callback(exc)
            except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                log.exception("engine failure callback failed")

    def _send(self, outputs: list, stats: EngineStats | None, kv_events: list | None = None) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs, stats, kv_events)

    # -- engine thread --------------------------------------------------------

    def _run(self) -> None:
        last_sent_stats, last_sent_at = None, 0.0
        try:
            while not self._stopping:
                self._wake.clear()
                errors = self._apply_queues()
                self._step_started_at = self.clock()
                try:
                    step_outputs = self.engine.step()
                finally:
                    self._step_started_at = None
                outputs = errors + [(o.request_id, o) for o in step_outputs]
                self._stats = self.engine.stats()
                now = time.monotonic()
                stats = None
                if self._stats != last_sent_stats and now - last_sent_at >= STATS_INTERVAL_S:
                    stats, last_sent_stats, last_sent_at = self._stats, self._stats, now
                kv_events = self.engine.take_kv_events()
                if outputs or stats is not None or kv_events:
                    self._send(outputs, stats, kv_events)
                if not self.engine.has_unfinished_requests() and self._commands.empty():
                    self._check_integrity()
                    pending = self._stats != last_sent_stats
                    self._wake.wait(max(0.0, STATS_INTERVAL_S - (now - last_sent_at)) if pending else None)
                elif self.engine.last_step_was_empty and self._commands.empty():
                    # prefills held for batching (max_batch_wait_ms) or kvstore fetches in flight:
                    # sleep until released, woken (a fetch finished, a new command) or a deadline
                    deadline = self.engine.wake_deadline()
                    self._wake.wait(max(0.0, deadline - time.monotonic()) if deadline is not None else 0.001)
            self._abort_all()
        except BaseException as exc:  # noqa: BLE001 - reported to every stream
            log.exception("engine thread failed")
            self._failure = exc
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail, exc)

    def _check_integrity(self) -> None:
        """The KV conservation invariant, checked whenever the engine goes idle; a
        violation is our bug: logged loudly, not raised into callers."""
        try:
            self.engine.check_integrity()
        except AssertionError:
            log.exception("KV cache integrity check failed")

    def _apply_queues(self) -> list:
        """Applies queued adds and aborts in call order; returns, in that order,
        ``(request_id, error)`` for adds the engine refused and ``(request_id, _ABORTED)``
        for aborts applied (every output of the aborted request was sent before it)."""
        errors = []
        while not self._commands.empty():
            command = self._commands.get()
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                errors.append((command[1], _ABORTED))
                continue
            _, request_id, checked, priority, trace_context = command
            try:
                self.engine.add_checked(request_id, checked, priority, trace_context)
            except InvalidArgument as exc:
                errors.append((request_id, exc))
        return errors

    def _abort_all(self) -> None:
        applied = self._apply_queues()
        for request_id in list(self.engine.batch_scheduler.requests):
            self.engine.abort_request(request_id)
        self._stats = self.engine.stats()
        self._send(applied, self._stats, self.engine.take_kv_events())
