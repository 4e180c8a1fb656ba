"""A prepared request's run on the mesh: the scheduler's admission, then the assigned
executor's stream, under a lease.

``MeshRunner.run`` takes a ``Prepared`` request (``gateway.preparation``) to the
scheduler and its executors through the mesh client (``gateway.mesh.MeshClient``) and
yields its events (``gateway.events``):

1. ``Admit``, with the prompt's routing chain hashes (salted as the executors salt
   their chains: ``meshserve.block_hash.cache_salt``) and the lease id it proposes:
   ``Queued`` events while the request waits, then an ``Assignment``;
2. ``Execute`` on the assigned executor while the lease is renewed
   (``gateway.lease_renewal``): each output goes through its choice's detokenizer and
   stop strings (``gateway.choices.Choice``) and comes out as a ``Delta``, each finished
   choice as a ``ChoiceResult``; the call is closed (cancelled: the engine frees the
   request's blocks) once every choice is done;
3. ``Release`` however the run ends, with the tokens generated so far; meanwhile the
   request id is marked ending, so that a retry under it waits instead of being refused.

``refused_for_now`` tells a run's error that is the scheduler's refusal with a retry
delay, before any executor was assigned: asking again later may succeed.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

from opentelemetry import trace

from gateway.choices import Choice
from gateway.events import ChoiceResult, Delta, Queued
from gateway.lease_renewal import LeaseActivity, renewing
from gateway.mesh import Admission, Assignment, MeshClient, RefusedByMesh
from gateway.request import ModelInfo, Prepared
from meshserve import trace_attributes as ta
from meshserve.block_hash import cache_salt, routing_block_hashes
from meshserve.errors import (AlreadyExists, InvalidArgument, MeshError, NotFound, ResourceExhausted,
                              Unavailable)

# The errors with which the scheduler's Admit refuses a request before granting anything:
# its caller-facing codes, and its PERMISSION_DENIED or UNAUTHENTICATED, which the mesh
# client raises as ``RefusedByMesh``. A plain UNAVAILABLE is not one of them: a lost
# connection is UNAVAILABLE too, and the Assignment may have been written before it broke.
_ADMIT_REFUSALS = (InvalidArgument, AlreadyExists, ResourceExhausted, NotFound, RefusedByMesh)

OnAssigned = Callable[[], Awaitable[None]]


def refused_for_now(error: BaseException | None, prepared: Prepared) -> bool:
    """Whether a run ended with the scheduler's refusal that carries a retry delay
    (RESOURCE_EXHAUSTED: a rate limit, a full queue, displaced) before any executor
    was assigned: asking again later may succeed."""
    return isinstance(error, ResourceExhausted) and error.retry_after_s is not None and not prepared.timer.assigned


def finish_reasons(choices) -> list[str]:
    """``gen_ai.response.finish_reasons`` of choices (or results), in order."""
    return ta.finish_reasons([c.finish_reason.value if c.finish_reason else None for c in choices])


class MeshRunner:
    """Runs prepared requests for one model through the scheduler and its executors.

    Args:
        mesh: the scheduler and executors (``gateway.mesh_client.GrpcMeshClient``).
        tokenizer: the model's tokenizer (each choice's detokenizer).
        model: the model served.
        hash_block_size: tokens per block of the prompt chain hashes sent for
            prefix-aware routing (the executors' ``block_size``; 0: none sent).
        prefix_cache_scope: ``tenant`` or ``global``, as the executors': the routing
            hashes are salted as they salt their chains (``meshserve.block_hash.cache_salt``:
            with the request's own ``cache_salt``, which travels to the executor).
        mark_ending: marks a request's id as ending, before its lease is released
            (``gateway.preparation.RequestPreparer.mark_ending``).

    Raises:
        ValueError: an unknown ``prefix_cache_scope``.
    """

    def __init__(self, mesh: MeshClient, tokenizer, model: ModelInfo, hash_block_size: int,
                 prefix_cache_scope: str, mark_ending: Callable[[Prepared], None]):
        self.mesh = mesh
        self.tokenizer = tokenizer
        self.model = model
        self.hash_block_size = hash_block_size
        cache_salt(prefix_cache_scope, "")  # validates
        self.prefix_cache_scope = prefix_cache_scope
        self.mark_ending = mark_ending
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        # the model's other EOS ids (generation_config.json's) end a choice as stop tokens (vLLM adds
        # them to stop_token_ids): its stop_reason names them; the tokenizer's own EOS is not named
        self.other_eos_ids = tuple(sorted(model.eos_token_ids - {self.eos_token_id}))

    def _admission(self, p: Prepared) -> Admission:
        hashes: tuple[bytes, ...] = ()
        if self.hash_block_size > 0:
            hashes = tuple(routing_block_hashes(p.prompt_ids, self.hash_block_size, self.model.model_id,
                                                self.model.revision,
                                                cache_salt=cache_salt(self.prefix_cache_scope, p.tenant,
                                                                      p.cache_salt)))
        return Admission(p.request_id, p.tenant, p.priority, len(p.prompt_ids), p.params.max_tokens,
                         self.model.model_id, p.params.n, hashes, self.hash_block_size, uuid.uuid4().hex)

    async def run(self, p: Prepared, span: trace.Span, on_assigned: OnAssigned | None
                  ) -> AsyncIterator[Queued | Delta | ChoiceResult]:
        """Admission (queue updates), then the executor's stream; the lease is released
        however it ends once the scheduler sent it (also while its Admit stream is still
        ending), with the tokens generated so far (charged to the tenant however the
        request ended; they teach the predictor when every choice finished). When admission
        ends without an assignment other than by the scheduler's refusal (the caller went
        away, a deadline, the connection lost), the lease id the admission proposed is
        released too: the scheduler may have granted it with the assignment still on
        its way."""
        assignment, queued, finished, answered = None, False, False, False
        choices: list[Choice] = []
        admission = self._admission(p)
        try:
            async with aclosing(self.mesh.admit(admission, span)) as events:
                async for event in events:
                    if isinstance(event, Queued):
                        if not queued:  # the position at which it joined the queue
                            queued = True
                            span.set_attribute(ta.QUEUE_POSITION, event.position)
                        yield event
                    else:
                        assignment = event
            answered = True  # the Admit stream ended: what was granted, if anything, is in `assignment`
            if assignment is None:
                raise Unavailable("scheduler ended admission without an assignment")
            p.timer.assigned = time.monotonic()
            p.metrics.assigned(p.timer.assigned)
            span.set_attributes({ta.EXECUTOR_ID: assignment.executor_id, ta.QUEUE_WAIT_S: assignment.queue_s})
            eos = None if p.params.ignore_eos else self.eos_token_id
            stop_ids = p.params.stop_token_ids if p.params.ignore_eos else (*p.params.stop_token_ids,
                                                                            *self.other_eos_ids)
            choices = [Choice(i, self.tokenizer, p.prompt_ids, p.params.stop, stop_ids, eos, p.params.min_tokens)
                       for i in range(p.params.n)]
            async with renewing(self.mesh, assignment, span) as activity:
                if on_assigned is not None:
                    await on_assigned()
                async with aclosing(self._execute(p, assignment, choices, span, activity)) as events:
                    async for event in events:
                        yield event
            finished = True
        except MeshError as exc:
            if assignment is None and isinstance(exc, _ADMIT_REFUSALS):  # refused: the scheduler holds nothing for it
                answered = True
            raise
        finally:
            if assignment is not None or not answered:  # the id is ending: a retry under it waits, not refused
                self.mark_ending(p)
            if assignment is not None:
                generated = p.num_generated_tokens if choices else None
                await self.mesh.release(assignment.lease_id, generated, finished, span)
            elif not answered:  # given up mid-admission: a grant may be on its way, under the proposed id
                await self.mesh.release(admission.lease_id, None, False, span)

    async def _execute(self, p: Prepared, assignment: Assignment, choices: list[Choice],
                       span: trace.Span, activity: LeaseActivity) -> AsyncIterator[Delta | ChoiceResult]:
        """The executor's outputs through each choice's detokenizer and stop strings
        (each one touches ``activity``: the lease needs no renewal call meanwhile);
        the call is cancelled (closed) once every choice is done."""
        timer, rm = p.timer, p.metrics
        outputs = self.mesh.execute(assignment, p.request_id, p.prompt_ids, p.params, p.priority, span,
                                    cache_salt=p.cache_salt)
        async with aclosing(outputs):
            async for out in outputs:
                activity.touch()
                if not 0 <= out.index < len(choices):
                    raise Unavailable(f"executor {assignment.executor_id} sent choice {out.index} of {p.params.n}")
                choice = choices[out.index]
                p.num_generated_tokens += len(out.token_ids)  # charged to the tenant, cut or not
                if choice.done:
                    continue  # cut by a stop string; the executor runs it until all choices end
                now = time.monotonic()
                if out.token_ids and not timer.first_token:
                    timer.first_token = now
                    span.add_event(ta.EVENT_FIRST_TOKEN)
                    rm.first_token(now)
                rm.tokens(len(out.token_ids))
                yield choice.feed(out, now)
                if choice.done:
                    rm.choice_done(choice.num_tokens, choice.first_token, choice.last_token)
                    yield choice.result(p.request_id, p.prompt_ids, assignment.executor_id, timer)
                if all(c.done for c in choices):
                    break
        if not all(c.done for c in choices):
            raise Unavailable(f"executor {assignment.executor_id} ended the stream without finishing")
        span.set_attributes({ta.USAGE_OUTPUT_TOKENS: sum(c.num_tokens for c in choices),
                             ta.USAGE_CACHE_READ_INPUT_TOKENS: choices[0].num_cached_tokens,
                             ta.RESPONSE_ID: p.request_id, ta.RESPONSE_MODEL: self.model.model_id,
                             ta.RESPONSE_FINISH_REASONS: finish_reasons(choices)})
