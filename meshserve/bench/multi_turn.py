"""The multi-turn workload: conversations whose every turn resends the whole history.

A chat client sends, at turn ``k + 1``, everything said so far: turn ``k``'s
prompt, the answer it got, then the new user message. So the prompt of turn
``k + 1`` starts with the exact ids of turn ``k``'s prompt, which a prefix cache
can reuse, and grows turn after turn. With ``N = spec.num_requests`` and
``T = spec.num_turns``:

* ``C = ceil(N / T)`` conversations; requests are ordered turn-major (every
  conversation's turn 0, then every turn 1…) and cut to ``N``, so the last turn of
  some conversations may be missing;
* user messages are real-looking English of log-normal length
  (``spec.prompt_len_median``, ``shared_prefix.text_token_ids``), each after the
  ids of ``"\nUser: "``; turn 0's prompt is its user message alone;
* each turn's output length is log-normal (``spec.output_len_median``), and the
  answer written into the next turn's prompt (after the ids of
  ``"\nAssistant: "``) is a seeded English stand-in of exactly that many tokens,
  not the model's real answer: every target gets the
  identical requests, whatever it generates. A prefix cache therefore reuses the
  previous prompt's blocks, never the previous answer's;
* turn ``k + 1`` names turn ``k`` as its ``parent_id``: the loops send it only
  once turn ``k`` has finished, as a user waits for the answer.

Request ids are ``bench-{conversation}-{turn}``. ``numpy.random.default_rng(seed)``
draws, in this order: the user lengths (``C * T``, conversation-major), the output
lengths (same order), then the words of each conversation, turn by turn (user
message, then answer).
"""

from __future__ import annotations

import math

import numpy as np

from meshserve.bench.shared_prefix import text_token_ids
from meshserve.bench.workload import BenchRequest, Workload, WorkloadSpec, _lengths

USER_OPENER = "\nUser: "
ASSISTANT_OPENER = "\nAssistant: "


def make_multi_turn_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> Workload:
    """The multi-turn workload of ``spec`` (see the module doc).

    Args:
        spec: ``num_requests``, ``num_turns``, seed and length distributions.
        tokenizer: the model's ``transformers`` tokenizer.
        vocab_size: every id must be below it (the model's embedding rows).

    Returns:
        ``spec.num_requests`` requests, turn-major; a turn after the first has the
        previous turn of its conversation as ``parent_id``.

    Raises:
        ValueError: the tokenizer produced an id outside ``[0, vocab_size)``.
    """
    rng = np.random.default_rng(spec.seed)
    turns = spec.num_turns
    conversations = math.ceil(spec.num_requests / turns)
    user_lens = _lengths(rng, conversations * turns, spec.prompt_len_median, spec.sigma, spec.prompt_len_range)
    output_lens = _lengths(rng, conversations * turns, spec.output_len_median, spec.sigma, spec.output_len_range)
    user_opener = tokenizer.encode(USER_OPENER, add_special_tokens=False)
    assistant_opener = tokenizer.encode(ASSISTANT_OPENER, add_special_tokens=False)
    by_turn: list[list[BenchRequest]] = [[] for _ in range(turns)]
    for c in range(conversations):
        history: list[int] = []
        for t in range(turns):
            k = c * turns + t
            history += user_opener + text_token_ids(rng, tokenizer, int(user_lens[k]))
            if max(history) >= vocab_size:
                raise ValueError(f"the tokenizer produced id {max(history)}, outside the model's vocabulary "
                                 f"of {vocab_size}")
            parent = f"bench-{c}-{t - 1}" if t else None
            by_turn[t].append(BenchRequest(f"bench-{c}-{t}", tuple(history), int(output_lens[k]), parent_id=parent))
            history += assistant_opener + text_token_ids(rng, tokenizer, int(output_lens[k]))
    requests = [r for turn in by_turn for r in turn][: spec.num_requests]
    return Workload(spec, tuple(requests))
