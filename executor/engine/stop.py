"""Stop conditions checked after each sampled token (stop strings are the gateway's)."""

from __future__ import annotations

from executor.engine.request import Request, RequestStatus


def check_stop(request: Request, eos_token_ids: frozenset[int]) -> RequestStatus | None:
    """The finished status the request's last token puts it in, or None to go on.

    Order: a stop token id or EOS (unless ``ignore_eos``, which ignores only the
    model's EOS ids, never ``stop_token_ids``) is "stop" even when it is also the
    last allowed token; then ``max_tokens`` and ``request.max_len``
    (``max_model_len`` or the cache's capacity, clamped) are "length".

    ``min_tokens``: the first ``min_tokens`` outputs never stop on a stop token id
    or EOS (the sampler masks those ids there, so they cannot even be sampled).

    A structured output whose grammar terminated (it accepted EOS where it was
    complete) is "stop" too, ``ignore_eos`` or not: the grammar allows nothing more; one
    whose mask took too long to fill (``GrammarState.overran``) is "abort" after the
    token that mask chose (``executor.engine.structured_output.MAX_MASK_FILL_S``).
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    may_stop = len(request.output_token_ids) > params.min_tokens
    if may_stop and (last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids)):
        return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.terminated:
        return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.overran:
        return RequestStatus.FINISHED_ABORTED
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= request.max_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
