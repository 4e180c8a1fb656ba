"""Per-tenant admission limits: who may be admitted, a priority ceiling, rate limits.

The scheduler is where every gateway's requests meet, so its limits hold for a
tenant across all gateways. What the tenants file sets (``meshserve scheduler
--tenants``; fields in ``gateway.tenants``) arrives here as
``TenantLimits`` per tenant name:

* **Known tenants.** With limits configured, an ``Admit`` for a tenant not
  listed is refused (PERMISSION_DENIED): a forged tenant name gets nothing.
* **Priority ceiling** (``max_priority``): a request asking for more is
  *clamped* to the ceiling, not refused: the request is legitimate, only its
  urgency is not the tenant's to choose; the clamped priority is what the
  queue orders by, what displacement compares, and what the signed lease tells
  the executor.
* **Rate limits** (token buckets, the classic meter of RFC 2697 without its
  colours;
  ``requests_per_s`` and ``tokens_per_min``): a request takes one request token
  and its prompt tokens at admission; its completion tokens are taken when its
  lease is released (the bucket may go into debt). A request that finds a
  bucket short is refused with RESOURCE_EXHAUSTED and the time until the bucket
  holds enough as its retry delay. Buckets start full; a bucket's capacity is
  one second of requests (at least 1) and one minute of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.errors import ResourceExhausted


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's admission limits (None: unlimited).

    Attributes:
        max_priority: highest priority class its requests get (clamped).
        requests_per_s: sustained admissions per second (requests/s).
        tokens_per_min: sustained prompt + completion tokens per minute (tokens/min).
    """

    max_priority: int | None = None
    requests_per_s: float | None = None
    tokens_per_min: float | None = None

    def clamp_priority(self, priority: int) -> int:
        """``priority`` under the ceiling."""
        return priority if self.max_priority is None else min(priority, self.max_priority)


class TokenBucket:
    """A bucket of ``capacity`` refilled at ``rate`` per second; may go into debt.

    Args:
        rate: refill per second (> 0).
        capacity: most it holds (> 0); it starts full.
        now: the clock's time at creation (seconds).
    """

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        # a clock that steps back refills nothing (it must not drain the bucket)
        self.level = min(self.capacity, self.level + max(0.0, now - self._at) * self.rate)
        self._at = max(self._at, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0: now). ``amount`` above the
        capacity is treated as the capacity (a full bucket admits it)."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Takes ``amount`` (the level may go negative: a debt paid by refill)."""
        self._refill(now)
        self.level -= amount


class RateLimiter:
    """The request and token buckets of every rate-limited tenant.

    Args:
        limits: tenant name → its limits (tenants without rates are unlimited).
    """

    def __init__(self, limits: dict[str, TenantLimits]):
        self._limits = limits
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _buckets(self, tenant: str, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        lim = self._limits.get(tenant)
        if lim is None:
            return None, None
        if lim.requests_per_s is not None and tenant not in self._requests:
            self._requests[tenant] = TokenBucket(lim.requests_per_s, max(1.0, lim.requests_per_s), now)
        if lim.tokens_per_min is not None and tenant not in self._tokens:
            self._tokens[tenant] = TokenBucket(lim.tokens_per_min / 60.0, lim.tokens_per_min, now)
        return self._requests.get(tenant), self._tokens.get(tenant)

    def check(self, tenant: str, prompt_tokens: int, now: float) -> None:
        """Raises if the tenant may not be admitted now (takes nothing).

        Raises:
            ResourceExhausted: a bucket is short; ``retry_after_s`` is when it will not be.
        """
        requests, tokens = self._buckets(tenant, now)
        waits = []
        if requests is not None and requests.wait_s(1, now) > 0:
            waits.append((requests.wait_s(1, now), f"{requests.rate:g} requests/s"))
        if tokens is not None and tokens.wait_s(prompt_tokens, now) > 0:
            waits.append((tokens.wait_s(prompt_tokens, now), f"{tokens.rate * 60:g} tokens/min"))
        if waits:
            wait, what = max(waits)
            raise ResourceExhausted(f"tenant {tenant!r} is over its rate limit of {what}; retry in {wait:.3f} s",
                                    wait)

    def admit(self, tenant: str, prompt_tokens: int, now: float) -> None:
        """Takes one request and ``prompt_tokens`` (after ``check`` passed)."""
        requests, tokens = self._buckets(tenant, now)
        if requests is not None:
            requests.take(1, now)
        if tokens is not None:
            tokens.take(prompt_tokens, now)

    def completed(self, tenant: str, completion_tokens: int, now: float) -> None:
        """Takes the tokens a released request generated, finished or not
        (tokens/min bucket only)."""
        _, tokens = self._buckets(tenant, now)
        if tokens is not None:
            tokens.take(completion_tokens, now)
