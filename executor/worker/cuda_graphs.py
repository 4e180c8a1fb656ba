"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is bound by kernel launches, not by the
GPU: dozens of small kernels per layer, each launched from Python. A CUDA graph
records the launches of one forward pass once and replays them with one call.
A graph replays fixed shapes and fixed addresses, so (as vLLM's
``gpu_model_runner`` ``cudagraph_batch_sizes`` and SGLang's
``cuda_graph_runner``):

* a **pure-decode** step (every scheduled request has query length 1) of ``n``
  requests runs the graph of the smallest bucket ``b >= n`` of
  ``graph_batch_sizes`` (1, 2, 4, then multiples of 8 up to 256, then of 16, up to
  the first size >= ``max_num_seqs``, at most 512); prefill and mixed steps, and
  larger decode batches, run eagerly;
* its inputs are copied into **static buffers** (``input_ids``, ``positions``,
  ``slot_mapping``, ``seq_lens``, ``num_computed_tokens``, ``block_table``; the
  query offsets are ``0..b``, fixed), rows ``n..b`` **padded**: token 0 at position
  0, one key, written to and read from slot 0 of the **padding block** (a KV block
  past the engine's ``num_blocks``, allocated for this and never given to a
  request), so padded rows touch no request's KV; their outputs are discarded;
* the attention backend's plan is **data-independent** for the bucket
  (``AttentionBackend.plan_static_decode``: the Triton decode grid sized for
  ``max_model_len``, not for this step's longest context), made once and reused by
  every replay; the forward pass reads no host value that changes per step;
* the graph captures the model's forward pass only (hidden states); logits of the
  real rows and sampling run eagerly after the replay.

Graphs are captured at start-up, after the KV cache is bound, largest bucket
first, all in one memory pool (``torch.cuda.graphs``: a warm-up pass on a side
stream before each capture compiles the Triton kernels and settles the
allocator). The padded path without capture (``capture=False``) runs the very same
static-buffer code eagerly: the CPU tests check that it gives the real rows
exactly the unpadded step's logits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from executor.attention.backend import AttentionBackend
from executor.attention.metadata import AttentionMetadata
from executor.engine.scheduler_output import ScheduledRequest

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH_SIZE = 512
"""The largest bucket captured (vLLM's cap): larger decode batches run eagerly."""


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """The buckets, ascending: 1, 2, 4, multiples of 8 below 256, then multiples of 16
    (vLLM's default capture sizes), up to the first one >= ``max_num_seqs`` and never
    above ``limit``.

    Raises:
        ValueError: ``max_num_seqs`` or ``limit`` < 1.
    """
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and limit must be >= 1, got {max_num_seqs} and {limit}")
    sizes = []
    for size in [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]:
        if size > limit:
            break
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return sizes


def graphs_off_reason(requested: bool | None, device_type: str, backend: AttentionBackend,
                      world_size: int) -> str | None:
    """Why decode steps run eagerly rather than from CUDA graphs, or None when they use graphs.

    Args:
        requested: ``EngineConfig.cuda_graphs`` (None: wherever they can run).
        device_type: the model's device type (``cuda``, ``cpu``…).
        backend: the attention backend (graphs need ``supports_cuda_graphs``).
        world_size: ranks of the replica (graphs: one rank only).
    """
    if requested is False:
        return "turned off (--no-cuda-graphs)"
    if device_type != "cuda":
        return f"not on a {device_type} device"
    if not backend.supports_cuda_graphs:
        return f"the {backend.name} attention backend plans each step from its data (use triton)"
    if world_size > 1:
        return "not with tensor or pipeline parallelism"
    return None


def pick_bucket(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_reqs`` rows; None when none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


@dataclass
class PaddedDecodeBatch:
    """A pure-decode batch padded to its bucket, as host arrays (rows ``num_reqs..bucket``
    are padding: token 0, position 0, one key in slot 0 of the padding block).

    Attributes:
        bucket: rows of the padded batch.
        num_reqs: real rows (the first ``num_reqs``, in the scheduler's decode order).
        input_ids, positions: ``(bucket,)`` int64.
        slot_mapping: ``(bucket,)`` int64 cache slot of each row's new K/V.
        seq_lens: ``(bucket,)`` int32 keys per row after this step's write.
        block_table: ``(bucket, max_blocks)`` int32, 0 past each row's blocks.
    """

    bucket: int
    num_reqs: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray


def pad_decode_batch(token_ids: list[int], num_computed_tokens: list[int], block_ids: list[list[int]],
                     block_size: int, bucket: int, max_blocks: int, padding_block: int) -> PaddedDecodeBatch:
    """The padded host arrays of a pure-decode batch.

    Args:
        token_ids: each request's one new token.
        num_computed_tokens: tokens each request has in the cache before this step
            (its new token's position).
        block_ids: each request's blocks, covering ``num_computed_tokens + 1`` tokens.
        block_size: tokens per block.
        bucket: rows to pad to (>= ``len(token_ids)``).
        max_blocks: width of the block table (``ceil(max_model_len / block_size)``).
        padding_block: the KV block padded rows write and read (outside the engine's pool).

    Raises:
        ValueError: more requests than ``bucket``, a request with more than
            ``max_blocks`` blocks, or blocks that do not cover its new token.
    """
    n = len(token_ids)
    if n > bucket:
        raise ValueError(f"{n} requests do not fit a bucket of {bucket}")
    positions = np.zeros(bucket, dtype=np.int64)
    positions[:n] = num_computed_tokens
    table = np.zeros((bucket, max_blocks), dtype=np.int32)
    table[n:, 0] = padding_block
    for i, blocks in enumerate(block_ids):
        if len(blocks) > max_blocks:
            raise ValueError(f"request {i}: {len(blocks)} blocks exceed the table's {max_blocks}")
        if len(blocks) * block_size <= positions[i]:
            raise ValueError(f"request {i}: {len(blocks)} blocks cannot hold position {positions[i]}")
        table[i, : len(blocks)] = blocks
    rows = np.arange(n)
    slots = np.full(bucket, padding_block * block_size, dtype=np.int64)
    slots[:n] = table[rows, positions[:n] // block_size].astype(np.int64) * block_size + positions[:n] % block_size
    input_ids = np.zeros(bucket, dtype=np.int64)
    input_ids[:n] = token_ids
    return PaddedDecodeBatch(bucket, n, input_ids, positions, slots, (positions + 1).astype(np.int32), table)


class CUDAGraphRunner:
    """Runs pure-decode steps padded to a bucket from static buffers, replaying one CUDA
    graph per bucket (``capture=True``) or the same padded pass eagerly (``capture=False``).

    Args:
        model: the model (``model(input_ids, positions, md)`` → ``(num_tokens, hidden)``).
        backend: its attention backend; capturing needs ``supports_cuda_graphs``.
        batch_sizes: the buckets, ascending (``graph_batch_sizes``).
        block_size: tokens per KV block.
        max_model_len: longest sequence (tokens): sizes the block table and the static plan.
        padding_block: the KV block padded rows use (the cache holds one more block
            than the engine's pool; see the module doc).
        device: the model's device.
        capture: record graphs (CUDA); False runs the padded pass eagerly (tests, CPU).

    Attributes:
        replays: steps run through each bucket (graph replays when capturing).

    Raises:
        ValueError: ``capture`` with a backend whose plan depends on the step's data,
            or on a non-CUDA device.
    """

    def __init__(self, model, backend: AttentionBackend, batch_sizes: list[int], block_size: int,
                 max_model_len: int, padding_block: int, device: torch.device | str, capture: bool = True):
        self.device = torch.device(device)
        if capture and (self.device.type != "cuda" or not backend.supports_cuda_graphs):
            raise ValueError(f"CUDA graphs need a CUDA device and an attention backend with a data-independent "
                             f"decode plan, not {self.device.type!r} and {backend.name!r}")
        self.model, self.backend, self.capture = model, backend, capture
        self.batch_sizes = sorted(batch_sizes)
        self.block_size, self.max_model_len, self.padding_block = block_size, max_model_len, padding_block
        self.max_blocks = -(-max_model_len // block_size)
        self.replays: dict[int, int] = {b: 0 for b in self.batch_sizes}
        self.capture_seconds = 0.0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        largest = self.batch_sizes[-1]
        with torch.inference_mode():
            empty = pad_decode_batch([], [], [], block_size, largest, self.max_blocks, padding_block)
            self.input_ids = torch.from_numpy(empty.input_ids).to(self.device)
            self.positions = torch.from_numpy(empty.positions).to(self.device)
            self.slot_mapping = torch.from_numpy(empty.slot_mapping).to(self.device)
            self.seq_lens = torch.from_numpy(empty.seq_lens).to(self.device)
            self.num_computed_tokens = torch.zeros(largest, dtype=torch.int32, device=self.device)
            self.block_table = torch.from_numpy(empty.block_table).to(self.device)
            self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=self.device)
        self.metadata = {b: self._static_metadata(b) for b in self.batch_sizes}

    @property
    def num_replays(self) -> int:
        """Steps run through a bucket in all."""
        return sum(self.replays.values())

    def _static_metadata(self, b: int) -> AttentionMetadata:
        """Bucket ``b``'s metadata: views of the static buffers; the static plan when the
        backend has one (else the host lists are the padding rows', replaced per step)."""
        md = AttentionMetadata(
            num_reqs=b, num_tokens=b, num_decodes=b, max_query_len=1, max_seq_len=self.max_model_len,
            block_size=self.block_size, query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            num_computed_tokens=self.num_computed_tokens[:b], slot_mapping=self.slot_mapping[:b],
            block_table=self.block_table[:b], query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[1] * b,
            num_computed_tokens_cpu=[0] * b)
        if self.backend.supports_cuda_graphs:
            self.backend.plan_static_decode(md, self.max_model_len)
        return md

    def pad(self, scheduled: list[ScheduledRequest]) -> PaddedDecodeBatch | None:
        """The padded batch of a step (requests in the runner's order), or None when the
        step must run eagerly: not every request decodes one token, no bucket holds
        them, or a request is longer than the static plan's ``max_model_len`` or its
        blocks do not fit the static block table."""
        if not scheduled or any(s.num_scheduled_tokens != 1 for s in scheduled):
            return None
        bucket = pick_bucket(self.batch_sizes, len(scheduled))
        if bucket is None or any(len(s.block_ids) > self.max_blocks or s.num_computed_tokens >= self.max_model_len
                                 for s in scheduled):
            return None
        return pad_decode_batch([s.token_ids[0] for s in scheduled], [s.num_computed_tokens for s in scheduled],
                                [s.block_ids for s in scheduled], self.block_size, bucket, self.max_blocks,
                                self.padding_block)

    def run(self, batch: PaddedDecodeBatch) -> torch.Tensor:
        """Copies ``batch`` into the static buffers and runs its bucket (graph replay or
        the eager padded pass); returns the real rows' hidden states ``(num_reqs,
        hidden_size)`` (a view of the graph's output: valid until the next ``run``)."""
        with torch.inference_mode():  # the static buffers are inference tensors
            return self._run(batch)

    def _run(self, batch: PaddedDecodeBatch) -> torch.Tensor:
        b = batch.bucket
        self.input_ids[:b].copy_(torch.from_numpy(batch.input_ids))
        self.positions[:b].copy_(torch.from_numpy(batch.positions))
        self.slot_mapping[:b].copy_(torch.from_numpy(batch.slot_mapping))
        self.seq_lens[:b].copy_(torch.from_numpy(batch.seq_lens))
        self.num_computed_tokens[:b].copy_(torch.from_numpy(batch.positions.astype(np.int32)))
        self.block_table[:b].copy_(torch.from_numpy(batch.block_table))
        self.replays[b] += 1
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][: batch.num_reqs]
        md = self.metadata[b]
        if not self.backend.supports_cuda_graphs:  # a per-step plan (eager only)
            seq = batch.seq_lens.tolist()
            md = dataclasses.replace(md, seq_lens_cpu=seq, num_computed_tokens_cpu=batch.positions.tolist(),
                                     max_seq_len=max(seq), plan=None)
            self.backend.plan(md)
        return self.model(self.input_ids[:b], self.positions[:b], md)[: batch.num_reqs]

    def capture_all(self) -> None:
        """Captures every bucket's graph, largest first, into one memory pool; logs the
        time and the device memory it took. A no-op unless ``capture``.

        Raises:
            RuntimeError: CUDA refused the capture (e.g. an op that syncs the host).
        """
        if not self.capture:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.batch_sizes):
                self._capture(b)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("captured %d CUDA graphs of decode steps (batch sizes %s) in %.2f s, %.1f MiB of device memory",
                 len(self.graphs), _ranges(self.batch_sizes), self.capture_seconds, used / 2**20)

    def _capture(self, b: int) -> None:
        """Warm-up passes on a side stream, then bucket ``b``'s capture (the static
        buffers hold padding rows only: the passes write the padding block alone)."""
        md = self.metadata[b]
        forward = lambda: self.model(self.input_ids[:b], self.positions[:b], md)  # noqa: E731
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[b] = forward()
        self.graphs[b] = graph


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:4]))}, …, {sizes[-1]}"
