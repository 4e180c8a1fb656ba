"""The per-rank step log's reader: it waits for ranks that log a step after rank 0."""

import threading
import time

from meshserve.sampling import SamplingParams
from executor.engine.scheduler_output import ScheduledRequest
from executor.worker.step_log import StepLog, read_step_logs


def _scheduled(request_id: str, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, token_ids=[7] * num_tokens, num_computed_tokens=0,
                            block_ids=[0], sampling_params=SamplingParams(), sample=True)


def test_the_reader_waits_until_every_rank_has_logged_the_step_rank_0_logged(tmp_path):
    """Rank 1 writes its line for step 2 after rank 0 has returned it (as a TP peer does
    after the collective): a single read misses it; the default read waits for it."""
    rank0, rank1 = StepLog(tmp_path, 0, 0), StepLog(tmp_path, 1, 0)
    for log in (rank0, rank1):
        log.record(1, [[_scheduled("a", 5)]])
    rank0.record(2, [[_scheduled("a", 1)]])
    assert [r["step"] for r in read_step_logs(tmp_path, timeout_s=0)[1]] == [1]

    late = threading.Timer(0.2, rank1.record, args=(2, [[_scheduled("a", 1)]]))
    late.start()
    logs = read_step_logs(tmp_path, timeout_s=10.0)
    late.join()
    assert {rank: [(r["step"], r["micro_batches"]) for r in records] for rank, records in logs.items()} == {
        0: [(1, [[["a", 5]]]), (2, [[["a", 1]]])], 1: [(1, [[["a", 5]]]), (2, [[["a", 1]]])]}


def test_the_reader_skips_a_half_written_line_and_returns_at_the_timeout(tmp_path):
    """A line without its newline is one a rank is still writing: not parsed. A rank that
    never logs the step shows as the shorter list once ``timeout_s`` has passed."""
    StepLog(tmp_path, 0, 0).record(3, [[_scheduled("b", 2)]])
    (tmp_path / "rank-1.jsonl").write_text('{"rank": 1, "stage": 0, "st', encoding="utf-8")
    start = time.monotonic()
    logs = read_step_logs(tmp_path, timeout_s=0.3)
    assert time.monotonic() - start >= 0.3
    assert logs == {0: [{"rank": 0, "stage": 0, "step": 3, "micro_batches": [[["b", 2]]]}], 1: []}
