"""``python -m meshserve.bench.cpu_attention --batch 32 --context 150 [--dtype float32] [--json FILE]``:
one layer's decode attention on CPU, the padded SDPA path against the CPU kernel.

``--batch`` requests decode one token each over about ``--context`` cached
tokens (spread ±20%, scattered blocks of 16), with the default model's
geometry (9 query heads, 3 KV heads, head_dim 64) unless ``--heads``,
``--kv-heads``, ``--head-dim`` say otherwise, on one torch thread. The two paths
of ``TorchAttentionBackend`` run interleaved on the same inputs: ``sdpa`` (blocks
gathered into a padded batch, SDPA with a mask, the path used on several
threads or without a C compiler) and ``kernel`` (``executor/attention/cpu_kernel.py``).
Reported per path: the median of ``--repeat`` calls in wall milliseconds and in
thread CPU milliseconds (the latter is what other processes on a shared
machine disturb least), and the largest difference between the two outputs.

``--layers N`` (N > 1) also times the kernel as a decode step runs it: over N
layers whose caches together fill ``--kv-cache-memory`` (default 1GiB, on
transparent huge pages as the executor allocates them, ``executor/huge_pages.py``),
each request's blocks scattered at random over it, so the keys and values come
from memory rather than from the CPU's caches: ``kernel_layers``, the median thread
CPU milliseconds of one pass over the N layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def run(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: str, repeat: int) -> dict:
    import torch

    from executor.attention import build_attention_metadata, cpu_kernel
    from executor.attention.torch_backend import TorchAttentionBackend

    torch.set_num_threads(1)
    torch_dtype = getattr(torch, dtype)
    block_size = 16
    lo, hi = max(1, int(context * 0.8)), max(1, int(context * 1.2))
    contexts = sorted((lo + (hi - lo) * i // max(1, batch - 1) for i in range(batch)), reverse=True)
    need = [-(-(c + 1) // block_size) for c in contexts]
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(sum(need) + 1, generator=gen).tolist()
    block_ids, i = [], 0
    for n in need:
        block_ids.append(perm[i:i + n])
        i += n
    shape = (len(perm), block_size, kv_heads, head_dim)
    cache = (torch.randn(shape, generator=gen).to(torch_dtype), torch.randn(shape, generator=gen).to(torch_dtype))
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch_dtype)
    k = torch.randn(batch, kv_heads, head_dim, generator=gen).to(torch_dtype)
    v = torch.randn(batch, kv_heads, head_dim, generator=gen).to(torch_dtype)
    scale = head_dim ** -0.5
    fn = cpu_kernel.load()
    if fn is None:
        raise SystemExit("the CPU attention kernel could not be built here (see the warning above)")

    md = build_attention_metadata([1] * batch, contexts, block_ids, block_size)
    sdpa_backend = TorchAttentionBackend()
    sdpa_backend._kernel = None  # the padded SDPA path
    sdpa_backend.plan(md)

    def sdpa():
        return sdpa_backend.forward(q, k, v, cache, md, scale)

    def kernel():
        return cpu_kernel.decode_attention(fn, q, *cache, md.block_table, md.seq_lens, scale)

    diff = float((sdpa().float() - kernel().float()).abs().max())
    paths = {"sdpa": sdpa, "kernel": kernel}
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, call in paths.items():
            w, c = time.perf_counter(), time.thread_time()
            call()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - w)
    result = {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "dtype": dtype, "repeat": repeat, "max_abs_diff": diff}
    for name in paths:
        result[name] = {"wall_ms": round(statistics.median(wall[name]) * 1e3, 3),
                        "thread_cpu_ms": round(statistics.median(cpu[name]) * 1e3, 3)}
    return result


def run_layers(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: str, repeat: int,
               layers: int, kv_cache_memory: int) -> dict:
    """The kernel over ``layers`` layers' caches filling ``kv_cache_memory`` bytes,
    blocks scattered: median thread CPU milliseconds of a pass over every layer."""
    import torch

    from executor import huge_pages
    from executor.attention import cpu_kernel

    torch.set_num_threads(1)
    torch_dtype = getattr(torch, dtype)
    block_size = 16
    block_bytes = 2 * layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=torch_dtype).element_size()
    num_blocks = kv_cache_memory // block_bytes
    lo, hi = max(1, int(context * 0.8)), max(1, int(context * 1.2))
    seq_lens = [lo + (hi - lo) * i // max(1, batch - 1) + 1 for i in range(batch)]
    need = [-(-n // block_size) for n in seq_lens]
    if sum(need) > num_blocks:
        raise SystemExit(f"--kv-cache-memory holds {num_blocks} blocks; the batch needs {sum(need)}")
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(batch, max(need), dtype=torch.int32)
    start = 0
    for r, n in enumerate(need):
        block_table[r, :n] = perm[start:start + n]
        start += n
    cache = huge_pages.empty((layers, 2, num_blocks, block_size, kv_heads, head_dim), torch_dtype)
    for layer in range(layers):  # random rows, written layer by layer (no second full-size buffer)
        cache[layer].copy_(torch.randn(cache.shape[1:], generator=gen).to(torch_dtype))
    q = torch.randn(layers, batch, heads, head_dim, generator=gen).to(torch_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    fn = cpu_kernel.load()
    if fn is None:
        raise SystemExit("the CPU attention kernel could not be built here (see the warning above)")
    times = []
    for _ in range(repeat):
        c = time.thread_time()
        for layer in range(layers):
            cpu_kernel.decode_attention(fn, q[layer], cache[layer, 0], cache[layer, 1], block_table, lens,
                                        head_dim ** -0.5)
        times.append(time.thread_time() - c)
    return {"layers": layers, "num_blocks": num_blocks, "thread_cpu_ms": round(statistics.median(times) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.cpu_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--layers", type=int, default=1,
                        help="also time the kernel over this many layers' caches, read from memory")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="with --layers: their caches' size")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if min(args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.repeat, args.layers) < 1 or \
            args.heads % args.kv_heads:
        parser.error("sizes must be >= 1 and --kv-heads must divide --heads")
    result = run(args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.dtype, args.repeat)
    print(f"decode attention, one layer: batch {args.batch}, context ~{args.context}, {args.heads}/{args.kv_heads} "
          f"heads, head_dim {args.head_dim}, {args.dtype}, one thread (medians of {args.repeat})")
    for name in ("sdpa", "kernel"):
        print(f"  {name:6s} {result[name]['wall_ms']:8.3f} ms wall  {result[name]['thread_cpu_ms']:8.3f} ms thread CPU")
    print(f"  sdpa / kernel (thread CPU): {result['sdpa']['thread_cpu_ms'] / result['kernel']['thread_cpu_ms']:.2f}x; "
          f"largest difference {result['max_abs_diff']:.2e}")
    if args.layers > 1:
        from meshserve.cli.options import parse_bytes

        result["kernel_layers"] = run_layers(args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                                             args.dtype, args.repeat, args.layers, parse_bytes(args.kv_cache_memory))
        layers = result["kernel_layers"]
        print(f"  kernel over {args.layers} layers from a {args.kv_cache_memory} cache ({layers['num_blocks']} "
              f"blocks, scattered): {layers['thread_cpu_ms']:.3f} ms thread CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
