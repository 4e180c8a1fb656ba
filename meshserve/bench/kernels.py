"""``python -m meshserve.bench.kernels [--json FILE]``: the Triton paged-attention
kernels against the torch backend on realistic shapes (CUDA only).

Each case times one attention layer's ``AttentionBackend.forward`` (cache write +
attention; ``plan`` runs once outside the timing, as in the engine, where it runs
once per step) with ``triton.testing.do_bench`` (median of repeated runs, the L2
cache flushed between them), for the ``triton`` and the ``torch`` backend.

Bandwidth. Decode is memory bound, so its figure of merit is the achieved memory
bandwidth::

    bytes = sum_i seq_len_i * num_kv_heads * head_dim * 2 * elem   (K and V read once)
          + num_tokens * num_heads * head_dim * 2 * elem             (q read, out written)
          + num_tokens * num_kv_heads * head_dim * 2 * elem * 2      (new k/v read and written)
    GB/s  = bytes / seconds / 1e9

(block tables and split-K partials are left out: they are under 1% here), to be
set against the device's peak (H200: ~4.8 TB/s). Prefill is compute bound, so it
also reports causal attention TFLOP/s::

    flops = sum_i 4 * num_heads * head_dim * sum_{query t of i} (keys t attends to)

(two matmuls of 2 flops per multiply-add). Without CUDA the module says so and
exits 0: the kernels only run in Triton's interpreter there, which measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

DECODE_SHAPES = [(64, 1024), (64, 4096), (64, 16384), (256, 1024), (256, 4096), (256, 16384)]
"""(batch, context tokens) of the decode cases."""

PREFILL_SHAPES = [([2048] * 4, [0] * 4), ([512] * 4, [8192] * 4)]
"""(query lengths, cached context lengths) of the prefill cases: fresh prompts, and
chunks after a long cached prefix."""

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@dataclass
class KernelResult:
    kind: str            # "decode" or "prefill"
    backend: str         # "triton" or "torch"
    batch: int           # requests
    query_tokens: int    # tokens in the flattened batch
    context: int         # longest seq_len (tokens)
    ms: float            # median time of one layer's forward
    gb_per_s: float      # achieved bandwidth, formula in the module docstring
    tflop_per_s: float   # attention TFLOP/s (causal)


def _case(kind: str, query_lens: list[int], contexts: list[int], backends: list[str], dtype) -> list[KernelResult]:
    import torch
    import triton.testing

    from executor.attention import build_attention_metadata, get_backend

    seqs = [c + n for c, n in zip(contexts, query_lens)]
    need = [-(-s // BLOCK_SIZE) for s in seqs]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks).tolist()
    blocks, i = [], 0
    for n in need:
        blocks.append(perm[i:i + n])
        i += n
    device = torch.device("cuda")
    md = build_attention_metadata(query_lens, contexts, blocks, BLOCK_SIZE, device)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))
    q = torch.randn(md.num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k, v = torch.randn(2, md.num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    elem = q.element_size()
    kv_bytes = sum(seqs) * NUM_KV_HEADS * HEAD_DIM * 2 * elem
    io_bytes = md.num_tokens * HEAD_DIM * elem * (2 * NUM_HEADS + 4 * NUM_KV_HEADS)
    keys_attended = sum(c * n + n * (n + 1) // 2 for c, n in zip(contexts, query_lens))
    flops = 4 * NUM_HEADS * HEAD_DIM * keys_attended
    results = []
    for name in backends:
        backend = get_backend(name)
        md.plan = None
        backend.plan(md)
        scale = HEAD_DIM**-0.5
        ms = triton.testing.do_bench(lambda: backend.forward(q, k, v, cache, md, scale), return_mode="median")
        results.append(KernelResult(kind, name, len(query_lens), md.num_tokens, max(seqs), ms,
                                    (kv_bytes + io_bytes) / ms / 1e6, flops / ms / 1e9))
        print(f"{kind:8s} {name:7s} batch {len(query_lens):4d} tokens {md.num_tokens:5d} context {max(seqs):6d}  "
              f"{ms:8.3f} ms  {results[-1].gb_per_s:8.1f} GB/s  {results[-1].tflop_per_s:7.2f} TFLOP/s", flush=True)
    del cache
    torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--no-torch", action="store_true", help="time only the triton backend")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("meshserve.bench.kernels: no CUDA device; the Triton kernels only run interpreted here "
              "(tests/executor/test_triton_attention.py checks them), so there is nothing to time.")
        return 0
    try:
        import triton
    except ImportError:
        print("meshserve.bench.kernels: triton is not installed; nothing to time.")
        return 0

    dtype = torch.bfloat16
    backends = ["triton"] if args.no_torch else ["triton", "torch"]
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"heads {NUM_HEADS}/{NUM_KV_HEADS}  head_dim {HEAD_DIM}  block {BLOCK_SIZE}  {dtype}")
    results: list[KernelResult] = []
    for batch, context in DECODE_SHAPES:
        results += _case("decode", [1] * batch, [context - 1] * batch, backends, dtype)
    for query_lens, contexts in PREFILL_SHAPES:
        results += _case("prefill", query_lens, contexts, backends, dtype)
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": str(dtype), "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
