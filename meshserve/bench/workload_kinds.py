"""The benchmark's workload kinds by name (``WorkloadSpec.kind``): the measured workload
and its warm-up for a model folder.

``synthetic`` is ``meshserve.bench.workload``'s own; the kinds that tokenize text
are plug-ins: ``shared-prefix``, ``multi-turn`` and ``jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from meshserve.bench.jsonl_workload import load_jsonl_workload
from meshserve.bench.multi_turn import make_multi_turn_workload
from meshserve.bench.shared_prefix import make_shared_prefix_workload
from meshserve.bench.workload import Workload, WorkloadSpec, make_warmup, make_workload, model_vocabulary

TOKENIZED_KINDS = {
    "shared-prefix": make_shared_prefix_workload,
    "multi-turn": make_multi_turn_workload,
    "jsonl": load_jsonl_workload,
}
"""Kind → ``maker(spec, tokenizer, vocab_size) -> Workload``."""


def load_workloads(spec: WorkloadSpec, num_warmup: int, model_path: str | Path) -> tuple[Workload, Workload | None]:
    """The measured workload of ``spec`` (its kind) and the synthetic warm-up for a model folder.

    Warm-up prompts are uniform ids of their own stream, so they never share a
    prefix with the measured requests: the prefix cache starts cold.

    Raises:
        WorkloadFileError: jsonl: the file is missing or a line is invalid.
    """
    vocab_size, specials = model_vocabulary(model_path)
    if spec.kind in TOKENIZED_KINDS:
        from transformers import AutoTokenizer  # heavy: only when a benchmark runs

        workload = TOKENIZED_KINDS[spec.kind](spec, AutoTokenizer.from_pretrained(model_path), vocab_size)
    else:
        workload = make_workload(spec, vocab_size, specials)
    return workload, make_warmup(spec, num_warmup, vocab_size, specials)
