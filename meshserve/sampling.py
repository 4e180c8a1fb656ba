"""Sampling parameters: one validated, defaulted form shared by gateway and executor.

The gateway validates a request's parameters once against the model's limits and
the executor checks them again with the same function, so both give the same
INVALID_ARGUMENT message naming the field.

Policies (documented in the README):

* ``max_tokens`` in [1, max_model_len]; default 16. A prompt plus ``max_tokens``
  beyond ``max_model_len`` is clamped: generation stops at ``max_model_len`` with
  finish reason "length".
* ``temperature`` >= 0 and finite; below ``GREEDY_TEMPERATURE`` (1e-3) it is greedy.
* ``top_p`` in (0, 1]; 0 is rejected (not "greedy"): set temperature 0 for that.
* ``top_k`` >= -1; 0 and -1 both mean "off" (vLLM's convention); 1 is greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshserve.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 16
GREEDY_TEMPERATURE = 1e-3
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request.

    Attributes:
        max_tokens: maximum number of generated tokens (>= 1).
        temperature: softmax temperature (>= 0); see ``greedy``.
        top_p: nucleus mass in (0, 1]; 1.0 is off.
        top_k: keep the k most likely tokens; 0 is off.
        seed: seed of the request's own torch generator, or None.
        stop: stop strings (handled by the gateway's detokenizer).
        stop_token_ids: token ids that end generation (the token is returned).
        ignore_eos: keep generating past the model's EOS tokens.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def validate(params: SamplingParams, *, max_model_len: int, vocab_size: int) -> SamplingParams:
    """Checks every field against the model's limits; returns the normalised params
    (``top_k`` -1 becomes 0).

    Raises:
        InvalidArgument: a field is out of range; the message names it.
    """
    _check(
        1 <= params.max_tokens <= max_model_len,
        f"max_tokens must be in [1, {max_model_len}] (max_model_len), got {params.max_tokens}",
    )
    t = params.temperature
    _check(math.isfinite(t) and t >= 0.0, f"temperature must be a finite number >= 0, got {t}")
    p = params.top_p
    _check(math.isfinite(p) and 0.0 < p <= 1.0, f"top_p must be in (0, 1], got {p}")
    _check(params.top_k >= -1, f"top_k must be >= 1, or 0 / -1 for off, got {params.top_k}")
    _check(
        len(params.stop) <= MAX_STOP_STRINGS,
        f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}",
    )
    for s in params.stop:
        _check(0 < len(s) <= MAX_STOP_STRING_CHARS, f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
    _check(
        len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
        f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}",
    )
    for tid in params.stop_token_ids:
        _check(0 <= tid < vocab_size, f"stop_token_ids entry {tid} is outside the vocabulary [0, {vocab_size})")
    return replace(params, top_k=0) if params.top_k == -1 else params


def from_proto(msg, *, max_model_len: int, vocab_size: int) -> SamplingParams:
    """Builds validated ``SamplingParams`` from a ``meshserve.v1.SamplingParams``.

    Unset optional fields take the defaults above.

    Raises:
        InvalidArgument: see ``validate``.
    """
    params = SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )
    return validate(params, max_model_len=max_model_len, vocab_size=vocab_size)


def to_proto(params: SamplingParams, msg) -> None:
    """Writes ``params`` into an empty ``meshserve.v1.SamplingParams`` message."""
    msg.max_tokens = params.max_tokens
    msg.temperature = params.temperature
    msg.top_p = params.top_p
    msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    msg.stop.extend(params.stop)
    msg.stop_token_ids.extend(params.stop_token_ids)
    msg.ignore_eos = params.ignore_eos
