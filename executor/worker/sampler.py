"""Sampler: structured-output masks, min_tokens, logit bias, penalties, greedy,
temperature, min-p, top-k and top-p over a batch of float32 logits, plus the sampled
tokens' logprobs.

Per step, in this order (vLLM v1's: the grammar bitmask applied to the logits before
the sampler, then its ``MinTokensLogitsProcessor`` and ``LogitBiasLogitsProcessor``,
then ``apply_penalties``, then ``sample``)::

    raw = nan_to_num(logits)
    raw[grammar rows, tokens the grammar forbids] = -inf
                                                    # logprobs come from here ("raw logprobs")
    x = raw.clone()
    x[min_tokens rows, EOS + stop ids] = -inf       # before min_tokens outputs; a grammar row
                                                    # left with no token keeps its grammar's
    x[bias rows, bias ids] += bias                  # logit_bias (-inf stays -inf)
    x = penalties(x)                                # repetition (prompt + output), presence, frequency (output)
    greedy rows: argmax(x)                          # masks, bias and penalties do change greedy
    other rows:  x / temperature → min_p → top-k → top-p → exponential race

Rows are sampled with the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``),
which draws from ``p`` exactly and needs one random number per vocabulary entry
(as vLLM's sampler does). Unseeded rows draw their noise in one batched call
from the engine's generator; a seeded row draws from its own generator, which
only its own samples advance, so a seeded request gives the same tokens whatever
else is in the batch (every processor above is row-wise, so batch-invariant too).
Greedy rows (``SamplingParams.greedy``) are the exact ``argmax`` of the processed
logits, first index on ties.

Penalties are vectorised: one ``(P, vocab_size)`` count tensor built with a single
``scatter_add_`` over the ``P`` rows that have a penalty (other rows cost nothing).
The ``min_tokens`` mask and the logit bias are one indexed write each over the
``(row, token id)`` pairs of every row that has them (no loop over rows or the
vocabulary on the device).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from executor.engine.outputs import TokenLogprob
from executor.worker.grammar_mask import GrammarMask
from executor.worker.logprobs import token_logprobs
from meshserve.sampling import SamplingParams


@dataclass
class Penalties:
    """Penalty inputs of the ``P`` rows that have one.

    Attributes:
        rows: ``(P,)`` int64, the rows of the batch they apply to.
        repetition: ``(P,)`` float32, 1.0 where off.
        presence / frequency: ``(P,)`` float32, 0.0 where off.
        output_counts: ``(P, vocab_size)`` float32, occurrences of each token in the
            row's output so far.
        prompt_mask: ``(P, vocab_size)`` bool, tokens of the row's prompt; None when
            no row has a repetition penalty.
    """

    rows: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    output_counts: torch.Tensor
    prompt_mask: torch.Tensor | None

    @classmethod
    def build(cls, params: list[SamplingParams], token_ids: list[Sequence[int]], num_prompt_tokens: list[int],
              vocab_size: int, device: torch.device | str = "cpu") -> "Penalties | None":
        """From each row's params and history (prompt + outputs); None when no row
        has a penalty."""
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return None
        outputs = [token_ids[i][num_prompt_tokens[i]:] for i in rows]
        counts = _scatter_counts(outputs, vocab_size, device)
        prompt_mask = None
        if any(params[i].repetition_penalty != 1.0 for i in rows):
            prompts = [token_ids[i][:num_prompt_tokens[i]] if params[i].repetition_penalty != 1.0 else ()
                       for i in rows]
            prompt_mask = _scatter_counts(prompts, vocab_size, device) > 0

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in rows], dtype=torch.float32, device=device)

        return cls(torch.tensor(rows, dtype=torch.int64, device=device), column("repetition_penalty"),
                   column("presence_penalty"), column("frequency_penalty"), counts, prompt_mask)

    def apply(self, logits: torch.Tensor) -> None:
        """Applies the penalties to ``logits`` ``(num_reqs, vocab_size)`` in place."""
        x = logits[self.rows]  # a copy: (P, vocab_size)
        present = self.output_counts > 0
        if self.prompt_mask is not None:  # CTRL: divide positive logits, multiply negative ones
            r = self.repetition.unsqueeze(1)
            x = torch.where(self.prompt_mask | present, torch.where(x > 0, x / r, x * r), x)
        x.addcmul_(self.output_counts, self.frequency.unsqueeze(1), value=-1.0)
        x.addcmul_(present.to(x.dtype), self.presence.unsqueeze(1), value=-1.0)
        logits[self.rows] = x


def _scatter_counts(rows: list[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """``(len(rows), vocab_size)`` float32 counts of each row's token ids (one scatter_add_)."""
    counts = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
    if int(lengths.sum()):
        ids = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64, device=device)
        row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
        counts.scatter_add_(0, row_of * vocab_size + ids, torch.ones_like(ids, dtype=torch.float32))
    return counts.view(len(rows), vocab_size)


def banned_tokens(params: SamplingParams, num_output_tokens: int, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids masked for a row by ``min_tokens``: stop_token_ids, plus the model's
    EOS ids unless ``ignore_eos``, while fewer than ``min_tokens`` outputs exist."""
    if num_output_tokens >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else sorted(eos_token_ids)
    return sorted(set(params.stop_token_ids).union(eos))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (row ``i`` = ``i``-th logits row).

    Attributes:
        temperature: ``(num_reqs,)`` float32; 1.0 on greedy rows.
        top_k: ``(num_reqs,)`` int64 in [1, vocab_size]; vocab_size when off.
        top_p: ``(num_reqs,)`` float32 in (0, 1].
        min_p: ``(num_reqs,)`` float32 in [0, 1].
        greedy: ``(num_reqs,)`` bool, rows sampled by argmax.
        generators: per row, the request's own generator, or None (engine's).
        penalties: see ``Penalties``; None when no row has one.
        banned: ``(rows, token_ids)`` int64 pairs masked to -inf (min_tokens), or None.
        logit_bias: ``(rows, token_ids, biases)``: int64, int64 and float32 ``(B,)``
            over the ``B`` entries of every row's ``logit_bias`` (each pair once), or None.
        logprobs: per row, the number of top logprobs to return, or None for none.
        grammar: the structured-output rows' token masks (``executor.worker.grammar_mask``),
            or None when no row has one.
        all_greedy / use_top_k / use_top_p / use_min_p: batch-level shortcuts.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    logprobs: list[int | None] | None = None
    grammar: GrammarMask | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device | str = "cpu", *, token_ids: list[Sequence[int]] | None = None,
              num_prompt_tokens: list[int] | None = None,
              eos_token_ids: frozenset[int] = frozenset(),
              grammar_bitmasks: Sequence[bytes | None] | None = None) -> "SamplingBatch":
        """From each row's (validated) params and generator.

        Args:
            token_ids: per row, the request's prompt + output tokens so far (for
                penalties and ``min_tokens``); None: no history.
            num_prompt_tokens: per row, the prompt's length within ``token_ids``.
            eos_token_ids: the model's EOS ids (masked by ``min_tokens``).
            grammar_bitmasks: per row, ``ScheduledRequest.grammar_bitmask`` (None: no
                constraint); None: no row has one.
        """
        token_ids = token_ids if token_ids is not None else [()] * len(params)
        num_prompt_tokens = num_prompt_tokens if num_prompt_tokens is not None else [len(t) for t in token_ids]
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_k=column(top_k, torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            greedy=column(greedy, torch.bool),
            generators=generators,
            all_greedy=all(greedy),
            use_top_k=any(k < vocab_size and not g for k, g in zip(top_k, greedy)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            use_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
            penalties=Penalties.build(params, token_ids, num_prompt_tokens, vocab_size, device),
            banned=_banned(params, token_ids, num_prompt_tokens, eos_token_ids, device),
            logit_bias=_logit_bias(params, device),
            logprobs=[p.logprobs for p in params] if any(p.logprobs is not None for p in params) else None,
            grammar=GrammarMask.build(grammar_bitmasks, device) if grammar_bitmasks else None,
        )


def _banned(params, token_ids, num_prompt_tokens, eos_token_ids, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, cols = [], []
    for i, p in enumerate(params):
        if p.min_tokens:
            ids = banned_tokens(p, len(token_ids[i]) - num_prompt_tokens[i], eos_token_ids)
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(cols, dtype=torch.int64, device=device))


def _logit_bias(params: list[SamplingParams],
                device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every row's ``logit_bias`` entries as three flat tensors (see ``SamplingBatch``)."""
    entries = [(i, token_id, bias) for i, p in enumerate(params) for token_id, bias in p.logit_bias]
    if not entries:
        return None
    rows, cols, biases = zip(*entries)
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(cols, dtype=torch.int64, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


@dataclass
class SamplerOutput:
    """Attributes:
        token_ids: ``(num_reqs,)`` int64 sampled tokens.
        logprobs: per row, the sampled token's logprobs (None for rows that did
            not ask); None when no row asked.
    """

    token_ids: torch.Tensor
    logprobs: list[TokenLogprob | None] | None = None


class Sampler:
    """Samples one token per row.

    Args:
        seed: seed of the generator shared by unseeded rows.
        device: device of that generator (the logits' device).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits`` ``(num_reqs, vocab_size)`` → tokens ``(num_reqs,)`` int64 (and logprobs).

        Logits are cast to float32 and NaN/inf are replaced by finite values first,
        so the result is always a valid token id (never from a NaN).
        """
        finfo = torch.finfo(torch.float32)
        raw = logits.float()
        if raw is logits:  # float32 already: the caller's tensor stays as it is
            raw = torch.nan_to_num(raw, nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
        else:  # the float32 copy is ours: no second (num_reqs, vocab_size) tensor and its page faults
            raw.nan_to_num_(nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
        if batch.grammar is not None:  # raw is our own copy here (nan_to_num or float())
            batch.grammar.apply(raw)
        logits = raw
        if batch.penalties is not None or batch.banned is not None or batch.logit_bias is not None:
            logits = raw.clone()  # raw stays as it is: the logprobs' source
            if batch.banned is not None:
                logits[batch.banned] = float("-inf")
                if batch.grammar is not None:  # min_tokens yields where the grammar allows only an end
                    rows = batch.grammar.rows
                    dead = rows[torch.isneginf(logits[rows]).all(dim=-1)]
                    logits[dead] = raw[dead]
            if batch.logit_bias is not None:  # each (row, id) once: a plain indexed add, the same on every device
                rows, ids, biases = batch.logit_bias
                logits.index_put_((rows, ids), biases, accumulate=True)
            if batch.penalties is not None:
                batch.penalties.apply(logits)
        tokens = argmax_rows(logits)
        if not batch.all_greedy:
            tokens = torch.where(batch.greedy, tokens, self._sample(logits, batch))
        return SamplerOutput(tokens, self._logprobs(raw, tokens, batch.logprobs))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.use_min_p:
            logits = _apply_min_p(logits, batch.min_p)
        if batch.use_top_k or batch.use_top_p:
            logits = _apply_top_k_top_p(logits, batch.top_k if batch.use_top_k else None,
                                        batch.top_p if batch.use_top_p else None)
        probs = torch.softmax(logits, dim=-1)
        return argmax_rows(probs / self._exponential_noise(probs, batch.generators))

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, ks: list[int | None] | None) -> list | None:
        if ks is None:
            return None
        rows = [i for i, k in enumerate(ks) if k is not None]
        index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
        entries = iter(token_logprobs(raw[index], tokens[index], [ks[i] for i in rows]))
        return [next(entries) if k is not None else None for k in ks]

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            q.exponential_(generator=self.generator)
        elif unseeded:
            rows = torch.tensor(unseeded, device=probs.device)
            q[rows] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        return q.clamp_min_(torch.finfo(torch.float32).tiny)


ARGMAX_CHUNK = 128
"""Values in each chunk ``argmax_rows`` cuts a row into (measured on one Zen 4 core, 32 rows
of 49,152: 16 → 3.1 ms, 32 → 0.55, 64 → 0.31, 128 → 0.25, 256 → 0.23)."""


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's ``argmax``, the first index on ties, as ``x.argmax(dim=-1)``: ``x``
    ``(num_reqs, vocab_size)`` float32 with no NaN → ``(num_reqs,)`` int64.

    On CPU, torch's ``argmax`` walks a row one value at a time (2.9 ms for 32 rows of
    49,152 on one Zen 4 core) while its ``amax`` is vectorised (0.12 ms). So the row is cut
    into chunks of ``ARGMAX_CHUNK``: the chunks' maxima (``amax``), the first chunk whose
    maximum is the row's (``max`` over 1/128 of the values), the first index of that
    maximum inside it, and the values past the last whole chunk compared apart (they win
    only when strictly larger, as they come last): 0.25 ms, the same indices. Elsewhere (a
    GPU, rows under two chunks) ``argmax`` itself."""
    rows, n = x.shape
    if x.device.type != "cpu" or n < 2 * ARGMAX_CHUNK or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    body = n - n % ARGMAX_CHUNK
    chunks = x[:, :body].view(rows, body // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best, best_chunk = chunks.amax(dim=-1).max(dim=-1)  # max(dim): the first index on ties too
    index = best_chunk * ARGMAX_CHUNK + chunks[torch.arange(rows, device=x.device), best_chunk].argmax(dim=-1)
    if body < n:
        tail_max, tail_index = x[:, body:].max(dim=-1)
        index = torch.where(tail_max > best, tail_index + body, index)
    return index


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens whose probability is below ``min_p`` times the row's
    largest; the most likely token always stays (vLLM's min-p, after temperature).

    Shapes: ``logits`` ``(num_reqs, vocab_size)`` float32; ``min_p`` ``(num_reqs,)``
    float32 (0 leaves a row as it is). Returns a new tensor.
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k, then outside its top-p
    nucleus of the renormalised distribution; the most likely token always stays.

    Shapes: ``logits`` ``(num_reqs, vocab_size)`` float32; ``top_k`` ``(num_reqs,)``
    int64; ``top_p`` ``(num_reqs,)`` float32. Returns a new tensor.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits.masked_fill_(rank.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before > top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
