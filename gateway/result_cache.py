"""The gateway's result cache: finished outputs of deterministic requests (pure core).

A request is *deterministic* when its tokens depend only on the model, the
prompt and the parameters: greedy sampling (temperature below 1e-3, or
``top_k`` 1) or an explicit ``seed`` (the engine's per-request generator gives
the same tokens whatever else is in the batch). Only such requests are looked
up or stored.

The key is a SHA-256 over the model's fingerprint (id and revision), the
prompt token ids, *every* field of the validated ``SamplingParams`` (stop
strings, penalties, ``n``, logprob settings…; ``logit_bias`` and ``structured_output``
only when set, so keys without them stay those of gateways that predate them), the *scope*: the tenant
(``tenant:<name>``), unless the tenants file gives tenants a shared
``result_cache_scope`` (``scope:<name>``), and the request's own ``cache_salt``
(vLLM's; in the key only when set, so unsalted keys are those of gateways that
predate it). Two requests share an entry only when the engine would be asked
exactly the same thing for the same scope and salt, so tenant B never reads
tenant A's answer, and a user who salts its requests never gets (nor times)
another's; the hex key reveals neither prompt nor
tenant (it is also the Redis key's suffix, ``gateway.result_store``). Entries are bounded in number (least
recently used goes first) and live ``ttl_s`` seconds after they were stored:
``cachetools.TTLCache``.

The cache stores opaque values (the gateway stores the serialized choices)
and never runs anything itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from dataclasses import fields
from typing import Callable, Generic, Sequence, TypeVar

from cachetools import TTLCache

from meshserve.block_hash import ModelFingerprint
from meshserve.errors import InvalidArgument
from meshserve.sampling import SamplingParams

V = TypeVar("V")


def is_deterministic(params: SamplingParams) -> bool:
    """True when the request's tokens are a function of model, prompt and parameters:
    greedy (``params.greedy``) or seeded."""
    return params.greedy or params.seed is not None


def cache_key(model_id: str, revision: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
              scope: str, cache_salt: str = "") -> str:
    """The hex SHA-256 naming one (model, prompt, parameters, scope, salt) combination.

    Args:
        model_id / revision: the model (``ModelInfo``); two revisions never share.
        prompt_token_ids: the prompt as the model sees it (after the chat template).
        params: validated sampling parameters; every field is part of the key.
        scope: who may share the entry (``Tenant.cache_scope``).
        cache_salt: the request's own salt ("": none, and not in the key's JSON).
    """
    # the same JSON as json.dumps(asdict(params)) (every field is a scalar or a flat tuple),
    # without asdict's recursive copy: keys stay equal to older gateways' (a shared Redis);
    # logit_bias ((id, bias) pairs, sorted by validate) only when set, for the same reason
    sampling = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    if params.logit_bias:
        sampling["logit_bias"] = params.logit_bias
    if params.structured_output is not None:
        sampling["structured_output"] = params.structured_output.key()
    fields = {"model": _fingerprint(model_id, revision), "prompt": list(prompt_token_ids), "sampling": sampling,
              "scope": scope}
    if cache_salt:
        fields["cache_salt"] = cache_salt
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("logit_bias", "structured_output"))


@functools.lru_cache(maxsize=64)
def _fingerprint(model_id: str, revision: str) -> str:
    """The model fingerprint's root hash in hex (a gateway serves one model: computed once)."""
    return f"{ModelFingerprint(model_id, revision).root_hash:x}"


class ResultCache(Generic[V]):
    """A bounded LRU map from ``cache_key`` to finished outputs, with a TTL.

    Args:
        max_entries: the most entries kept (>= 1; the gateway builds no cache for 0).
        ttl_s: seconds an entry lives after ``put`` (> 0).
        clock: monotonic seconds (tests pass a fake one).

    Attributes:
        hits / misses: lookups that found / did not find an entry.

    Raises:
        InvalidArgument: ``max_entries`` < 1 or ``ttl_s`` <= 0.
    """

    def __init__(self, max_entries: int, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if max_entries < 1:
            raise InvalidArgument(f"result cache size must be >= 1 entries, got {max_entries}")
        if not ttl_s > 0:
            raise InvalidArgument(f"result cache TTL must be > 0 seconds, got {ttl_s}")
        self._entries: TTLCache = TTLCache(maxsize=max_entries, ttl=ttl_s, timer=clock)
        self._lock = threading.Lock()  # TTLCache is not thread-safe; the gateway is one event loop, tests may not be
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            self._entries.expire()
            return len(self._entries)

    def get(self, key: str) -> V | None:
        """The entry (now most recently used), or None when absent or expired."""
        with self._lock:
            value = self._entries.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, key: str, value: V) -> None:
        """Stores ``value`` (replacing an older entry); evicts the least recently
        used entry when full."""
        with self._lock:
            self._entries[key] = value
