"""The worker seam: every step's ``SchedulerOutput`` is plain data that survives a
pickle round trip (what a worker in another process would receive), and a second
worker executing the unpickled copies gives exactly the tokens, logprobs and saved
KV blocks of the engine's own worker, blocks loaded from a kvstore included."""

from __future__ import annotations

import pickle
import threading

import pytest

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from executor.kvstore_connector import KVStoreConnector
from executor.worker.group import InProcessWorkerGroup
from kvstore.store import KVStore
from meshserve.sampling import SamplingParams
from tests.support.served_kvstore import ServedKVStore

pytestmark = pytest.mark.model

CONFIG = EngineConfig(dtype="float32", max_model_len=1024, cache=CacheConfig(block_size=16, num_blocks=64),
                      batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(max_tokens=6, temperature=1.0, top_k=20, repetition_penalty=1.2, ignore_eos=True),
]


def run_in_lockstep(engine: LLMEngine, twin: InProcessWorkerGroup, fetched: threading.Event) -> dict:
    """Steps ``engine`` by hand until idle; each step also runs, unpickled, on ``twin``.

    Returns:
        Counts of what the steps carried: steps, loaded blocks, saved blocks.
    """
    counts = {"steps": 0, "loads": 0, "saves": 0}
    while engine.has_unfinished_requests():
        step = engine.batch_scheduler.schedule()
        if step.is_empty:
            assert fetched.wait(60), "the kvstore fetch did not finish"
            fetched.clear()
            continue
        wire = pickle.dumps(step)
        assert b"torch" not in wire and b"executor.engine.request" not in wire  # no tensor, no Request
        copy = pickle.loads(wire)
        assert copy == step
        out = engine.worker_group.execute_model(step)
        assert twin.execute_model(copy) == out
        assert pickle.loads(pickle.dumps(out)) == out
        engine.batch_scheduler.update_from_output(step, out)
        counts["steps"] += 1
        counts["loads"] += len(step.kv_loads)
        counts["saves"] += len(out.kv_saved)
    return counts


def test_a_pickled_step_runs_the_same_on_another_worker(tokenizer):
    engine = LLMEngine(CONFIG)
    twin = InProcessWorkerGroup(CONFIG)
    twin.initialize_cache(engine.num_blocks, engine.block_size)
    served = ServedKVStore(KVStore(memory_bytes=64 << 20))
    connector = KVStoreConnector(served.address, engine.kv_store_fingerprint, fetch_timeout_s=120)
    fetched = threading.Event()
    connector.set_waker(fetched.set)
    engine.set_kv_connector(connector)
    prompts = [tokenizer(f"Story {i}: the lighthouse keeper counted ships until dawn, " * (i + 2)).input_ids
               for i in range(3)]
    try:
        for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
            engine.add_request(f"cold-{i}", prompt, params)
        cold = run_in_lockstep(engine, twin, fetched)
        connector.flush()
        assert engine.reset_prefix_cache()
        engine.add_request("warm", prompts[2], PARAMS[2])   # fetched back from the store: loads travel too
        warm = run_in_lockstep(engine, twin, fetched)
        assert cold["saves"] > 0 and warm["loads"] == (len(prompts[2]) - 1) // 16
        engine.check_integrity()
    finally:
        engine.set_kv_connector(None)
        connector.close()
        served.stop()
        twin.shutdown()
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        twin.execute_model(engine.batch_scheduler.schedule())
