"""The shared-prefix workload: most prompts start with one long system prompt.

Served chat traffic repeats its system prompt in front of every user message;
this workload measures what a prefix cache saves there. With ``N`` requests,
``P = spec.shared_prefix_len`` and each request's user length ``u`` (log-normal,
``spec.prompt_len_median``):

* ``round(spec.shared_fraction * N)`` requests, picked at random, are the system
  prompt's exact ``P`` token ids followed by a unique user part of ``u`` tokens
  (a newline, then its own sentences);
* the others are a unique text of ``P + u`` tokens (same length distribution).

Text is real-looking English from a small seeded grammar, tokenized with the
model's own tokenizer (no special tokens, no chat template) and cut to the exact
token count. Prompts are concatenated token ids, never re-tokenized text, so the
shared requests hold identical prefix ids: what a prefix cache keys on.

``numpy.random.default_rng(seed)`` draws, in this order: the user lengths, the
output lengths, the permutation that picks the shared requests, the system
prompt's words, then each request's words in request order.
"""

from __future__ import annotations

import numpy as np

from meshserve.bench.workload import BenchRequest, Workload, WorkloadSpec, _lengths

DETERMINERS = ("the", "a", "every", "each", "this", "that", "our", "your", "one", "some")
ADJECTIVES = ("careful", "quiet", "bright", "narrow", "ancient", "modern", "useful", "heavy", "simple", "strange",
              "green", "patient", "rapid", "gentle", "formal", "local", "public", "private", "early", "final",
              "broken", "hidden", "open", "short", "detailed", "friendly", "honest", "strict", "clear", "warm")
NOUNS = ("library", "customer", "report", "engineer", "garden", "question", "window", "river", "market", "teacher",
         "invoice", "server", "museum", "letter", "kitchen", "student", "ticket", "village", "manual", "schedule",
         "account", "painter", "station", "contract", "recipe", "doctor", "bridge", "meeting", "archive", "policy",
         "answer", "request", "message", "budget", "harbor", "journal", "office", "record", "sensor", "traveler")
VERBS = ("reviews", "explains", "describes", "updates", "checks", "follows", "answers", "protects", "prepares",
         "collects", "compares", "records", "repairs", "announces", "delivers", "measures", "summarizes", "opens",
         "replaces", "schedules", "mentions", "requires", "approves", "organizes", "returns")
ADVERBS = ("carefully", "quickly", "politely", "today", "again", "clearly", "every morning", "before noon",
           "without delay", "in detail")
PREPOSITIONS = ("near", "behind", "for", "with", "after", "under", "inside", "beside", "before", "about")
SYSTEM_OPENER = ("You are a careful and friendly assistant for the help desk of a public library. "
                 "Answer in plain English, keep every answer short, and follow these notes:\n")
USER_OPENER = "\n"  # between the system prompt and the user part


def _pick(rng: np.random.Generator, words: tuple[str, ...]) -> str:
    return words[int(rng.integers(len(words)))]


def _sentence(rng: np.random.Generator) -> str:
    """One sentence: ``Det adj noun verb det noun [prep det adj noun] [adverb].``"""
    parts = [_pick(rng, DETERMINERS), _pick(rng, ADJECTIVES), _pick(rng, NOUNS), _pick(rng, VERBS),
             _pick(rng, DETERMINERS), _pick(rng, NOUNS)]
    if rng.random() < 0.5:
        parts += [_pick(rng, PREPOSITIONS), _pick(rng, DETERMINERS), _pick(rng, ADJECTIVES), _pick(rng, NOUNS)]
    if rng.random() < 0.4:
        parts.append(_pick(rng, ADVERBS))
    text = " ".join(parts) + "."
    return text[0].upper() + text[1:]


def text_token_ids(rng: np.random.Generator, tokenizer, num_tokens: int, opener: str = "") -> list[int]:
    """Exactly ``num_tokens`` ids of ``opener`` followed by seeded sentences.

    Sentences are drawn until the tokenized text is long enough, then the ids are
    cut (possibly mid-word: the benchmark needs exact lengths, not whole words).
    """
    sentences: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens:
        sentences += [_sentence(rng) for _ in range(max(1, (num_tokens - len(ids)) // 8 + 1))]
        ids = tokenizer.encode(opener + " ".join(sentences), add_special_tokens=False)
    return ids[:num_tokens]


def make_shared_prefix_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> Workload:
    """The shared-prefix workload of ``spec`` (see the module doc).

    Args:
        spec: sizes, seed, length distributions, ``shared_prefix_len`` and ``shared_fraction``.
        tokenizer: the model's ``transformers`` tokenizer.
        vocab_size: every id must be below it (the model's embedding rows).

    Raises:
        ValueError: the tokenizer produced an id outside ``[0, vocab_size)``.
    """
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    user_lens = _lengths(rng, n, spec.prompt_len_median, spec.sigma, spec.prompt_len_range)
    output_lens = _lengths(rng, n, spec.output_len_median, spec.sigma, spec.output_len_range)
    shared = set(rng.permutation(n)[: round(spec.shared_fraction * n)].tolist())
    prefix = text_token_ids(rng, tokenizer, spec.shared_prefix_len, SYSTEM_OPENER)
    requests = []
    for i in range(n):
        user = int(user_lens[i])
        if i in shared:
            ids = prefix + text_token_ids(rng, tokenizer, user, USER_OPENER)
        else:
            ids = text_token_ids(rng, tokenizer, spec.shared_prefix_len + user)
        if max(ids) >= vocab_size:
            raise ValueError(f"the tokenizer produced id {max(ids)}, outside the model's vocabulary of {vocab_size}")
        requests.append(BenchRequest(f"bench-{i}", tuple(ids), int(output_lens[i])))
    return Workload(spec, tuple(requests))
