"""Stop conditions checked after each sampled token (stop strings are the gateway's)."""

from __future__ import annotations

from executor.engine.request import Request, RequestStatus


def check_stop(request: Request, eos_token_ids: frozenset[int]) -> RequestStatus | None:
    """The finished status the request's last token puts it in, or None to go on.

    Order: a stop token id or EOS (unless ``ignore_eos``) is "stop" even when it is
    also the last allowed token; then ``max_tokens`` and ``request.max_len``
    (``max_model_len`` or the cache's capacity, clamped) are "length".
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= request.max_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
