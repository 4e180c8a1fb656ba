"""The jsonl workload: the requests of a file, one JSON object a line.

Each non-blank line is one request::

    {"prompt": "Explain paged attention.", "max_tokens": 64}
    {"prompt_token_ids": [504, 3, 1712], "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 1,
     "ignore_eos": false}

* exactly one of ``prompt`` (text, tokenized with the model's tokenizer, no
  special tokens, no chat template) and ``prompt_token_ids`` (ids below the
  model's vocabulary size);
* ``max_tokens`` (an integer >= 1): the output length;
* optional sampling fields: ``temperature`` (>= 0), ``top_p`` (in (0, 1]),
  ``top_k`` (>= 0), ``min_p`` (in [0, 1]), ``seed`` (an integer) and ``ignore_eos``
  (default true: exactly ``max_tokens`` tokens; false: the request may stop at EOS).

Any other field, a malformed line or a wrong type is a ``WorkloadFileError``
naming the file and the line number. ``spec.num_requests`` takes the first
requests of the file, which must hold at least that many. Request ids are
``bench-{i}`` in file order.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshserve.bench.workload import BenchRequest, Sampling, Workload, WorkloadSpec

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
FIELDS = ("prompt", "prompt_token_ids", "max_tokens", "ignore_eos", *SAMPLING_FIELDS)


class WorkloadFileError(ValueError):
    """A workload file that cannot be read or holds an invalid line (the message names both)."""


def _int(value, name: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"{name} must be an integer{f' >= {low}' if low is not None else ''}, got {value!r}")
    return value


def _number(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (low < value if low_open else low <= value) or not value <= high:
        raise ValueError(f"{name} must lie in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _prompt_ids(obj: dict, tokenizer, vocab_size: int) -> tuple[int, ...]:
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise ValueError("give exactly one of 'prompt' (text) and 'prompt_token_ids'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"'prompt' must be a non-empty string, got {obj['prompt']!r}")
        ids = tokenizer.encode(obj["prompt"], add_special_tokens=False)
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise ValueError("'prompt_token_ids' must be a non-empty list of integers")
        for i in ids:
            _int(i, "every prompt token id", 0)
    if max(ids) >= vocab_size:
        raise ValueError(f"prompt token id {max(ids)} is outside the model's vocabulary of {vocab_size}")
    return tuple(ids)


def parse_request(line: str, index: int, tokenizer, vocab_size: int) -> BenchRequest:
    """The request ``bench-{index}`` of one line.

    Raises:
        ValueError: the line is not a JSON object of the fields above, with valid values.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(FIELDS)})")
    if "max_tokens" not in obj:
        raise ValueError("'max_tokens' is required")
    max_tokens = _int(obj["max_tokens"], "max_tokens", 1)
    ignore_eos = obj.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be true or false, got {ignore_eos!r}")
    sampling = Sampling(
        temperature=_number(obj.get("temperature", 0.0), "temperature", 0.0, float("inf")),
        top_p=_number(obj.get("top_p", 1.0), "top_p", 0.0, 1.0, low_open=True),
        top_k=_int(obj.get("top_k", 0), "top_k", 0), min_p=_number(obj.get("min_p", 0.0), "min_p", 0.0, 1.0),
        seed=None if obj.get("seed") is None else _int(obj["seed"], "seed"))
    return BenchRequest(f"bench-{index}", _prompt_ids(obj, tokenizer, vocab_size), max_tokens, sampling, ignore_eos)


def count_requests(path: str | Path) -> int:
    """Non-blank lines of the workload file ``path`` (the default ``--num-requests`` of jsonl).

    Raises:
        WorkloadFileError: the file cannot be read.
    """
    return sum(1 for line in _read_lines(Path(path)) if line.strip())


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadFileError(f"cannot read the workload file {path}: {exc.strerror}") from None


def load_jsonl_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> Workload:
    """The first ``spec.num_requests`` requests of ``spec.workload_file`` (blank lines skipped).

    Raises:
        WorkloadFileError: the file cannot be read, a line is invalid (``F:LINE: why``),
            or the file holds fewer requests than ``spec.num_requests``.
    """
    path = Path(spec.workload_file)
    lines = _read_lines(path)
    requests: list[BenchRequest] = []
    for number, line in enumerate(lines, start=1):
        if len(requests) == spec.num_requests:
            break
        if not line.strip():
            continue
        try:
            requests.append(parse_request(line, len(requests), tokenizer, vocab_size))
        except ValueError as exc:
            raise WorkloadFileError(f"{path}:{number}: {exc}") from None
    if len(requests) < spec.num_requests:
        raise WorkloadFileError(f"{path} holds {len(requests)} request(s); --num-requests asks for "
                                f"{spec.num_requests}")
    return Workload(spec, tuple(requests))
