"""``python -m meshserve.bench.cpu_prefill_attention --prompt-lens 150 416 790 [--layers 30] [--json FILE]``:
one prompt's prefill attention over ``--layers`` layers on one CPU thread, in bfloat16,
through the three paths the torch backend can take for it, interleaved:

* ``prefill_kernel``: the tiled prefill kernel (``executor/attention/cpu_prefill_kernel.py``,
  CPUs with AVX512-BF16);
* ``token_rows``: every prompt token a query row of the decode kernel over its own prefix
  (``cpu_kernel.py``; the backend's path for chunks up to ``PREFILL_KERNEL_MAX_LEN`` tokens
  without the prefill kernel);
* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` on the prompt's own keys and
  values (the path for longer chunks).

The default model's geometry (9 query heads, 3 KV heads, head_dim 64) unless ``--heads``,
``--kv-heads``, ``--head-dim`` say otherwise; each layer its own paged cache (blocks of
16 in order). Reported per prompt length and path: the median wall milliseconds of
``--repeat`` passes over the layers, the speed-up of the prefill kernel over the others,
and the largest difference of each path's output from the prefill kernel's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def run(prompt_len: int, layers: int, heads: int, kv_heads: int, head_dim: int, repeat: int) -> dict:
    """The three paths' median milliseconds for one ``prompt_len``-token prompt over ``layers`` layers.

    Raises:
        SystemExit: no prefill kernel on this machine (no AVX512-BF16 or no C compiler).
    """
    import torch
    import torch.nn.functional as F

    from executor.attention import cpu_kernel, cpu_prefill_kernel

    torch.set_num_threads(1)
    prefill, decode = cpu_prefill_kernel.load(), cpu_kernel.load()
    if prefill is None or decode is None:
        raise SystemExit("the prefill kernel needs a CPU with AVX512-BF16 and a C compiler")
    gen = torch.Generator().manual_seed(0)
    block_size, scale = 16, head_dim ** -0.5
    num_blocks = -(-prompt_len // block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
              for _ in range(layers)]
    q = torch.randn(prompt_len, heads, head_dim, generator=gen).bfloat16()
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(1, num_blocks)
    query_start = torch.tensor([0, prompt_len], dtype=torch.int32)
    seq_lens = torch.tensor([prompt_len], dtype=torch.int32)
    token_table = block_table.expand(prompt_len, num_blocks).contiguous()
    token_lens = torch.arange(1, prompt_len + 1, dtype=torch.int32)

    def own_kv(cache):  # the prompt's keys and values in order, (1, kv_heads, prompt_len, head_dim)
        return [c.view(-1, kv_heads, head_dim)[:prompt_len].transpose(0, 1).unsqueeze(0) for c in cache]

    paths = {
        "prefill_kernel": lambda c: cpu_prefill_kernel.prefill_attention(prefill, q, *c, block_table, query_start,
                                                                         seq_lens, scale),
        "token_rows": lambda c: cpu_kernel.decode_attention(decode, q, *c, token_table, token_lens, scale),
        "sdpa": lambda c: F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), *own_kv(c), is_causal=True,
                                                         scale=scale, enable_gqa=True).squeeze(0).transpose(0, 1),
    }
    outputs = {name: fn(caches[0]) for name, fn in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, fn in paths.items():
            start = time.perf_counter()
            for cache in caches:
                fn(cache)
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: round(statistics.median(t), 3) for name, t in times.items()}
    return {"prompt_len": prompt_len, "layers": layers, "ms": ms,
            "speedup": {name: round(ms[name] / ms["prefill_kernel"], 2) for name in ("token_rows", "sdpa")},
            "max_abs_diff": {name: float((outputs[name].float() - outputs["prefill_kernel"].float()).abs().max())
                             for name in ("token_rows", "sdpa")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[150, 416, 790])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    results = []
    for prompt_len in args.prompt_lens:
        r = run(prompt_len, args.layers, args.heads, args.kv_heads, args.head_dim, args.repeat)
        results.append(r)
        print(f"prompt {prompt_len:5d} x {args.layers} layers  " +
              "  ".join(f"{name} {ms:8.2f} ms" for name, ms in r["ms"].items()) +
              f"  prefill kernel x{r['speedup']['token_rows']} token rows, x{r['speedup']['sdpa']} SDPA")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
