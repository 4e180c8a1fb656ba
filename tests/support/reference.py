"""The ``transformers`` reference for golden tests (reusable by mesh tests).

``HFReference.greedy`` runs ``AutoModelForCausalLM.generate(do_sample=False)`` on one
prompt at a time (no padding, no batching effects) and keeps, at every generated
position, the reference's two best tokens and their logits. ``compare_greedy``
then accepts a divergence of our tokens only where the reference itself was at a
near tie: at the first differing position, the reference's top-2 logits are within
``tie_tol`` and our token is one of those two; and only for ``max_divergent``
prompts at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

GOLDEN_MAX_TOKENS = 64
"""Tokens each golden prompt generates."""

SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "In 1969, astronauts first walked on the surface of the Moon.",
    "A good recipe for bread needs flour, water, salt and a little patience.",
    "Continuous batching lets new requests join a running batch at every step.",
    "The mitochondria is often called the powerhouse of the cell.",
    "Rain fell softly on the old tin roof while the children slept.",
    "Prime numbers have exactly two distinct positive divisors.",
    "The library opens at nine and closes at six on weekdays.",
    "Write a short poem about the sea, the wind and the stars.",
    "Python lists grow by over-allocating memory to amortise appends.",
    "She walked to the market to buy apples, cheese and fresh bread.",
)


def golden_lengths(n: int = 16, shortest: int = 5, longest: int = 600) -> list[int]:
    """``n`` target prompt lengths spread geometrically over ``[shortest, longest]`` tokens."""
    return [round(shortest * (longest / shortest) ** (i / (n - 1))) for i in range(n)]


def golden_prompts(tokenizer, n: int = 16, shortest: int = 5, longest: int = 600) -> list[list[int]]:
    """Deterministic prompts of about ``golden_lengths`` tokens: even indices raw text
    cut at exactly the target length, odd indices a chat-templated user message of
    repeated sentences (at least the template's own length)."""
    prompts = []
    for i, target in enumerate(golden_lengths(n, shortest, longest)):
        sentences = [SENTENCES[(i * 5 + j) % len(SENTENCES)] for j in range(target)]
        if i % 2 == 0:
            ids = tokenizer(" ".join(sentences), add_special_tokens=False).input_ids[:target]
        else:
            k, ids = 0, []
            while len(ids) < target and k < len(sentences):
                k += 1
                text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(sentences[:k])}],
                                                     tokenize=False, add_generation_prompt=True)
                ids = tokenizer(text, add_special_tokens=False).input_ids
        prompts.append(list(ids))
    return prompts


@dataclass
class ReferenceOutput:
    """One greedy generation of the reference.

    Attributes:
        token_ids: generated tokens.
        top2_ids: at each generated position, the reference's best two token ids.
        top2_logits: their float32 logits.
    """

    token_ids: list[int]
    top2_ids: list[tuple[int, int]]
    top2_logits: list[tuple[float, float]]

    def first(self, num_tokens: int) -> ReferenceOutput:
        """The reference for ``max_new_tokens=num_tokens``: greedy decoding is the same
        one token at a time, so it is this output's first ``num_tokens`` positions."""
        return ReferenceOutput(self.token_ids[:num_tokens], self.top2_ids[:num_tokens],
                               self.top2_logits[:num_tokens])


class HFReference:
    """``transformers``' own model, float32, greedy, one prompt at a time."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()

    def greedy(self, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> ReferenceOutput:
        """``generate(do_sample=False)``; EOS does not stop it when ``ignore_eos``."""
        input_ids = torch.tensor([prompt])
        kwargs = {"eos_token_id": None} if ignore_eos else {}
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=0, return_dict_in_generate=True,
                                      output_logits=True, pad_token_id=0, **kwargs)
        tokens = out.sequences[0, len(prompt):].tolist()
        top = [step[0].float().topk(2) for step in out.logits]
        return ReferenceOutput(tokens, [tuple(t.indices.tolist()) for t in top],
                               [tuple(t.values.tolist()) for t in top])

    def greedy_many(self, prompts: list[list[int]], max_new_tokens: int,
                    ignore_eos: bool = True) -> list[ReferenceOutput]:
        return [self.greedy(p, max_new_tokens, ignore_eos) for p in prompts]


@dataclass
class Divergence:
    """Where our greedy tokens first differ from the reference's."""

    prompt_index: int
    position: int
    ours: int
    reference: int
    top2_gap: float
    near_tie: bool


def find_divergences(ours: list[list[int]], refs: list[ReferenceOutput], tie_tol: float = 1e-4) -> list[Divergence]:
    """The first differing position of every prompt whose tokens differ (ours may be a
    prefix of the reference's when it stopped earlier: then only the common part counts)."""
    found = []
    for i, (mine, ref) in enumerate(zip(ours, refs, strict=True)):
        for pos, (a, b) in enumerate(zip(mine, ref.token_ids)):
            if a != b:
                gap = ref.top2_logits[pos][0] - ref.top2_logits[pos][1]
                found.append(Divergence(i, pos, a, b, gap, gap <= tie_tol and a in ref.top2_ids[pos]))
                break
    return found


def assert_greedy_matches(ours: list[list[int]], refs: list[ReferenceOutput], tie_tol: float = 1e-4,
                          max_divergent: int = 1, exact_lengths: bool = True) -> list[Divergence]:
    """Asserts our greedy tokens equal the reference's, except at most ``max_divergent``
    prompts that diverge at a near tie (top-2 reference logits within ``tie_tol`` and our
    token one of them). Returns the accepted divergences.

    Raises:
        AssertionError: a divergence not at a near tie, too many divergences, or (with
            ``exact_lengths``) a length mismatch on a prompt that did not diverge.
    """
    divergences = find_divergences(ours, refs, tie_tol)
    bad = [d for d in divergences if not d.near_tie]
    assert not bad, f"greedy tokens differ from transformers away from a near tie: {bad}"
    assert len(divergences) <= max_divergent, f"too many near-tie divergences: {divergences}"
    if exact_lengths:
        diverged = {d.prompt_index for d in divergences}
        for i, (mine, ref) in enumerate(zip(ours, refs)):
            if i not in diverged:
                assert len(mine) == len(ref.token_ids), (
                    f"prompt {i}: {len(mine)} tokens, reference {len(ref.token_ids)}")
    return divergences


def cached_reference(key: dict, compute) -> list[ReferenceOutput]:
    """``compute()`` once per distinct ``key``, kept on disk under the meshserve cache
    (``$MESHSERVE_CACHE_DIR/reference/``) so later test runs skip the slow one-prompt-at-a-
    time reference. The key must name everything the outputs depend on (model revision,
    prompts, lengths); the transformers and torch versions are added here.
    ``MESHSERVE_REFERENCE_CACHE=0`` always recomputes."""
    import hashlib
    import json
    import os

    import transformers

    from meshserve.model_files import cache_dir

    full_key = dict(key, transformers=transformers.__version__, torch=torch.__version__)
    digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / "reference" / f"{digest}.json"
    use_cache = os.environ.get("MESHSERVE_REFERENCE_CACHE", "1") != "0"
    if use_cache and path.exists():
        return [ReferenceOutput(r["token_ids"], [tuple(x) for x in r["top2_ids"]], [tuple(x) for x in r["top2_logits"]])
                for r in json.loads(path.read_text())]
    outputs = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([o.__dict__ for o in outputs]))
    os.replace(tmp, path)
    return outputs


MESH_GOLDEN_MAX_TOKENS = 64
"""Tokens each prompt of the mesh golden tests generates."""


def mesh_prompts(tokenizer):
    """(request kwargs, expected prompt ids) for 16 prompts of about 5..600 tokens;
    even indices raw text, odd indices one chat message."""
    cases = []
    for i, target in enumerate(golden_lengths(16, 5, 600)):
        words = " ".join(SENTENCES[(i * 7 + j) % len(SENTENCES)] for j in range(target)).split(" ")
        lo, hi = 1, len(words)
        while lo < hi:  # the fewest words whose prompt reaches the target length
            mid = (lo + hi) // 2
            text = " ".join(words[:mid])
            n = len(tokenizer(text).input_ids) if i % 2 == 0 else len(
                tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])
            lo, hi = (mid + 1, hi) if n < target else (lo, mid)
        text = " ".join(words[:lo])
        if i % 2 == 0:
            cases.append((dict(prompt=text), tokenizer(text).input_ids))
        else:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
            cases.append((dict(chat=[("user", text)]), list(ids)))
    return cases
