"""Output-length predictor: learns online from finished requests.

Each finished request adds ``x = ln(1 + output_tokens)`` (per choice) to three
running statistics: its tenant and prompt-length bucket, its tenant, and the
global one. A prediction uses the most specific level with at least
``min_samples`` observations:

    tenant + bucket  →  tenant  →  global  →  prior

and answers ``round(exp(mean(x)) - 1)`` (the geometric mean of ``1 + length``,
less 1), clamped to ``[1, max_tokens]``, with the uncertainty ``std(x)`` (the
population standard deviation in log space; 0 for a single sample). The prior
is ``max(1, max_tokens // 2)`` with uncertainty ``PRIOR_LOG_STD``.

Prompt-length bucket: ``floor(log2(num_prompt_tokens + 1))`` (1 → 1, 2–3 → 2,
4–7 → … ). ``max_tokens`` enters as the cap (a request can never produce more).

The predictor keeps its running mean absolute error over every observation that
had a prediction: ``stats()`` reports it in tokens (for metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_LOG_STD = 1.0


@dataclass(frozen=True)
class Prediction:
    """A predicted output length.

    Attributes:
        tokens: predicted output tokens per choice (in [1, max_tokens]).
        log_std: uncertainty, the std of ``ln(1 + tokens)`` at the level used.
        level: ``tenant+bucket``, ``tenant``, ``global`` or ``prior``.
    """

    tokens: int
    log_std: float
    level: str


@dataclass
class _Moments:
    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        self.total_sq += x * x

    def mean(self) -> float:
        return self.total / self.count

    def std(self) -> float:
        return math.sqrt(max(0.0, self.total_sq / self.count - self.mean() ** 2))


def prompt_bucket(num_prompt_tokens: int) -> int:
    """``floor(log2(num_prompt_tokens + 1))``."""
    return max(0, num_prompt_tokens + 1).bit_length() - 1


class OutputLengthPredictor:
    """Predicts output tokens per choice from tenant and prompt length.

    Args:
        min_samples: observations a level needs before it is used (>= 1).
    """

    def __init__(self, min_samples: int = 3):
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = min_samples
        self._moments: dict[tuple, _Moments] = {}
        self._abs_error_sum = 0.0
        self._num_scored = 0
        self._num_observed = 0

    @staticmethod
    def _keys(tenant: str, num_prompt_tokens: int) -> list[tuple[tuple, str]]:
        return [(("tb", tenant, prompt_bucket(num_prompt_tokens)), "tenant+bucket"), (("t", tenant), "tenant"),
                (("g",), "global")]

    def predict(self, tenant: str, num_prompt_tokens: int, max_tokens: int) -> Prediction:
        """Predicted output tokens of one choice (see the module docstring)."""
        cap = max(1, max_tokens)
        for key, level in self._keys(tenant, num_prompt_tokens):
            m = self._moments.get(key)
            if m is not None and m.count >= self.min_samples:
                tokens = min(cap, max(1, round(math.exp(m.mean()) - 1)))
                return Prediction(tokens, m.std(), level)
        return Prediction(max(1, cap // 2), PRIOR_LOG_STD, "prior")

    def observe(self, tenant: str, num_prompt_tokens: int, output_tokens: int, predicted: int | None = None) -> None:
        """Learns one finished choice's ``output_tokens``; ``predicted`` (if any) scores the error."""
        x = math.log1p(max(0, output_tokens))
        for key, _ in self._keys(tenant, num_prompt_tokens):
            self._moments.setdefault(key, _Moments()).add(x)
        self._num_observed += 1
        if predicted is not None:
            self._abs_error_sum += abs(predicted - output_tokens)
            self._num_scored += 1

    def stats(self) -> dict:
        """``num_observed``, ``num_scored`` and ``mean_abs_error_tokens`` (None before any score)."""
        mae = self._abs_error_sum / self._num_scored if self._num_scored else None
        return {"num_observed": self._num_observed, "num_scored": self._num_scored, "mean_abs_error_tokens": mae}
