"""The CPU prefill-attention kernel (``cpu_prefill_attention.c``): causal attention of a
step's prefill chunks over the paged bfloat16 cache, tiled over query rows, for CPUs with
AVX512-BF16; built once, cached on disk, called through ``ctypes``.

Why a kernel: past ``PREFILL_KERNEL_MAX_LEN`` tokens the torch backend ran its prefill
chunks in SDPA (and the decode kernel, which takes each prompt token as a query row of its
own, reads every key once per later token of the prompt). Here a tile of 48
query rows (a kv head's query heads over consecutive tokens of one request) shares every
key and value it reads, and both products run on ``VDPBF16PS`` (the algorithm and its
rounding: the C file's header). On one Zen 4 core, one prompt over SmolLM2-135M's 30
layers (``python -m meshserve.bench.cpu_prefill_attention``): 150 tokens 8.7 ms against
12.8 for the decode kernel's token rows and 32.9 for SDPA; 416 tokens 45 against 80 and
172; 790 tokens 155 against 281 and 471.

Each token's result depends on its own prefix only (key blocks at absolute positions,
masked keys adding exact zeros): chunked and whole prefills give the same bits, in any
batch. It differs from the decode kernel's result for the same token by rounding (the
probabilities are rounded to bfloat16 before the weighted sum, as in ATen's flash
attention for bfloat16), so the backend uses it only for chunks longer than
``PREFILL_KERNEL_MAX_LEN`` (where SDPA ran before): shorter ones, in any step, keep the
decode kernel's token rows, bitwise the decodes of the same tokens.

Built with the decode kernel's machinery (``cpu_kernel.build_and_load``) but without
``-ffast-math``: its sums must not be reassociated. ``MESHSERVE_CPU_PREFILL_KERNEL=0``
turns it off; where it cannot be built or the CPU lacks AVX512-BF16, ``load`` returns
``None`` and the backend keeps its other paths.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from executor.attention import cpu_kernel

SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
HEAD_DIMS = (64, 128)
"""Head sizes the kernel takes."""
MAX_GROUP = 48
"""Most query heads per kv head (a tile's 48 rows hold at least one token)."""

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _bind(lib: ctypes.CDLL):
    if not lib.prefill_attention_available():
        raise AttributeError("built for a CPU without AVX512-BF16")
    fn = lib.paged_prefill_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + \
        [ctypes.c_float]
    return fn


def load():
    """The kernel's ``ctypes`` function, built if needed; ``None`` where it cannot be (no
    AVX512-BF16, no compiler, a failed build, or ``MESHSERVE_CPU_PREFILL_KERNEL=0``).
    Once per process."""
    return cpu_kernel.load_once(_loaded, _lock, "fn", {"avx512f", "avx512bw", "avx512_bf16"}, "AVX512-BF16",
                                "CPU prefill-attention kernel", SOURCE, FLAGS, "MESHSERVE_CPU_PREFILL_KERNEL",
                                "the decode kernel or SDPA for prefills", _bind)


def preferred():
    """The kernel where the torch backend should run long chunks in it rather than in SDPA:
    ``load()`` on a CPU without AMX-BF16, None on one with it. There ATen's flash attention
    (SDPA) multiplies on AMX tiles and is the faster: one Sapphire Rapids core, a prompt's
    30 layers (``python -m meshserve.bench.cpu_prefill_attention``) 62 against 116 ms at 416
    tokens, 114 against 261 at 600, 2.7x at 1,500 and 3,000; a 1,000-token chunk after
    2,000 cached tokens (the backend's masked SDPA over the gathered keys) 66 against 124 ms
    a layer. On Zen 4 (AVX512-BF16, no AMX) the kernel is 3-3.8x SDPA."""
    if "amx_bf16" in cpu_kernel.cpu_flags().split():
        return None
    return load()


def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: bfloat16 on the CPU, a contiguous cache, a
    head size of 64 or 128, at most 48 query heads per kv head, torch on one thread."""
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads = key_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and key_cache.dtype == torch.bfloat16
            and key_cache.is_contiguous() and head_dim in HEAD_DIMS and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and torch.get_num_threads() == 1)


def prefill_attention(fn, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``q`` ``(T, num_heads, head_dim)`` bfloat16, request ``r``'s
    tokens the rows ``query_start[r]:query_start[r + 1]``, the last of them at position
    ``seq_lens[r] - 1``, over its cached keys (this step's written first);
    ``block_table`` ``(n, max_blocks)``, ``query_start`` ``(n + 1,)`` and ``seq_lens``
    ``(n,)`` int32, contiguous. Returns ``(T, num_heads, head_dim)`` bfloat16: ``out``
    (contiguous, ``T`` rows) when given, else a new tensor. Needs ``supports``.

    Raises:
        MemoryError: the kernel could not allocate its scratch memory (about 40 KiB).
        ValueError: shapes the kernel does not take (``supports`` says which).
    """
    q = q.contiguous()
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(q)
    n = seq_lens.shape[0]
    rc = fn(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
            block_table.stride(0), query_start.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), n, num_heads,
            num_kv_heads, head_dim, block_size, scale)
    if rc == 1:
        raise MemoryError("the CPU prefill-attention kernel could not allocate its scratch memory")
    if rc:
        raise ValueError(f"the CPU prefill-attention kernel does not take {num_heads} heads over {num_kv_heads} "
                         f"kv heads of {head_dim}")
    return out
