"""Storage tiers of the kvstore: where a block's bytes live.

A tier is plain keyed byte storage with no policy; ``kvstore.store.KVStore``
owns the byte budgets, the LRU order, leases and checksums on top of it (the
tier ABC is the small interface chosen by name: ``memory`` or ``disk``).

Keys are 32 bytes: the 16-byte namespace (``KVStoreFingerprint.namespace``) and
the 16-byte chain hash.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
from pathlib import Path


class Tier(abc.ABC):
    """Keyed byte storage.

    Attributes:
        name: ``"memory"`` or ``"disk"``.
    """

    name: str

    @abc.abstractmethod
    def write(self, key: bytes, data: bytes) -> None:
        """Stores ``data`` under ``key`` atomically: a reader sees all of it or nothing.

        Raises:
            OSError: the medium failed (disk full…).
        """

    @abc.abstractmethod
    def read(self, key: bytes) -> bytes | None:
        """The bytes under ``key``, or None when absent (or unreadable)."""

    @abc.abstractmethod
    def delete(self, key: bytes) -> None:
        """Forgets ``key`` (no-op when absent)."""


class MemoryTier(Tier):
    """Blocks in this process's memory (bytes objects, shared without copies)."""

    name = "memory"

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}

    def write(self, key: bytes, data: bytes) -> None:
        self._data[key] = data

    def read(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def delete(self, key: bytes) -> None:
        self._data.pop(key, None)


class DiskTier(Tier):
    """Blocks as files under a directory, one file per block (``<key hex>.kv``).

    The directory is a cache, not a database: it is emptied when the tier is
    created, so a restarted kvstore starts cold (its index lives in memory).
    Writes go to a temporary file renamed into place (``os.replace``), so a crash
    never leaves a half-written block under a real name.

    Args:
        directory: created if missing; files in it are removed.
    """

    name = "disk"

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if self.directory.exists():
            for child in self.directory.iterdir():
                if child.suffix in (".kv", ".tmp"):
                    child.unlink()
                elif child.is_dir():
                    shutil.rmtree(child)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.kv"

    def write(self, key: bytes, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # a partial file would hold the space a full disk lacks
            raise

    def read(self, key: bytes) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except OSError:
            return None

    def delete(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)
