"""Sampler: greedy, temperature, top-k and top-p over a batch of float32 logits.

Rows are sampled with the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``),
which draws from ``p`` exactly and needs one random number per vocabulary entry
(as vLLM's sampler does). Unseeded rows draw their noise in one batched call
from the engine's generator; a seeded row draws from its own generator, which
only its own samples advance, so a seeded request gives the same tokens whatever
else is in the batch. Greedy rows (``SamplingParams.greedy``) are the exact
``argmax`` of the raw logits, first index on ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.sampling import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (row ``i`` = ``i``-th logits row).

    Attributes:
        temperature: ``(num_reqs,)`` float32; 1.0 on greedy rows.
        top_k: ``(num_reqs,)`` int64 in [1, vocab_size]; vocab_size when off.
        top_p: ``(num_reqs,)`` float32 in (0, 1].
        greedy: ``(num_reqs,)`` bool, rows sampled by argmax.
        generators: per row, the request's own generator, or None (engine's).
        all_greedy / use_top_k / use_top_p: batch-level shortcuts.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device | str = "cpu") -> "SamplingBatch":
        """From each row's (validated) params and generator."""
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=generators,
            all_greedy=all(greedy),
            use_top_k=any(k < vocab_size and not g for k, g in zip(top_k, greedy)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
        )


class Sampler:
    """Samples one token per row.

    Args:
        seed: seed of the generator shared by unseeded rows.
        device: device of that generator (the logits' device).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``logits`` ``(num_reqs, vocab_size)`` → tokens ``(num_reqs,)`` int64.

        Logits are cast to float32 and NaN/inf are replaced by finite values first,
        so the result is always a valid token id (never from a NaN).
        """
        finfo = torch.finfo(torch.float32)
        logits = torch.nan_to_num(logits.float(), nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.use_top_k or batch.use_top_p:
            logits = _apply_top_k_top_p(logits, batch.top_k if batch.use_top_k else None,
                                        batch.top_p if batch.use_top_p else None)
        probs = torch.softmax(logits, dim=-1)
        sampled = (probs / self._exponential_noise(probs, batch.generators)).argmax(dim=-1)
        return torch.where(batch.greedy, greedy_tokens, sampled)

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
