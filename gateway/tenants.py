"""Tenants and API-key authentication (pure core, no gRPC).

A tenant is who pays for a request: the scheduler accounts KV blocks against
its quota and uses its default priority. The gateway maps the API key in a
call's metadata to a tenant with a ``TenantRegistry``:

* **file mode** (``TenantRegistry.from_file``): a TOML file lists the tenants and
  their keys; a call without a key, or with an unknown one, is refused with
  ``Unauthenticated``::

      [[tenants]]
      name = "acme"
      api_keys = ["key-1", "key-2"]
      default_priority = 0        # optional, default 0
      kv_quota_blocks = 4096      # optional, default: no quota
      max_priority = 5            # optional: higher priorities are clamped to it
      requests_per_s = 20.0       # optional: admission rate limit (token bucket)
      tokens_per_min = 600000     # optional: prompt + completion tokens per minute
      result_cache_scope = "acme-group"   # optional: tenants naming the same scope share
                                          # result-cache entries (default: none shared)
      callback_allow = ["https://hooks.acme.example/"]  # optional: its tasks' callback URLs
                                          # must match one of these too (and --callback-allow)
      max_unfinished_tasks = 100  # optional: most of its async tasks queued or running at
                                  # once (default: the gateway's --max-unfinished-tasks-per-tenant)

  The scheduler reads the same file (``meshserve scheduler --tenants``):
  it admits only the tenants listed and applies the ceiling and rate limits
  (``scheduler.tenant_limits``); ``max_unfinished_tasks`` is the gateways' alone
  (the task store counts it, ``gateway.task_store``).

* **open mode** (``TenantRegistry.open``): no file; every call is tenant
  ``"default"`` (no quota), whatever key it carries.

The key is read from ``x-api-key: KEY`` or ``authorization: Bearer KEY``.
Keys are kept only as SHA-256 digests, so a lookup compares digests, never the
secret itself.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from gateway.callbacks import CallbackPolicy
from meshserve.errors import Unauthenticated

DEFAULT_TENANT = "default"
_TENANT_FIELDS = {"name", "api_keys", "default_priority", "kv_quota_blocks", "max_priority", "requests_per_s",
                  "tokens_per_min", "result_cache_scope", "callback_allow", "max_unfinished_tasks"}


@dataclass(frozen=True)
class Tenant:
    """One tenant.

    Attributes:
        name: unique tenant name (used in logs, metrics and quota accounting; it
            salts its prefix cache chains, so the tenants file refuses a NUL in it).
        default_priority: priority class of its requests when a request sets
            none (larger is more urgent; see the scheduler's admission queue).
        kv_quota_blocks: most KV blocks its running requests may hold together
            across the mesh (blocks), or None for no quota.
        max_priority: its priority ceiling (higher asks are clamped), or None.
        requests_per_s: admissions per second, or None for no limit.
        tokens_per_min: prompt + completion tokens per minute, or None.
        result_cache_scope: a scope shared in the result cache with the tenants
            naming the same one; None: its entries are its own.
        callback_allow: URL prefixes (``scheme://host[:port][/path]``) its tasks'
            callback URLs must match, besides the gateway's ``--callback-allow``;
            empty: the gateway's list alone.
        max_unfinished_tasks: most of its async tasks that may be unfinished (queued
            or running) at once, across the gateways sharing a task store (tasks);
            None: the gateway's ``--max-unfinished-tasks-per-tenant``.
    """

    name: str
    default_priority: int = 0
    kv_quota_blocks: int | None = None
    max_priority: int | None = None
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    result_cache_scope: str | None = None
    callback_allow: tuple[str, ...] = ()
    max_unfinished_tasks: int | None = None

    @property
    def cache_scope(self) -> str:
        """The scope of its result-cache entries: ``scope:<result_cache_scope>`` or ``tenant:<name>``."""
        return f"scope:{self.result_cache_scope}" if self.result_cache_scope else f"tenant:{self.name}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _as_str(value: str | bytes) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _api_keys(metadata: Sequence[tuple[str, str | bytes]] | None) -> set[str]:
    """The API keys a call's metadata carries (``x-api-key`` and bearer tokens).

    Raises:
        Unauthenticated: an ``authorization`` entry that is not ``Bearer KEY``.
    """
    keys: set[str] = set()
    for name, value in metadata or ():
        name, text = name.lower(), _as_str(value).strip()
        if name == "x-api-key" and text:
            keys.add(text)
        elif name == "authorization":
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("authorization metadata must be 'Bearer <api key>'")
            keys.add(token.strip())
    return keys


class TenantRegistry:
    """Maps API keys to tenants; see the module docstring for the two modes."""

    def __init__(self, tenants: Sequence[Tenant], keys: dict[bytes, Tenant], *, open_mode: bool):
        self._tenants = {t.name: t for t in tenants}
        self._by_digest = keys
        self.open_mode = open_mode

    @classmethod
    def open(cls) -> TenantRegistry:
        """A registry with no keys: every caller is tenant ``"default"``."""
        return cls([Tenant(DEFAULT_TENANT)], {}, open_mode=True)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantRegistry:
        """Reads a tenants TOML file (format in the module docstring).

        Raises:
            FileNotFoundError: no such file.
            OSError: the file cannot be read (a directory, no permission).
            ValueError: not UTF-8, not valid TOML, or a tenant entry is malformed (missing
                or mistyped field, unknown field, duplicate name or key); the message
                names the file, the entry and the problem.
        """
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from exc
        entries = data.get("tenants")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{path}: expected one or more [[tenants]] tables")
        extra = set(data) - {"tenants"}
        if extra:
            raise ValueError(f"{path}: unknown top-level keys {sorted(extra)}")
        tenants: list[Tenant] = []
        keys: dict[bytes, Tenant] = {}
        for i, entry in enumerate(entries):
            tenant, api_keys = _parse_tenant(entry, f"{path}: tenants[{i}]")
            if tenant.name in {t.name for t in tenants}:
                raise ValueError(f"{path}: tenants[{i}]: duplicate tenant name {tenant.name!r}")
            for key in api_keys:
                if _digest(key) in keys:
                    raise ValueError(f"{path}: tenants[{i}] ({tenant.name}): an API key is listed twice")
                keys[_digest(key)] = tenant
            tenants.append(tenant)
        return cls(tenants, keys, open_mode=False)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """All tenants, in file order."""
        return tuple(self._tenants.values())

    def get(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return self._tenants.get(name)

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant of a call, from its gRPC (or HTTP header) metadata.

        ``metadata`` is a sequence of (key, value) pairs (``None`` is empty), as
        ``ServicerContext.invocation_metadata()`` gives it; keys are compared
        case-insensitively; values may be ``str`` or ``bytes``.

        Raises:
            Unauthenticated: (file mode) no key, an unknown key, two different
                keys, or a malformed ``authorization`` entry.
        """
        if self.open_mode:
            return self._tenants[DEFAULT_TENANT]
        keys = _api_keys(metadata)
        if not keys:
            raise Unauthenticated("missing API key: send 'x-api-key: <key>' or 'authorization: Bearer <key>'")
        if len(keys) > 1:
            raise Unauthenticated("conflicting API keys in x-api-key and authorization metadata")
        tenant = self._by_digest.get(_digest(keys.pop()))
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant


def _parse_tenant(entry: Any, where: str) -> tuple[Tenant, list[str]]:
    """Validates one ``[[tenants]]`` table; returns the tenant and its keys."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table")
    unknown = set(entry) - _TENANT_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} (allowed: {sorted(_TENANT_FIELDS)})")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    if "\x00" in name:  # a request's chain salt is the name, a NUL, its cache_salt (meshserve.block_hash)
        raise ValueError(f"{where}: 'name' must not hold a NUL character")
    where = f"{where} ({name})"
    api_keys = entry.get("api_keys")
    if not isinstance(api_keys, list) or not api_keys or not all(isinstance(k, str) and k.strip() for k in api_keys):
        raise ValueError(f"{where}: 'api_keys' must be a non-empty list of non-empty strings")
    if any(k != k.strip() for k in api_keys):
        raise ValueError(f"{where}: an API key has leading or trailing whitespace")
    if not all(k.isascii() and k.isprintable() for k in api_keys):  # what gRPC metadata and HTTP headers carry
        raise ValueError(f"{where}: an API key holds a character other than printable ASCII; no caller could send it")
    priority = entry.get("default_priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"{where}: 'default_priority' must be an integer, got {priority!r}")
    quota = entry.get("kv_quota_blocks")
    if quota is not None and (not isinstance(quota, int) or isinstance(quota, bool) or quota < 1):
        raise ValueError(f"{where}: 'kv_quota_blocks' must be an integer >= 1 (blocks), got {quota!r}")
    ceiling = entry.get("max_priority")
    if ceiling is not None and (not isinstance(ceiling, int) or isinstance(ceiling, bool)):
        raise ValueError(f"{where}: 'max_priority' must be an integer, got {ceiling!r}")
    rates = {}
    for field in ("requests_per_s", "tokens_per_min"):
        rate = entry.get(field)
        if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0):
            raise ValueError(f"{where}: '{field}' must be a number > 0, got {rate!r}")
        rates[field] = float(rate) if rate is not None else None
    scope = entry.get("result_cache_scope")
    if scope is not None and (not isinstance(scope, str) or not scope.strip()):
        raise ValueError(f"{where}: 'result_cache_scope' must be a non-empty string, got {scope!r}")
    max_unfinished = entry.get("max_unfinished_tasks")
    if max_unfinished is not None and (not isinstance(max_unfinished, int) or isinstance(max_unfinished, bool)
                                       or max_unfinished < 1):
        raise ValueError(f"{where}: 'max_unfinished_tasks' must be an integer >= 1 (tasks), got {max_unfinished!r}")
    callback_allow = entry.get("callback_allow", [])
    if not isinstance(callback_allow, list) or not all(isinstance(u, str) for u in callback_allow):
        raise ValueError(f"{where}: 'callback_allow' must be a list of URL prefixes, got {callback_allow!r}")
    try:
        CallbackPolicy(callback_allow)
    except ValueError as exc:
        raise ValueError(f"{where}: 'callback_allow': {str(exc).removeprefix('--callback-allow ')}") from None
    return Tenant(name, priority, quota, ceiling, **rates, result_cache_scope=scope,
                  callback_allow=tuple(callback_allow), max_unfinished_tasks=max_unfinished), api_keys
