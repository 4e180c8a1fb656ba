"""Sampling parameters: one validated, defaulted form shared by gateway and executor.

Each service validates a request's parameters once, where the request enters it
(the gateway in ``GatewayCore.prepare``, the executor in ``LLMEngine.check_request``:
it does not trust its caller), with the same function, so both give the same
INVALID_ARGUMENT message naming the field. Nothing behind a boundary validates again.

Policies (documented in docs/api.md):

* ``max_tokens`` in [1, max_model_len]; default 16. A prompt plus ``max_tokens``
  beyond ``max_model_len`` is clamped: generation stops at ``max_model_len`` with
  finish reason "length".
* ``temperature`` >= 0 and finite; below ``GREEDY_TEMPERATURE`` (1e-3) it is greedy.
* ``top_p`` in (0, 1]; 0 is rejected (not "greedy"): set temperature 0 for that.
* ``top_k`` >= -1; 0 and -1 both mean "off" (vLLM's convention); 1 is greedy.
* ``min_p`` in [0, 1]; 0 is off. Tokens whose probability (after temperature) is
  below ``min_p`` times the most likely token's are masked.
* ``repetition_penalty`` > 0 and finite; 1 is off. CTRL-style (Keskar et al. 2019,
  as transformers and vLLM apply it): the logit of every token seen in the prompt
  or the output is divided by it when positive, multiplied by it when negative.
* ``presence_penalty`` / ``frequency_penalty`` in [-2, 2]; 0 is off. OpenAI-style,
  output tokens only: ``logit -= presence * (count > 0) + frequency * count``.
* ``min_tokens`` in [0, max_tokens]: until that many tokens are generated, EOS
  (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled or stop, and
  no stop string may end in their text (the gateway's ``Choice``).
* ``n`` in [1, MAX_N]: choices generated from one prompt; with a seed, choice
  ``i`` uses ``seed + i`` (vLLM's rule).
* ``seed`` an int64 (and ``seed + n - 1`` too); stop strings valid Unicode.
* ``logprobs`` / ``prompt_logprobs`` in [0, MAX_LOGPROBS] or None (off): the top-k
  entries per generated / prompt position, besides the chosen token's own
  logprob, from the model's raw distribution (``log_softmax`` of the logits
  before masks, logit bias, penalties and temperature; vLLM v1's default "raw logprobs").
* ``logit_bias``: (token id, bias) pairs, at most ``MAX_LOGIT_BIAS_ENTRIES`` (300,
  OpenAI's cap), each id in [0, vocab_size) and named once, each bias finite and in
  [-100, 100] (OpenAI's range; vLLM clamps to it, we refuse past it). The bias is
  added to that token's logit before penalties and temperature; empty is none.
* ``structured_output``: a ``meshserve.structured_output.StructuredOutput`` that xgrammar
  parses (kind, size and spec checked there); None is none. Its token mask applies
  first, before the raw logprobs are taken (vLLM v1 masks the logits it samples from).

The ``min_tokens`` mask, the logit bias and the penalties run before temperature,
in that order (vLLM v1's), and also change greedy rows (greedy is the argmax of the
processed logits).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field, replace

from meshserve import structured_output as structured
from meshserve.errors import InvalidArgument
from meshserve.structured_output import StructuredOutput

DEFAULT_MAX_TOKENS = 16
GREEDY_TEMPERATURE = 1e-3
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # the wire's seed (int64)
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1  # the wire's top_k and priority (int32)
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |bias| of a logit_bias entry (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 300  # entries of logit_bias (OpenAI's cap)
LOGPROB_FLOOR = -9999.0
"""A -inf logprob (a token a structured output forbids) in JSON, which has no infinity:
vLLM's value, written by the HTTP API and ``meshserve generate --json``."""


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
        ignore_eos: keep generating past the model's EOS tokens (never past
            ``stop_token_ids``).
        min_p: minimum probability relative to the most likely token; 0 is off.
        repetition_penalty: CTRL-style penalty on prompt and output tokens; 1 is off.
        presence_penalty: subtracted once from each token present in the output.
        frequency_penalty: subtracted per occurrence of a token in the output.
        min_tokens: EOS and stop token ids are masked before this many outputs.
        n: number of choices (the executor runs one engine request per choice).
        logprobs: top-k logprobs per generated token (0: the token's own only);
            None: none.
        prompt_logprobs: the same for every prompt position after the first;
            None: none. A request with it must not use the prefix cache (the
            positions it skips would have no logits).
        logit_bias: (token id, bias) pairs added to those tokens' logits, sorted by
            id once validated (OpenAI's ``logit_bias`` map); () is none.
        structured_output: the constraint on the generated text, or None (see
            ``meshserve.structured_output``).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice ``index`` of ``n``: seed + index when seeded
        (vLLM's rule), prompt logprobs on choice 0 only (they are the same for all)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def _wire(value: float) -> tuple[float, str]:
    """``value`` as the wire's float32 carries it (1e39 becomes inf, 1e-50 zero), and
    the words a message adds when that differs from ``value``: the gateway checks what
    the executor will receive, so a value valid only in float64 is refused before
    admission with its own field's name."""
    carried = ctypes.c_float(value).value
    return carried, "" if carried == value or math.isnan(value) else f" ({carried} as a float32)"


def validate(params: SamplingParams, *, max_model_len: int, vocab_size: int) -> SamplingParams:
    """Checks every field against the model's limits; returns the normalised params
    (``top_k`` -1 becomes 0, ``logit_bias`` sorted by token id).

    Raises:
        InvalidArgument: a field is out of range; the message names it.
    """
    _check(
        1 <= params.max_tokens <= max_model_len,
        f"max_tokens must be in [1, {max_model_len}] (max_model_len), got {params.max_tokens}",
    )
    t, note = _wire(params.temperature)
    _check(math.isfinite(t) and t >= 0.0, f"temperature must be a finite number >= 0, got {params.temperature}{note}")
    p, note = _wire(params.top_p)
    _check(math.isfinite(p) and 0.0 < p <= 1.0, f"top_p must be in (0, 1], got {params.top_p}{note}")
    _check(-1 <= params.top_k <= INT32_MAX, f"top_k must be in [1, {INT32_MAX}], or 0 / -1 for off, got {params.top_k}")
    _check(
        len(params.stop) <= MAX_STOP_STRINGS,
        f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}",
    )
    for s in params.stop:
        _check(0 < len(s) <= MAX_STOP_STRING_CHARS,
               f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters each")
        _check(is_unicode(s), "stop strings must be valid Unicode (no lone surrogates)")
    _check(params.seed is None or INT64_MIN <= params.seed <= INT64_MAX - (params.n - 1),
           f"seed must be in [{INT64_MIN}, {INT64_MAX} - (n - 1)] (choice i uses seed + i), got {params.seed}")
    _check(
        len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
        f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}",
    )
    for tid in params.stop_token_ids:
        _check(0 <= tid < vocab_size, f"stop_token_ids entry {tid} is outside the vocabulary [0, {vocab_size})")
    _validate_extras(params)
    _validate_logit_bias(params.logit_bias, vocab_size)
    if params.structured_output is not None:
        structured.validate(params.structured_output)
    logit_bias = tuple(sorted(params.logit_bias))
    if params.top_k == -1 or logit_bias != params.logit_bias:
        return replace(params, top_k=0 if params.top_k == -1 else params.top_k, logit_bias=logit_bias)
    return params


def is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON can carry one; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _validate_extras(params: SamplingParams) -> None:
    """min_p, penalties, min_tokens, n and logprobs (see the module docstring)."""
    m, note = _wire(params.min_p)
    _check(math.isfinite(m) and 0.0 <= m <= 1.0, f"min_p must be in [0, 1], got {params.min_p}{note}")
    r, note = _wire(params.repetition_penalty)
    _check(math.isfinite(r) and r > 0.0,
           f"repetition_penalty must be a finite number > 0 (1 is off), got {params.repetition_penalty}{note}")
    for name in ("presence_penalty", "frequency_penalty"):
        v, note = _wire(getattr(params, name))
        _check(math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
               f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(params, name)}{note}")
    _check(0 <= params.min_tokens <= params.max_tokens,
           f"min_tokens must be in [0, max_tokens={params.max_tokens}], got {params.min_tokens}")
    _check(1 <= params.n <= MAX_N, f"n must be in [1, {MAX_N}] (MAX_N), got {params.n}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        _check(k is None or 0 <= k <= MAX_LOGPROBS,
               f"{name} must be in [0, {MAX_LOGPROBS}] (MAX_LOGPROBS), got {k}")


def _validate_logit_bias(logit_bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """At most ``MAX_LOGIT_BIAS_ENTRIES`` entries; ids in the vocabulary, each once;
    biases finite and in [-100, 100] as float32 carries them. A message names the
    entry as ``logit_bias[<id>]`` (HTTP's ``param``: ``logit_bias.<id>``, the key as
    OpenAI's clients send it)."""
    _check(len(logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
           f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(logit_bias)}")
    seen: set[int] = set()
    for token_id, bias in logit_bias:
        _check(0 <= token_id < vocab_size,
               f"logit_bias[{token_id}]: token id {token_id} is outside the vocabulary [0, {vocab_size})")
        _check(token_id not in seen, f"logit_bias[{token_id}]: token id {token_id} is given twice")
        seen.add(token_id)
        b, note = _wire(bias)
        _check(math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS,
               f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}{note}")


def from_proto(msg, *, max_model_len: int, vocab_size: int) -> SamplingParams:
    """Builds validated ``SamplingParams`` from a ``meshserve.v1.SamplingParams``.

    Unset optional fields take the defaults above.

    Raises:
        InvalidArgument: see ``validate``.
    """
    return validate(params_from_proto(msg), max_model_len=max_model_len, vocab_size=vocab_size)


def params_from_proto(msg) -> SamplingParams:
    """``SamplingParams`` from a ``meshserve.v1.SamplingParams``, not yet validated (for
    a boundary that validates them with the prompt, as ``LLMEngine.check_request``).

    Unset optional fields take the defaults above.
    """
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        min_tokens=msg.min_tokens,
        n=msg.n if msg.HasField("n") else 1,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        structured_output=structured.from_proto(msg.structured_output) if msg.HasField("structured_output") else None,
    )


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
    msg.min_p = params.min_p
    msg.repetition_penalty = params.repetition_penalty
    msg.presence_penalty = params.presence_penalty
    msg.frequency_penalty = params.frequency_penalty
    msg.min_tokens = params.min_tokens
    msg.n = params.n
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    msg.logit_bias.update(params.logit_bias)
    if params.structured_output is not None:
        structured.to_proto(params.structured_output, msg.structured_output)


def floored_logprob(logprob: float) -> float:
    """``logprob``, or ``LOGPROB_FLOOR`` for -inf (JSON has no infinity)."""
    return LOGPROB_FLOOR if logprob == -math.inf else logprob
