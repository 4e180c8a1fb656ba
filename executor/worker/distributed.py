"""The plumbing of a multi-process executor: torchrun-style environment, core
pinning, the rendezvous store, process-group set-up and the step pipe's frames.

Every rank is a process of one executor: rank 0 is the executor itself (gRPC
service, engine, sampling); ranks 1..W-1 run ``python -m
executor.worker.rank_main`` with the environment ``torchrun`` would give them::

    MASTER_ADDR=127.0.0.1  MASTER_PORT=<free loopback port of rank 0's TCPStore>
    RANK=r  WORLD_SIZE=W  LOCAL_RANK=r  LOCAL_WORLD_SIZE=W
    MESHSERVE_CPU_AFFINITY=<cores of this rank, CPU only>   (meshserve.cpu_affinity)

Collectives run over ``torch.distributed`` (gloo on CPU, NCCL on CUDA). Step
inputs do not: rank 0 writes each step's pickled ``SchedulerOutput`` to every
rank's stdin (length-prefixed frames), as vLLM V1 broadcasts its scheduler
output over a message queue rather than a collective. So an idle executor holds
no collective open (the process group's timeout bounds a step's waits only: a
hung rank fails the step), and a rank whose stdin closes knows rank 0 is gone.
"""

from __future__ import annotations

import os
import pickle
import struct
from datetime import timedelta
from typing import BinaryIO

import torch

from meshserve.cpu_affinity import ENV as CPU_AFFINITY_ENV
from meshserve.cpu_affinity import apply_from_env, format_cpu_list, usable_cpus

_LENGTH = struct.Struct("<Q")


def cpu_shares(world_size: int, cpus: list[int] | None = None) -> list[list[int]]:
    """The cores each rank is pinned to on CPU: contiguous equal shares of this
    process's cores, or one core each, round robin, when there are more ranks than cores.

    Returns:
        ``world_size`` non-empty lists of core ids.
    """
    cpus = usable_cpus() if cpus is None else sorted(cpus)
    if world_size >= len(cpus):
        return [[cpus[r % len(cpus)]] for r in range(world_size)]
    per = len(cpus) // world_size
    return [cpus[r * per:(r + 1) * per] for r in range(world_size)]


def rank_env(rank: int, world_size: int, port: int, cpus: list[int] | None) -> dict[str, str]:
    """The torchrun-style environment of rank ``rank`` (see the module doc)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo"}
    # "" when not pinned: the executor's own list (its environment's) is not the rank's
    env[CPU_AFFINITY_ENV] = format_cpu_list(cpus) if cpus is not None else ""
    return env


def pin_from_env(num_threads: int | None = None) -> None:
    """Pins every thread of this rank to the cores ``rank_env`` gave it (none: nothing
    changes) and sizes torch's thread pool to them (or ``num_threads``)."""
    cpus = apply_from_env()
    if cpus:
        torch.set_num_threads(num_threads or len(cpus))


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: ``cuda`` (or ``cuda:k``) becomes ``cuda:<local_rank>``; CPU stays."""
    return f"cuda:{local_rank}" if torch.device(device).type == "cuda" else device


def backend_for(device: str) -> str:
    """``nccl`` for a CUDA device, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_store(rank: int, world_size: int, port: int, timeout_s: float) -> torch.distributed.TCPStore:
    """Rank 0 hosts the rendezvous store on loopback (``port`` 0: a free one; its
    ``port`` attribute says which); the other ranks connect to it."""
    return torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                                      timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_process_group(store, rank: int, world_size: int, device: str, timeout_s: float,
                       tensor_parallel_size: int = 1) -> None:
    """Joins the default process group (blocks until every rank has joined) and, with
    more than one pipeline stage of ``tensor_parallel_size`` > 1 ranks, makes each
    stage's tensor-parallel subgroup (``executor.models.parallel.register_group``).

    ``timeout_s``: a collective waiting longer than this for a peer raises.

    Raises:
        RuntimeError: a process group already exists in this process (one parallel
            executor per process).
    """
    if torch.distributed.is_initialized():
        raise RuntimeError("this process already belongs to a parallel group (one per process)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                                         timeout=timedelta(seconds=timeout_s))
    t = tensor_parallel_size
    if 1 < t < world_size:  # every rank makes every subgroup, in the same order
        from executor.models.parallel import register_group

        for stage in range(world_size // t):
            ranks = tuple(range(stage * t, (stage + 1) * t))
            register_group(ranks, torch.distributed.new_group(list(ranks)))


def encode_frame(message: object) -> bytes:
    """One frame of the step pipe: 8-byte little-endian length, then the pickle."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def read_frame(stream: BinaryIO) -> object:
    """Reads one frame written by ``encode_frame``.

    Raises:
        EOFError: the writer closed the pipe (rank 0 is gone).
    """
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the step pipe closed")
    (length,) = _LENGTH.unpack(head)
    body = stream.read(length)
    if len(body) < length:
        raise EOFError("the step pipe closed mid-frame")
    return pickle.loads(body)
