"""``python -m meshserve.bench.decode_graphs [--json FILE]``: engine decode steps with
CUDA graphs on and off (CUDA only).

A random-init Llama (``--layers``, ``--hidden``; head_dim 64, 4 query heads per KV
head; saved with ``transformers``, so no download) runs in two engines on the
same device, one with ``cuda_graphs=True`` and one with ``False``, both on the
triton backend. For each batch size, each engine gets that many requests of
``--prompt`` random tokens (greedy, ``ignore_eos``); after their prefill and
``--warmup`` decode steps, the next ``--steps`` ``LLMEngine.step`` calls are timed
one by one with ``time.perf_counter`` (a step ends with the sampled ids copied to
the host, so its wall time is the whole step: scheduling, inputs, forward,
logits, sampling). The two engines alternate batch by batch. Reported: median ms
per decode step and decode tokens/s for each mode, the ratio, whether both modes
generated the same token ids (informative only: in bfloat16, cuBLAS may round a
padded batch's rows differently and a near-tie of this random model's flat logits
may then flip; ``tests/executor/test_cuda_graphs.py`` checks equality in float32),
and the graphs' capture time. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def _save_model(path: str, layers: int, hidden: int, vocab: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 4), head_dim=64, max_position_embeddings=4096,
                         initializer_range=0.02, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def _time_decode(engine, batch: int, prompt_len: int, warmup: int, steps: int, vocab: int, tag: str):
    """Median seconds of ``steps`` pure-decode engine steps at ``batch`` requests, and the
    token ids each request generated."""
    import torch

    from meshserve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=1 + warmup + steps, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        if min(len(t) for t in tokens.values()) > 1 + warmup:  # every request past prefill and warm-up
            times.append(elapsed)
    return statistics.median(times[-steps:]), [tokens[rid] for rid in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.decode_graphs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps before the timed ones")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size and mode")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("meshserve.bench.decode_graphs: no CUDA device; CUDA graphs only run there, nothing to time.")
        return 0
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as path:
        _save_model(path, args.layers, args.hidden, args.vocab)
        engines = {}
        for graphs in (True, False):
            engines[graphs] = LLMEngine(EngineConfig(
                model=path, device="cuda", dtype=args.dtype, attention_backend="triton", cuda_graphs=graphs,
                max_model_len=2048, cache=CacheConfig(block_size=16, kv_cache_memory_bytes=2 << 30),
                batch=BatchSchedulerConfig(max_num_seqs=max(sizes), max_num_batched_tokens=8192)))
    runner = engines[True].worker_group.worker.model_runner
    capture_s = runner.graphs.capture_seconds if runner.graphs is not None else None
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  layers {args.layers}  "
          f"hidden {args.hidden}  {args.dtype}  capture {capture_s:.2f} s" if capture_s is not None
          else "graphs were not captured (see the log)")
    print(f"{'batch':>5}  {'eager ms':>9}  {'graphs ms':>9}  {'eager tok/s':>11}  {'graphs tok/s':>12}  "
          f"{'speedup':>7}  same tokens")
    rows = []
    for batch in sizes:
        med, toks = {}, {}
        for graphs in (False, True):
            med[graphs], toks[graphs] = _time_decode(engines[graphs], batch, args.prompt, args.warmup, args.steps,
                                                     args.vocab, "g" if graphs else "e")
        row = {"batch": batch, "eager_ms": med[False] * 1e3, "graphs_ms": med[True] * 1e3,
               "eager_tok_s": batch / med[False], "graphs_tok_s": batch / med[True],
               "speedup": med[False] / med[True], "same_tokens": toks[False] == toks[True]}
        rows.append(row)
        print(f"{batch:>5}  {row['eager_ms']:>9.2f}  {row['graphs_ms']:>9.2f}  {row['eager_tok_s']:>11.0f}  "
              f"{row['graphs_tok_s']:>12.0f}  {row['speedup']:>6.2f}x  {row['same_tokens']}")
    if runner.graphs is not None:
        print(f"replays per bucket: { {b: n for b, n in runner.graphs.replays.items() if n} }")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "layers": args.layers, "hidden": args.hidden,
                       "dtype": args.dtype, "capture_s": capture_s, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
