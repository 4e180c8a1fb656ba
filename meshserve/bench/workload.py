"""The benchmark's workloads: seeded prompt and output lengths and token ids.

Four kinds (``WorkloadSpec.kind``): ``synthetic`` (below), ``shared-prefix``
(``meshserve.bench.shared_prefix``: most prompts start with one system prompt),
``multi-turn`` (``meshserve.bench.multi_turn``: conversations whose every turn
repeats the previous one) and ``jsonl`` (``meshserve.bench.jsonl_workload``: the
requests of a file, each with its own sampling); ``meshserve.bench.workload_kinds``
picks one by name (``load_workloads``).

Lengths are log-normal, as request lengths of served chat traffic are (long right
tail; see the ShareGPT length histograms used by vLLM's ``benchmark_serving``):
``length = round(exp(N(ln median, sigma)))`` clipped to a range, so the median of
the distribution is ``median`` whatever ``sigma`` is. Prompt token ids are drawn
uniformly from the ordinary vocabulary (no special/control ids), which makes
prompts share no prefix, so no target gets prefix-cache hits. Every request sets
``ignore_eos`` and temperature 0: each produces exactly ``output_len`` tokens.

The same ``(seed, vocabulary)`` gives the identical workload for every target;
``numpy.random.default_rng(seed)`` draws, in this order, the prompt lengths, the
output lengths, then all prompt token ids at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

# Warm-up requests come from their own stream so they never share a prompt (and so
# a prefix-cache entry) with the measured ones.
WARMUP_STREAM = 1
# A warm-up request only needs to run every code path once; long outputs waste time.
WARMUP_MAX_OUTPUT_LEN = 16
WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "jsonl")


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of a workload.

    Attributes:
        num_requests: number of requests.
        seed: seed of ``numpy.random.default_rng``.
        prompt_len_median / output_len_median: medians in tokens.
        sigma: standard deviation of the lengths' natural logarithm.
        prompt_len_range / output_len_range: inclusive clip bounds in tokens.
        kind: "synthetic" or "shared-prefix"; for shared-prefix the prompt length
            distribution is that of the part after the first ``shared_prefix_len``
            tokens (the user part).
        shared_prefix_len: shared-prefix: tokens of the shared system prompt.
        shared_fraction: shared-prefix: fraction of the requests that start with it
            (``round(shared_fraction * num_requests)`` requests).
        num_turns: multi-turn: turns per conversation.
        workload_file: jsonl: the file of requests; ``num_requests`` then takes its
            first lines (the file must hold at least that many).

    Raises:
        ValueError: ``num_requests`` < 1, a median outside its clip range, an unknown
            kind, ``shared_prefix_len`` < 1, ``shared_fraction`` outside [0, 1],
            ``num_turns`` < 1, or ``workload_file`` missing for jsonl / given for another kind.
    """

    num_requests: int
    seed: int = 0
    prompt_len_median: int = 150
    output_len_median: int = 128
    sigma: float = 0.5
    prompt_len_range: tuple[int, int] = (16, 1024)
    output_len_range: tuple[int, int] = (8, 512)
    kind: str = "synthetic"
    shared_prefix_len: int = 400
    shared_fraction: float = 0.7
    num_turns: int = 3
    workload_file: str | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {self.num_turns}")
        if (self.kind == "jsonl") != (self.workload_file is not None):
            raise ValueError("the jsonl workload needs --workload-file, and only it takes one")
        if self.shared_prefix_len < 1 or not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError(f"shared_prefix_len must be >= 1 and shared_fraction in [0, 1], got "
                             f"{self.shared_prefix_len} and {self.shared_fraction}")
        for name, median, (lo, hi) in (("prompt", self.prompt_len_median, self.prompt_len_range),
                                       ("output", self.output_len_median, self.output_len_range)):
            if not 1 <= lo <= median <= hi:
                raise ValueError(f"{name} length median {median} must lie in its clip range [{lo}, {hi}] (lo >= 1)")


@dataclass(frozen=True)
class Sampling:
    """A request's sampling fields (``meshserve.sampling.SamplingParams`` names and defaults,
    except the temperature: the benchmark is greedy unless a workload file says otherwise)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Temperature 0: the only sampling the transformers targets run."""
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload.

    Attributes:
        request_id: unique id ("bench-3", "warmup-0").
        prompt_token_ids: prompt ids, all ordinary vocabulary ids.
        output_len: tokens to generate (``max_tokens``); exactly so many with ``ignore_eos``.
        sampling: its sampling fields (greedy by default).
        ignore_eos: True (every built-in workload): generate exactly ``output_len``
            tokens; False (a workload file may say so): stop at EOS, 1..``output_len`` tokens.
        parent_id: the request that must finish before this one is sent (multi-turn:
            the previous turn of the conversation), or None.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    sampling: Sampling = field(default=GREEDY)
    ignore_eos: bool = True
    parent_id: str | None = None


@dataclass(frozen=True)
class Workload:
    """The requests of one benchmark run and the spec they were drawn from."""

    spec: WorkloadSpec
    requests: tuple[BenchRequest, ...]

    @property
    def prompt_lens(self) -> list[int]:
        """Prompt length of each request (tokens)."""
        return [len(r.prompt_token_ids) for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        """Output length of each request (tokens)."""
        return [r.output_len for r in self.requests]


def _lengths(rng: np.random.Generator, n: int, median: int, sigma: float, bounds: tuple[int, int]) -> np.ndarray:
    lo, hi = bounds
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), lo, hi).astype(np.int64)


def make_workload(
    spec: WorkloadSpec, vocab_size: int, special_token_ids: frozenset[int] | set[int], *, stream: int | None = None,
    prefix: str = "bench",
) -> Workload:
    """Draws the synthetic workload of ``spec`` over the ordinary ids of ``[0, vocab_size)``
    (whatever ``spec.kind``: warm-up requests are always synthetic).

    Args:
        spec: sizes, seed and length distributions.
        vocab_size: ids are drawn from ``[0, vocab_size)`` minus ``special_token_ids``.
        special_token_ids: control ids never to use in prompts.
        stream: None for the measured workload (``default_rng(seed)``); an int
            selects an independent stream (``default_rng([seed, stream])``).
        prefix: request id prefix.

    Raises:
        ValueError: no ordinary id left.
    """
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(special_token_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("the vocabulary has no ordinary (non-special) token id")
    rng = np.random.default_rng(spec.seed if stream is None else [spec.seed, stream])
    prompt_lens = _lengths(rng, spec.num_requests, spec.prompt_len_median, spec.sigma, spec.prompt_len_range)
    output_lens = _lengths(rng, spec.num_requests, spec.output_len_median, spec.sigma, spec.output_len_range)
    ids = allowed[rng.integers(0, allowed.size, size=int(prompt_lens.sum()))]
    chunks = np.split(ids, np.cumsum(prompt_lens)[:-1])
    requests = tuple(
        BenchRequest(f"{prefix}-{i}", tuple(int(t) for t in chunk), int(n))
        for i, (chunk, n) in enumerate(zip(chunks, output_lens))
    )
    return Workload(spec, requests)


def make_warmup(spec: WorkloadSpec, num_requests: int, vocab_size: int, special_token_ids) -> Workload | None:
    """``num_requests`` warm-up requests (own stream, outputs of at most 16 tokens); None for 0."""
    if num_requests < 1:
        return None
    wl = make_workload(replace(spec, num_requests=num_requests), vocab_size, special_token_ids,
                       stream=WARMUP_STREAM, prefix="warmup")
    capped = tuple(BenchRequest(r.request_id, r.prompt_token_ids, min(r.output_len, WARMUP_MAX_OUTPUT_LEN))
                   for r in wl.requests)
    return Workload(wl.spec, capped)


def special_token_ids(tokenizer) -> frozenset[int]:
    """Every special id of a ``transformers`` tokenizer: its named specials and its
    added tokens marked special (SmolLM2: ids 0..16)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return frozenset(ids)


def model_vocabulary(model_path: str | Path) -> tuple[int, frozenset[int]]:
    """``(vocab_size, special ids)`` of a model folder.

    ``vocab_size`` is the smaller of the tokenizer's size and the model's
    embedding rows, so every drawn id is both a real token and a valid input.
    """
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = AutoConfig.from_pretrained(model_path)
    return min(len(tokenizer), config.vocab_size), special_token_ids(tokenizer)
