"""Instance pools: which executors a request may run on (pure policy, no gRPC).

An executor registers with a pool name (``meshserve executor --pool NAME``,
default ``"default"``). A pools file (``meshserve scheduler --pools FILE``, TOML)
maps priority classes to pools and says where a saturated pool may spill::

    default_pool = "batch"            # pool of priority classes no pool lists

    [pools.interactive]
    priorities = [1, 2]               # priority classes served by this pool
    spill_to = ["batch"]              # tried in order when this pool is saturated

    [pools.batch]
    priorities = [0]
    spill_to = ["interactive"]
    idle_free_fraction = 0.5          # as a spill target: idle at >= 50 % free blocks

**Choice** (``candidate_executors``), for a request of pool P:

1. P's executors that have room for the request (the caller's ``has_room``);
2. if there are none (P is saturated, or has no executor), the executors with
   room of the first pool Q in P's ``spill_to`` that is *idle*: every one of Q's
   executors reports no request waiting in its engine and at least
   ``idle_free_fraction`` of its KV blocks available (``is_idle`` of the caller
   reads the executor, ``idle_free_fraction`` is Q's);
3. otherwise none: the request waits in the admission queue.

Spilling is one hop (Q's own ``spill_to`` is not followed) and never into a
busy pool, so a batch flood cannot take the interactive pool's capacity while
interactive traffic is there, and idle capacity is not wasted. Without a pools
file every executor serving the model is a candidate, whatever its pool.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeVar

DEFAULT_POOL = "default"
_POOL_FIELDS = {"priorities", "spill_to", "idle_free_fraction"}


class PoolMember(Protocol):
    """What the policy reads of an executor."""

    executor_id: str
    pool: str


E = TypeVar("E", bound=PoolMember)


@dataclass(frozen=True)
class PoolSpec:
    """One pool of the pools file.

    Attributes:
        name: pool name, as executors pass it to ``--pool``.
        priorities: priority classes whose requests belong to this pool.
        spill_to: pools tried, in order, when this one has no executor with room.
        idle_free_fraction: as a spill *target*, the pool is idle when each of its
            executors has no request waiting and at least this fraction of its
            KV blocks available (in [0, 1]).
    """

    name: str
    priorities: tuple[int, ...] = ()
    spill_to: tuple[str, ...] = ()
    idle_free_fraction: float = 0.5


@dataclass(frozen=True)
class PoolsConfig:
    """Priority classes → pools, and spill rules.

    Raises:
        ValueError: a priority class in two pools, a spill target that is not a
            pool (or the pool itself), or an ``idle_free_fraction`` outside [0, 1].
    """

    pools: Mapping[str, PoolSpec] = field(default_factory=dict)
    default_pool: str = DEFAULT_POOL

    def __post_init__(self) -> None:
        owner: dict[int, str] = {}
        for spec in self.pools.values():
            if not 0.0 <= spec.idle_free_fraction <= 1.0:
                raise ValueError(f"pool {spec.name!r}: idle_free_fraction must be in [0, 1], "
                                 f"got {spec.idle_free_fraction}")
            for target in spec.spill_to:
                if target not in self.pools or target == spec.name:
                    raise ValueError(f"pool {spec.name!r}: spill_to names {target!r}, which is not another pool")
            for priority in spec.priorities:
                if priority in owner:
                    raise ValueError(f"priority class {priority} is in pools {owner[priority]!r} and {spec.name!r}")
                owner[priority] = spec.name

    def pool_of(self, priority: int) -> str:
        """The pool of a request of priority class ``priority``."""
        for spec in self.pools.values():
            if priority in spec.priorities:
                return spec.name
        return self.default_pool

    def spec(self, name: str) -> PoolSpec:
        """The pool's spec (defaults for a pool the file does not list)."""
        return self.pools.get(name) or PoolSpec(name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PoolsConfig":
        """From the parsed file (see the module docstring).

        Raises:
            ValueError: unknown keys or bad values (``priorities`` not a list of
                integers, ``spill_to`` not a list of pool names, ``idle_free_fraction``
                not a number in [0, 1]).
        """
        unknown = set(data) - {"default_pool", "pools"}
        if unknown:
            raise ValueError(f"pools file: unknown keys {sorted(unknown)} (default_pool, pools)")
        pools = {}
        for name, body in (data.get("pools") or {}).items():
            if not isinstance(body, Mapping) or set(body) - _POOL_FIELDS:
                raise ValueError(f"pool {name!r}: expected a table with keys from {sorted(_POOL_FIELDS)}")
            priorities = body.get("priorities", [])
            if not isinstance(priorities, (list, tuple)) or not all(
                    isinstance(p, int) and not isinstance(p, bool) for p in priorities):
                raise ValueError(f"pool {name!r}: priorities must be a list of integers, "
                                 f"e.g. [1, 2], got {priorities!r}")
            spill = body.get("spill_to", [])
            if not isinstance(spill, (list, tuple)) or not all(isinstance(s, str) for s in spill):
                raise ValueError(f"pool {name!r}: spill_to must be a list of pool names, "
                                 f"e.g. [\"batch\"], got {spill!r}")
            fraction = body.get("idle_free_fraction", 0.5)
            if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
                raise ValueError(f"pool {name!r}: idle_free_fraction must be a number in [0, 1], got {fraction!r}")
            pools[name] = PoolSpec(name, tuple(priorities), tuple(spill), float(fraction))
        return cls(pools, str(data.get("default_pool", DEFAULT_POOL)))

    @classmethod
    def from_file(cls, path: str | Path) -> "PoolsConfig":
        """Reads a TOML pools file.

        Raises:
            FileNotFoundError: no such file.
            OSError: the file cannot be read (a directory, no permission).
            ValueError: not UTF-8, not TOML, or bad contents; the message names the file.
        """
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"pools file {path}: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"pools file {path}: {exc}") from None


@dataclass(frozen=True)
class PoolChoice:
    """The executors a request may go to now.

    Attributes:
        pool: the pool they belong to (the request's own, or the spill target);
            None when no pools file is configured.
        executors: candidates with room, in registry order; empty: wait.
        spilled: True when they come from a spill target.
    """

    pool: str | None
    executors: tuple
    spilled: bool = False


def candidate_executors(
    config: PoolsConfig | None,
    priority: int,
    executors: Sequence[E],
    has_room: Callable[[E], bool],
    is_idle: Callable[[E, float], bool],
) -> PoolChoice:
    """Executors a request of ``priority`` may be assigned to now (see the module docstring).

    Args:
        config: the pools file, or None (every executor is a candidate).
        priority: the request's priority class.
        executors: executors serving the request's model.
        has_room: whether an executor can take the request now (KV blocks).
        is_idle: ``is_idle(executor, idle_free_fraction)``: no request waiting and
            at least that fraction of its blocks available.

    Returns:
        The own pool's executors with room; else those of the first idle spill
        target; else an empty choice naming the own pool.
    """
    if config is None:
        return PoolChoice(None, tuple(e for e in executors if has_room(e)))
    own = config.pool_of(priority)
    mine = tuple(e for e in executors if e.pool == own and has_room(e))
    if mine:
        return PoolChoice(own, mine)
    for target in config.spec(own).spill_to:
        members = [e for e in executors if e.pool == target]
        fraction = config.spec(target).idle_free_fraction
        if members and all(is_idle(e, fraction) for e in members):
            roomy = tuple(e for e in members if has_room(e))
            if roomy:
                return PoolChoice(target, roomy, spilled=True)
    return PoolChoice(own, ())


def reachable_pools(config: PoolsConfig | None, priority: int) -> set[str] | None:
    """Pools a request of ``priority`` could ever run in (own + spill targets); None: any."""
    if config is None:
        return None
    own = config.pool_of(priority)
    return {own, *config.spec(own).spill_to}
