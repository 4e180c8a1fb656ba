"""``python -m meshserve.bench.ceiling --dtype float32 --batch 32 --threads 1 [--json FILE]``:
how close one decode step of the model comes to the time of its matmuls alone (CPU).

For ``--batch`` requests decoding one token each, with about ``--context`` tokens
of context (spread over ±20%), it reports tokens per second of:

* **matmul-only**: just the model's linear layers (every ``qkv_proj``, ``o_proj``,
  ``gate_up_proj``, ``down_proj`` and the LM head: the same weights and shapes) on
  ``batch`` rows, once through plain ``F.linear`` (MKL) and once through the
  kernel the model itself calls (the packed CPU GEMM of
  ``executor/models/cpu_gemm.py`` where the weight could be packed; where
  ``gate_up_proj`` is packed for the fused SiLU GEMM, that GEMM, activation included).
  The ceiling a forward pass would reach if attention, norms and Python cost nothing;
* **forward**: the model's forward pass and logits for that decode step over a
  paged KV cache (``plan`` + ``model(...)`` + ``compute_logits``; no ModelRunner,
  no sampler), with the model's kernels and, for comparison, with every layer on
  plain ``F.linear``;
* **engine** (unless ``--no-engine``): an ``LLMEngine`` decoding ``batch``
  concurrent requests with ``context``-token prompts, greedy; only steps where
  every request decodes count (prefills excluded).

Each figure is ``batch / median(step seconds)`` over ``--repeat`` timed runs after
one warm-up, wall clock. Other processes on the host skew wall clock: compare
figures taken in one run, or pin the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from meshserve.model_files import resolve_model
from meshserve.sampling import SamplingParams

BLOCK_SIZE = 16


@dataclass
class Figure:
    ms: float                # median milliseconds of one decode step
    tokens_per_s: float      # batch / median step seconds


def _figure(times: list[float], batch: int) -> Figure:
    median = statistics.median(times)
    return Figure(round(median * 1e3, 3), round(batch / median, 2))


def _time(fn, repeat: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _contexts(batch: int, context: int) -> list[int]:
    """``batch`` context lengths spread evenly over ``context`` ±20%, longest first
    (the ModelRunner's decode order)."""
    low, high = max(1, int(context * 0.8)), max(1, int(context * 1.2))
    return sorted((low + (high - low) * i // max(1, batch - 1) for i in range(batch)), reverse=True)


def matmul_only(model, batch: int, repeat: int):
    """Times every linear layer of ``model`` on ``batch`` random rows: plain ``F.linear``
    and the model's own kernel. Returns ``(plain, model_kernel)`` Figures."""
    import torch
    import torch.nn.functional as F

    from executor.models import cpu_gemm

    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, m.weight.shape[1], generator=gen).to(m.weight.dtype) for m in layers]
    biases = [getattr(m, "bias", None) for m in layers]

    def plain():
        for m, x, b in zip(layers, inputs, biases):
            F.linear(x, m.weight, b)

    def own():
        for m, x, b in zip(layers, inputs, biases):
            if getattr(m, "silu_packed", None) is not None:  # the model's call: GEMM and activation
                m.forward_silu_mul(x)
            else:
                cpu_gemm.linear(x, m.weight, b, m.packed_weight)

    with torch.inference_mode():
        plain_times, own_times = [], []
        for _ in range(repeat):  # interleaved, so load on the host hits both alike
            plain_times += _time(plain, 1)
            own_times += _time(own, 1)
    return _figure(plain_times, batch), _figure(own_times, batch)


def decode_step_inputs(loaded, batch: int, context: int):
    """One decode step's inputs for ``loaded``'s model: ``batch`` requests of about
    ``context`` tokens (``_contexts``) whose blocks are scattered over a random KV cache
    (as in a used pool), set on every attention layer. Returns ``(metadata,
    input_ids (batch,) int64, positions (batch,) int64)``; seeded (the same every call)."""
    return step_inputs(loaded, [1] * batch, _contexts(batch, context))


def step_inputs(loaded, query_lens: list[int], contexts: list[int], seed: int = 0, spare_blocks: int = 1):
    """A step's inputs for ``loaded``'s model: request ``i`` computes ``query_lens[i]`` tokens
    after ``contexts[i]`` cached ones (1 token: a decode), its blocks scattered over a random
    KV cache of ``spare_blocks`` more blocks than the step needs, set on every attention
    layer. Returns ``(metadata, input_ids (num_tokens,) int64, positions (num_tokens,) int64)``;
    the same for the same ``seed``."""
    import torch

    from executor.attention import build_attention_metadata

    need = [-(-(c + q) // BLOCK_SIZE) for q, c in zip(query_lens, contexts)]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(sum(need) + spare_blocks, generator=gen).tolist()  # scattered, as in a used pool
    block_ids, i = [], 0
    for n in need:
        block_ids.append(perm[i:i + n])
        i += n
    layers = loaded.model.attention_layers()
    shape = (len(perm), BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim)
    for layer in layers:
        layer.kv_cache = (torch.randn(shape, generator=gen).to(loaded.dtype),
                          torch.randn(shape, generator=gen).to(loaded.dtype))
    md = build_attention_metadata(query_lens, contexts, block_ids, BLOCK_SIZE)
    input_ids = torch.randint(0, loaded.vocab_size, (sum(query_lens),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, contexts)])
    return md, input_ids, positions


def forward(loaded, batch: int, context: int, repeat: int) -> tuple[Figure, Figure]:
    """Times ``plan`` + forward + logits of one decode step over a paged KV cache, with
    the packed weights and without (plain ``F.linear``), interleaved. Returns
    ``(packed, plain)`` Figures."""
    import torch

    from executor.models.linear import packed_copies, set_packed_copies

    md, input_ids, positions = decode_step_inputs(loaded, batch, context)
    layers = loaded.model.attention_layers()
    backend = layers[0].backend

    def step():
        md.plan = None
        backend.plan(md)
        with torch.inference_mode():
            hidden = loaded.model(input_ids, positions, md)
            loaded.model.compute_logits(hidden)

    linears = [m for m in loaded.model.modules() if hasattr(m, "packed_weight")]
    packed = [packed_copies(m) for m in linears]
    packed_times, plain_times = [], []
    try:
        for _ in range(repeat):
            packed_times += _time(step, 1)
            for m, copies in zip(linears, packed):
                set_packed_copies(m, dict.fromkeys(copies))
            plain_times += _time(step, 1)
            for m, copies in zip(linears, packed):
                set_packed_copies(m, copies)
    finally:
        for layer in layers:
            layer.kv_cache = None
    return _figure(packed_times, batch), _figure(plain_times, batch)


def engine(dtype: str, batch: int, context: int, threads: int, repeat: int) -> Figure:
    """Tokens/s of an ``LLMEngine`` over steps where all ``batch`` requests decode."""
    import torch

    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine

    contexts = _contexts(batch, context)
    blocks = sum(-(-(c + repeat + 2) // BLOCK_SIZE) for c in contexts) + 8
    eng = LLMEngine(EngineConfig(dtype=dtype, num_threads=threads, cache=CacheConfig(num_blocks=blocks),
                                 batch=BatchSchedulerConfig(max_num_seqs=batch,
                                                            max_num_batched_tokens=max(2048, max(contexts)))))
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=repeat + 2, temperature=0.0, ignore_eos=True)
    for i, c in enumerate(contexts):
        eng.add_request(f"r{i}", torch.randint(10, eng.vocab_size, (c,), generator=gen).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefills (and a first token each)
        started.update(out.request_id for out in eng.step())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        outputs = eng.step()
        elapsed = time.perf_counter() - start
        if len(outputs) == batch:
            times.append(elapsed)
    while eng.has_unfinished_requests():
        eng.step()
    return _figure(times, batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.ceiling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=150, help="context tokens per request (±20%%)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per figure (median)")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--no-engine", action="store_true", help="skip the LLMEngine figure")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if min(args.batch, args.context, args.threads, args.repeat) < 1:
        parser.error("--batch, --context, --threads and --repeat must be >= 1")

    import torch

    from executor.model_loader import load_model
    from executor.models.linear import packed_copies

    torch.set_num_threads(args.threads)
    files = resolve_model(args.model)
    loaded = load_model(files.path, dtype=args.dtype, max_model_len=None, attention_backend="torch", device="cpu")
    num_packed = sum(1 for m in loaded.model.modules() if any(c is not None for c in packed_copies(m).values()))
    num_linear = sum(1 for m in loaded.model.modules() if hasattr(m, "packed_weight"))
    print(f"{files.model_id}  {loaded.dtype}  batch {args.batch}  context ~{args.context}  threads {args.threads}  "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})  "
          f"packed GEMM on {num_packed}/{num_linear} linear layers")
    plain, own = matmul_only(loaded.model, args.batch, args.repeat)
    print(f"matmul-only, F.linear       {plain.ms:9.1f} ms/step  {plain.tokens_per_s:8.1f} tokens/s")
    print(f"matmul-only, model's kernel {own.ms:9.1f} ms/step  {own.tokens_per_s:8.1f} tokens/s")
    fwd, fwd_plain = forward(loaded, args.batch, args.context, args.repeat)
    print(f"forward + logits, F.linear  {fwd_plain.ms:9.1f} ms/step  {fwd_plain.tokens_per_s:8.1f} tokens/s")
    print(f"forward + logits            {fwd.ms:9.1f} ms/step  {fwd.tokens_per_s:8.1f} tokens/s  "
          f"({100 * own.ms / fwd.ms:.0f}% of it in matmuls)")
    del loaded
    eng = None
    if not args.no_engine:
        eng = engine(args.dtype, args.batch, args.context, args.threads, args.repeat)
        print(f"engine decode step          {eng.ms:9.1f} ms/step  {eng.tokens_per_s:8.1f} tokens/s")
    if args.json:
        report = {"model": files.model_id, "dtype": args.dtype, "batch": args.batch, "context": args.context,
                  "threads": args.threads, "torch": torch.__version__, "num_packed_linear": num_packed,
                  "matmul_only_f_linear": asdict(plain), "matmul_only_model_kernel": asdict(own),
                  "forward": asdict(fwd), "forward_f_linear": asdict(fwd_plain),
                  "engine": asdict(eng) if eng else None}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
