"""``python -m meshserve.bench.step_profile --dtype float32 --batch 32 --threads 1 [--json FILE] [--trace DIR]``:
where one engine step spends its time, by part (CPU).

It builds an ``LLMEngine`` with ``--batch`` requests of about ``--context``
prompt tokens (spread ±20%, greedy, ``ignore_eos``), runs their prefills, then
profiles with ``torch.profiler`` (record_shapes off, no stacks):

* **decode**: ``--steps`` steps where every request decodes one token;
* **mixed**: ``--steps`` steps where ``batch - 1`` requests decode and one new
  request's ``--prefill``-token prompt is prefilled in the same step (a fresh
  request is added before each such step and the oldest one aborted, so the
  batch stays at ``batch``).

Each step's wall time is split into parts, by the region an op runs in (the
ModelRunner's calls are wrapped in ``record_function`` ranges here, not in the
serving code) and, inside the model, by the op:

* ``gemm``: the linear layers and the LM head (the CPU GEMM kernels' calls,
  ``cpu_gemm.panel_linear`` and ``panel_linear_bf16``, and ``mkldnn::_linear_pointwise``,
  ``aten::mm``/``addmm``/``linear``);
* ``attention``: the KV cache writes, block gathers and SDPA inside the model,
  the CPU decode and prefill kernels' calls (``cpu_kernel.decode_attention``,
  ``cpu_prefill_kernel.prefill_attention``: C code the profiler sees as one range
  each), plus the backend's per-step ``plan``;
* ``norm/elementwise``: everything else inside the model (RMSNorm, rotary,
  SiLU·mul, residual adds, embedding, copies), the fused kernels' calls among them
  (``cpu_fused.add_rms_norm``, ``rotate_``, ``silu_mul``);
* ``decoder stack``: the decoder layers run in one C call (``cpu_decoder_stack``, on
  decode-kernel steps): the same GEMM, attention and fused kernels as the parts above,
  not told apart inside it (``MESHSERVE_CPU_DECODER_STACK=0`` profiles the eager layers);
* ``metadata``: the ModelRunner's input building (``_prepare_inputs``: token ids,
  positions, slot mapping, block tables);
* ``sampling``: building the sampling batch and the sampler;
* ``scheduling``: the engine's ``BatchScheduler.schedule`` and
  ``update_from_output`` (which requests run, blocks, outputs, stop checks);
* ``model python``: the model's forward pass minus its ops' own time (the
  interpreter between ops, module calls);
* ``python``: the rest of the step's wall time (the ModelRunner's glue, the
  worker, the engine's step).

The op times are the profiler's self CPU times, which add its own overhead
(about 1-2 µs an op); the step's wall time is measured with the profiler on, so
the parts sum to it. Medians of ``--steps`` steps. The step's thread CPU time
is printed too: on a shared machine, wall time over CPU time says how much other
processes stretched the step (the parts' shares stay comparable; their
milliseconds do not). ``--trace DIR`` also writes
Chrome traces (open in ``chrome://tracing`` or Perfetto).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

from meshserve.sampling import SamplingParams

PARTS = ("gemm", "attention", "norm/elementwise", "decoder stack", "model python", "metadata", "sampling",
         "scheduling", "python")
_GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
_ATTN_OPS = ("aten::index_copy_", "aten::index_select", "aten::scaled_dot_product_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")
_REGIONS = {"ms.prepare_inputs": "metadata", "ms.plan": "attention", "ms.model": "model",
            "ms.logits": "model", "ms.sampling": "sampling", "ms.schedule": "scheduling",
            "ms.attention_kernel": "attention", "ms.gemm_kernel": "gemm",
            "ms.fused_kernel": "norm/elementwise", "ms.decoder_stack": "decoder stack"}


def _wrap(obj, name: str, label: str):
    """Wraps ``obj.name`` (a bound method) in a ``record_function(label)`` range."""
    import torch

    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return original(*args, **kwargs)

    setattr(obj, name, wrapped)


KERNEL_CALLS = (
    ("executor.attention.cpu_kernel", "decode_attention", "ms.attention_kernel"),
    ("executor.attention.cpu_prefill_kernel", "prefill_attention", "ms.attention_kernel"),
    ("executor.models.cpu_gemm", "panel_linear", "ms.gemm_kernel"),
    ("executor.models.cpu_gemm", "panel_linear_bf16", "ms.gemm_kernel"),
    ("executor.models.cpu_fused", "add_rms_norm", "ms.fused_kernel"),
    ("executor.models.cpu_fused", "rotate_", "ms.fused_kernel"),
    ("executor.models.cpu_fused", "silu_mul", "ms.fused_kernel"),
    ("executor.models.cpu_decoder_stack", "DecoderStack.run", "ms.decoder_stack"),
)
"""The C kernels' Python entry points (module, attribute, range): the profiler sees no aten op inside a
C call, so each is wrapped in the range of its part. The decoder stack runs every layer of a
decode-kernel step in one call: its GEMM, attention and fused kernels are not told apart."""


def kernel_entry_points() -> list[tuple[object, str, str]]:
    """``(owner, function name, range)`` of each of ``KERNEL_CALLS`` that this tree has
    (profiling an older version: some are missing)."""
    import importlib

    found = []
    for module_name, attribute, label in KERNEL_CALLS:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, name):
            found.append((owner, name, label))
    return found


def instrument_kernels() -> None:
    """Wraps each kernel entry point this tree has in the profiler range of its part."""
    for owner, name, label in kernel_entry_points():
        _wrap(owner, name, label)


def instrument(engine) -> None:
    """Wraps the in-process worker's ModelRunner calls in named profiler ranges."""
    _wrap(engine.batch_scheduler, "schedule", "ms.schedule")
    _wrap(engine.batch_scheduler, "update_from_output", "ms.schedule")
    runner = engine.worker_group.worker.model_runner
    _wrap(runner, "_prepare_inputs", "ms.prepare_inputs")
    _wrap(runner.attention_backend, "plan", "ms.plan")
    _wrap(runner.model, "forward", "ms.model")
    _wrap(runner.model, "compute_logits", "ms.logits")
    _wrap(runner, "sampler", "ms.sampling")
    instrument_kernels()
    import executor.worker.model_runner as mr

    build = mr.SamplingBatch.build

    class _Batch:
        @staticmethod
        def build(*args, **kwargs):
            import torch

            with torch.profiler.record_function("ms.sampling"):
                return build(*args, **kwargs)

    mr.SamplingBatch = _Batch


def _region_of(event) -> str | None:
    node = event
    while node is not None:
        if node.name in _REGIONS:
            return node.name
        node = node.cpu_parent
    return None


def _inside(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def breakdown(events, wall_us: float) -> dict[str, float]:
    """Microseconds per part of one profiled step (``events``: ``prof.events()``)."""
    parts: dict[str, float] = defaultdict(float)
    region_total: dict[str, float] = defaultdict(float)
    region_ops: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.name in _REGIONS:
            if not _inside(ev.cpu_parent, ev.name):  # outermost range of its name
                region_total[ev.name] += ev.cpu_time_total
            continue
        region = _region_of(ev)
        if region is None:
            continue
        self_us = ev.self_cpu_time_total
        region_ops[region] += self_us
        kind = _REGIONS[region]
        if kind == "model":
            if ev.name in _GEMM_OPS:
                parts["gemm"] += self_us
            elif ev.name in _ATTN_OPS:
                parts["attention"] += self_us
            else:
                parts["norm/elementwise"] += self_us
        else:
            parts[kind] += self_us
    model_total = (region_total["ms.model"] + region_total["ms.logits"] - region_total["ms.attention_kernel"]
                   - region_total["ms.gemm_kernel"] - region_total["ms.fused_kernel"]
                   - region_total["ms.decoder_stack"])
    parts["model python"] = max(0.0, model_total - region_ops["ms.model"] - region_ops["ms.logits"])
    for name in ("ms.prepare_inputs", "ms.plan", "ms.sampling", "ms.schedule", "ms.attention_kernel",
                 "ms.gemm_kernel", "ms.fused_kernel", "ms.decoder_stack"):  # their Python (and C) counts with them
        parts[_REGIONS[name]] += max(0.0, region_total[name] - region_ops[name])
    parts["python"] = max(0.0, wall_us - sum(parts.values()))
    return dict(parts)


@contextmanager
def _profiled(trace: str | None, label: str, index: int):
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield prof
    if trace:
        prof.export_chrome_trace(f"{trace}/{label}-{index}.json")


def run(dtype: str, batch: int, context: int, prefill: int, threads: int, steps: int, model: str,
        trace: str | None) -> dict:
    """Profiles ``steps`` decode steps and ``steps`` mixed steps; returns the medians."""
    import torch

    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine

    lo, hi = max(1, int(context * 0.8)), max(1, int(context * 1.2))
    contexts = [lo + (hi - lo) * i // max(1, batch - 1) for i in range(batch)]
    total = steps * 2 + 8
    blocks = sum(-(-(c + total) // 16) for c in contexts) + (steps + 2) * (-(-(prefill + total) // 16)) + 16
    config = EngineConfig(model=model, dtype=dtype, num_threads=threads, cache=CacheConfig(num_blocks=blocks),
                          batch=BatchSchedulerConfig(max_num_seqs=batch,
                                                     max_num_batched_tokens=max(2048, max(contexts), prefill + batch)))
    engine = LLMEngine(config)
    instrument(engine)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=min(1024, engine.max_model_len - max(contexts + [prefill])), temperature=0.0,
                            ignore_eos=True)
    ids = [f"r{i}" for i in range(batch)]
    for rid, c in zip(ids, contexts):
        engine.add_request(rid, torch.randint(10, engine.vocab_size, (c,), generator=gen).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step())
    for _ in range(2):  # warm-up decodes
        engine.step()

    def profile_steps(label: str, before=None) -> list[dict]:
        results = []
        for i in range(steps):
            if before:
                before(i)
            with _profiled(trace, label, i) as prof:
                start, cpu_start = time.perf_counter(), time.thread_time()
                outputs = engine.step()
                wall_us = (time.perf_counter() - start) * 1e6
                cpu_us = (time.thread_time() - cpu_start) * 1e6
            results.append({"wall": wall_us, "cpu": cpu_us, "tokens": len(outputs),
                            **breakdown(prof.events(), wall_us)})
        return results

    decode = profile_steps("decode")

    def swap(i: int) -> None:
        engine.abort_request(ids.pop(0))
        rid = f"p{i}"
        ids.append(rid)
        engine.add_request(rid, torch.randint(10, engine.vocab_size, (prefill,), generator=gen).tolist(), params)

    mixed = profile_steps("mixed", swap)
    engine.shutdown()

    def summary(rows: list[dict]) -> dict:
        out = {"wall_ms": round(statistics.median(r["wall"] for r in rows) / 1e3, 3),
               "thread_cpu_ms": round(statistics.median(r["cpu"] for r in rows) / 1e3, 3)}
        for part in PARTS:
            out[part + "_ms"] = round(statistics.median(r.get(part, 0.0) for r in rows) / 1e3, 3)
        return out

    return {"dtype": dtype, "batch": batch, "context": context, "prefill": prefill, "threads": threads,
            "steps": steps, "torch": torch.__version__,
            "decode": summary(decode), "mixed": summary(mixed)}


def print_report(report: dict) -> None:
    print(f"{report['dtype']}  batch {report['batch']}  context ~{report['context']}  prefill {report['prefill']}  "
          f"threads {report['threads']}  torch {report['torch']}  "
          f"(medians of {report['steps']} steps, ms)")
    print(f"{'part':18s} {'decode':>9s} {'%':>5s} {'mixed':>9s} {'%':>5s}")
    for part in PARTS:
        d, m = report["decode"][part + "_ms"], report["mixed"][part + "_ms"]
        print(f"{part:18s} {d:9.2f} {100 * d / report['decode']['wall_ms']:5.1f} "
              f"{m:9.2f} {100 * m / report['mixed']['wall_ms']:5.1f}")
    print(f"{'step wall':18s} {report['decode']['wall_ms']:9.2f} {'':5s} {report['mixed']['wall_ms']:9.2f}")
    print(f"{'step thread CPU':18s} {report['decode']['thread_cpu_ms']:9.2f} {'':5s} "
          f"{report['mixed']['thread_cpu_ms']:9.2f}  (wall over CPU: how much other load stretched the step)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.step_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--batch", type=int, default=32, help="requests in the batch")
    parser.add_argument("--context", type=int, default=150, help="prompt tokens per request (±20%%)")
    parser.add_argument("--prefill", type=int, default=150, help="prompt tokens of the mixed step's new request")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--steps", type=int, default=8, help="profiled steps of each kind (median)")
    parser.add_argument("--model", default="default", help="model, as resolve_model takes it")
    parser.add_argument("--json", help="also write the medians to this JSON file")
    parser.add_argument("--trace", help="write a Chrome trace of every profiled step into this folder")
    args = parser.parse_args(argv)
    if min(args.batch, args.context, args.prefill, args.threads, args.steps) < 1:
        parser.error("--batch, --context, --prefill, --threads and --steps must be >= 1")
    report = run(args.dtype, args.batch, args.context, args.prefill, args.threads, args.steps, args.model,
                 args.trace)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
