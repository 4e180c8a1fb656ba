"""The kvstore-sharing benchmark: what a prefix shared through a kvstore saves, and how fast blocks move.

``python -m meshserve.bench.kvstore_sharing [--prefix-len 1500] [--rounds 3] [--report-json bench-kvstore.json]``

1. **Throughput**: ``--blocks`` blocks of the default model's real layout
   (float32: 720 KiB each) are Put in streams of ``--blocks-per-stream``, then
   Get back, over loopback to a kvstore in its own process
   (``meshserve kvstore``); MB/s = payload bytes / wall seconds (10^6 bytes).
2. **TTFT**: engine A computes a seeded, real-looking prompt of
   ``--prefix-len`` tokens plus a unique user part and publishes its blocks;
   engine B (same model, its own KV cache, local prefix cache emptied) then runs
   the same prompt twice: with its kvstore connector (the prefix is fetched) and
   without (recomputed), in alternating order per round. TTFT is add_request →
   first token on B, ``--num-threads`` torch threads. The outputs of the two runs
   are checked equal, token for token.

Prints a table and writes a JSON report. Not a test: it asserts only that the
outputs match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from meshserve.bench.shared_prefix import text_token_ids
from meshserve.block_hash import KVLayout, KVStoreFingerprint, ModelFingerprint
from meshserve.cli.ports import free_port
from meshserve.grpc_server import wait_serving
from meshserve.kvstore_client import KVStoreClient
from meshserve.model_files import resolve_model
from meshserve.sampling import SamplingParams


def _start_kvstore(memory: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "meshserve.cli", "kvstore", "--port", str(port), "--memory", memory,
                             "--log-level", "warning"])
    address = f"127.0.0.1:{port}"
    asyncio.run(wait_serving(address, 60))
    return proc, address


async def _throughput(address: str, fp, num_blocks: int, per_stream: int) -> dict:
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, fp.block_bytes, dtype=np.uint8).tobytes()
    hashes = list(range(1, num_blocks + 1))
    client = KVStoreClient(address)
    try:
        start = time.perf_counter()
        for i in range(0, num_blocks, per_stream):
            await client.put(fp, [(h, payload) for h in hashes[i:i + per_stream]])
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        received = 0
        for i in range(0, num_blocks, per_stream):
            result = await client.get(fp, hashes[i:i + per_stream])
            received += sum(len(p) for p in result.payloads)
        get_s = time.perf_counter() - start
    finally:
        await client.close()
    total = num_blocks * fp.block_bytes
    assert received == total, f"got {received} of {total} bytes back"
    return {"blocks": num_blocks, "block_bytes": fp.block_bytes, "blocks_per_stream": per_stream,
            "put_s": put_s, "get_s": get_s, "put_mb_s": total / put_s / 1e6, "get_mb_s": total / get_s / 1e6}


def _ttft(engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """Runs one greedy request alone: (seconds to the first token, tokens, kvstore tokens)."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, tokens, from_store = None, [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if engine.last_step_was_empty:
            time.sleep(0.0005)
        for out in outs:
            if ttft is None:
                ttft, from_store = time.perf_counter() - start, out.num_kvstore_tokens
            tokens += out.new_token_ids
    return ttft, tokens, from_store


def _ttft_rounds(address: str, args) -> dict:
    from transformers import AutoTokenizer

    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from executor.kvstore_connector import KVStoreConnector

    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.num_threads,
                          cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=512 << 20),
                          batch=BatchSchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens))
    a, b = LLMEngine(config), LLMEngine(config)
    conn_a = KVStoreConnector(address, a.kv_store_fingerprint)
    conn_b = KVStoreConnector(address, b.kv_store_fingerprint)
    a.set_kv_connector(conn_a)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).path)
    rng = np.random.default_rng(args.seed)
    prefix = text_token_ids(rng, tokenizer, args.prefix_len, "System: ")
    _ttft(b, "warmup", prefix[:64], 2)  # first-call costs out of the measurements
    rounds = []
    try:
        for r in range(args.rounds):
            prompt = prefix + text_token_ids(rng, tokenizer, args.user_len, "\nUser: ")
            _ttft(a, f"a-{r}", prompt, args.max_tokens)
            conn_a.flush()
            runs = {}
            for mode in (("fetch", "recompute") if r % 2 == 0 else ("recompute", "fetch")):
                b.reset_prefix_cache()
                b.set_kv_connector(conn_b if mode == "fetch" else None)
                runs[mode] = _ttft(b, f"b-{mode}-{r}", prompt, args.max_tokens)
            b.set_kv_connector(None)
            (t_fetch, out_fetch, n_fetch), (t_re, out_re, _) = runs["fetch"], runs["recompute"]
            assert out_fetch == out_re, f"round {r}: fetched-prefix output differs from the recompute"
            rounds.append({"prompt_tokens": len(prompt), "kvstore_tokens": n_fetch, "ttft_fetch_s": t_fetch,
                           "ttft_recompute_s": t_re, "ratio": t_fetch / t_re})
    finally:
        conn_a.close()
        conn_b.close()
    k = conn_b.stats()
    fetch = statistics.median(x["ttft_fetch_s"] for x in rounds)
    recompute = statistics.median(x["ttft_recompute_s"] for x in rounds)
    return {"rounds": rounds, "ttft_fetch_p50_s": fetch, "ttft_recompute_p50_s": recompute,
            "ttft_ratio_p50": fetch / recompute, "kvstore_tokens": rounds[-1]["kvstore_tokens"],
            "fetch_mean_s": k.fetch_seconds / max(1, k.fetches), "fetched_bytes": k.bytes_in,
            "block_bytes": a.kv_store_fingerprint.block_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.bench.kvstore_sharing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-len", type=int, default=1500, help="shared prefix tokens")
    parser.add_argument("--user-len", type=int, default=24, help="unique tokens after the prefix")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved by the throughput test")
    parser.add_argument("--blocks-per-stream", type=int, default=16)
    parser.add_argument("--kvstore-memory", default="2GiB")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--report-json", default="bench-kvstore.json")
    args = parser.parse_args(argv)
    proc, address = _start_kvstore(args.kvstore_memory)
    try:
        # SmolLM2-135M's layout: 30 layers, 3 KV heads of 64 channels
        fp = KVStoreFingerprint(ModelFingerprint("bench", "0"), KVLayout(args.block_size, 30, 3, 64, args.dtype))
        report = {"throughput": asyncio.run(_throughput(address, fp, args.blocks, args.blocks_per_stream))}
        if not args.skip_ttft:
            report["ttft"] = _ttft_rounds(address, args)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report["settings"] = vars(args) | {"cpu_count": os.cpu_count()}
    t = report["throughput"]
    print(f"loopback Put {t['put_mb_s']:8.1f} MB/s   Get {t['get_mb_s']:8.1f} MB/s   "
          f"({t['blocks']} blocks of {t['block_bytes']} bytes, {t['blocks_per_stream']} per stream)")
    if "ttft" in report:
        x = report["ttft"]
        for i, r in enumerate(x["rounds"]):
            print(f"round {i}: prompt {r['prompt_tokens']} tokens, {r['kvstore_tokens']} from the kvstore: "
                  f"TTFT fetch {r['ttft_fetch_s'] * 1e3:7.1f} ms, recompute {r['ttft_recompute_s'] * 1e3:7.1f} ms, "
                  f"ratio {r['ratio']:.3f}")
        print(f"TTFT p50: fetch {x['ttft_fetch_p50_s'] * 1e3:.1f} ms / recompute {x['ttft_recompute_p50_s'] * 1e3:.1f}"
              f" ms = {x['ttft_ratio_p50']:.3f}x   (mean fetch {x['fetch_mean_s'] * 1e3:.1f} ms)")
    with open(args.report_json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"report: {args.report_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
