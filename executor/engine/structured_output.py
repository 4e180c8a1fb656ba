"""Structured outputs in the engine: grammars compiled against the model's tokenizer,
and each constrained request's matcher (vLLM v1's ``StructuredOutputManager``).

The engine owns the grammar state, not the workers (as vLLM v1's scheduler process
does)::

    check_request:        GrammarCompiler.compile(spec)  → CompiledGrammar (cached)
    schedule():           GrammarState.bitmask()         → ScheduledRequest.grammar_bitmask
    worker (sampler):     logits[~allowed] = -inf        (executor.worker.sampler)
    update_from_output(): GrammarState.accept(token)     → finished when terminated

A step's mask is filled when the request is scheduled to sample, from the matcher's
state after every token already appended, and the matcher advances once per sampled
token in ``update_from_output``: a preempted request keeps its outputs and its
matcher (it recomputes K/V, not tokens), so its constraint goes on where it stopped.

The bitmask is xgrammar's layout: ``ceil(vocab_size / 32)`` int32 words, bit ``j`` of
word ``w`` allowing token ``32 * w + j``; the model's EOS ids are the grammar's stop
tokens, allowed only where the grammar is complete, and accepting one terminates it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path

from meshserve import structured_output as structured
from meshserve.errors import InvalidArgument
from meshserve.structured_output import StructuredOutput

MAX_CACHED_GRAMMARS = 128
MAX_MASK_FILL_S = 0.05
"""The most CPU time one request's bitmask fill may take (seconds of the engine thread's
own CPU time, ``time.thread_time``: a thread descheduled on a loaded host does not count)
before the request is ended "abort" (``GrammarState.overran``). Fills run on the engine's
thread, so a slow one delays every request of the step; for an ambiguous grammar
xgrammar's work grows with the tokens generated (``(a*)*b`` pushed to ``a``: a step from
50 to 558 ms by the 500th token on one Zen 4 core). Usual fills, measured there over 1,042
fills of 8 sampled answers (temperature 0.9, up to 200 tokens) to a nested JSON Schema
with patterns, enums and ``anyOf``, a JSON object, a regex and a repeating EBNF grammar:
median 0.026 ms, p99 2.7 ms, at most 3.1 ms. 50 ms bounds what one request costs its
neighbours a step, 16 times the largest usual fill."""

log = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer; thread-safe (``check_request``
    runs in the servicer's worker threads and in tests on any thread), and one slow
    compile does not hold up another's.

    The tokenizer (``AutoTokenizer`` from the model folder) and xgrammar's
    ``TokenizerInfo`` take ~2.4 s to build for a 49,152-token vocabulary on one Zen 4
    core (1.3 s of it loading the tokenizer, in calls that hold the GIL for long
    stretches). A served executor builds them at start-up (``warm``, before it
    registers): built at the first constrained request instead, they once starved
    the executor's event loop for seconds on a loaded host, long enough for the
    scheduler to drop it as silent. Otherwise (an engine in a test or a benchmark)
    they are built at the first constrained request. Compiled grammars are kept,
    least recently used out, up to ``MAX_CACHED_GRAMMARS``.

    Args:
        model_path: returns the model folder (called once, at first use).
        vocab_size: the model's logits width (>= the tokenizer's: padding ids are
            never allowed).
        eos_token_ids: the model's EOS ids, the grammars' stop tokens.
    """

    def __init__(self, model_path, vocab_size: int, eos_token_ids: frozenset[int]):
        self._model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()

    def compile(self, spec: StructuredOutput):
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (validated by ``meshserve.sampling``).

        Raises:
            InvalidArgument: xgrammar cannot compile the spec, its grammar allows no first
                token (no sentence, or none the tokenizer can form: ``root ::= root``), or the
                model folder has no tokenizer (structured outputs need one).
        """
        with self._lock:  # the cache and the first use; a compile itself runs outside (xgrammar's is thread-safe)
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            compiler = self._compiler or self._make_compiler()
        try:
            compiled = compiler.compile_grammar(structured.grammar(spec))
        except (RuntimeError, ValueError) as error:
            raise InvalidArgument(f"structured output {spec.kind}: {structured.reason(error)}") from None
        if not _allows_a_first_token(compiled):
            raise InvalidArgument(f"structured output {spec.kind}: no text the model's tokenizer can form starts "
                                  "a sentence of it (its grammar allows no first token)")
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def warm(self) -> None:
        """Builds the tokenizer's tables now (once). Never raises: a model without a
        tokenizer, or one xgrammar cannot read, is only logged, so that the executor
        serves all else (its constrained requests are then refused, or retry the build)."""
        with self._lock:
            if self._compiler is None:
                try:
                    self._make_compiler()
                except Exception as error:  # noqa: BLE001 - structured outputs must not stop the executor
                    log.warning("%s: structured outputs are refused on this executor", error)

    def _make_compiler(self):
        import xgrammar
        from transformers import AutoTokenizer

        started = time.monotonic()
        path = Path(self._model_path())
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise InvalidArgument(f"structured outputs need the model's tokenizer; {path} has none "
                                  f"({type(error).__name__})") from None
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=sorted(self.eos_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        log.info("structured outputs: the tokenizer's grammar tables (%d tokens) built in %.1f s",
                 self.vocab_size, time.monotonic() - started)
        return self._compiler


def _allows_a_first_token(compiled) -> bool:
    """Whether a fresh matcher of ``compiled`` allows some token (EOS counts: the empty
    sentence); about 0.1 ms."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


class GrammarState:
    """One constrained request's matcher (owned by the batch scheduler, as the request's
    other mutable state).

    Args:
        compiled: the request's ``xgrammar.CompiledGrammar`` (``GrammarCompiler.compile``).
    """

    def __init__(self, compiled):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._refused = False
        self.overran = False  # a fill took longer than MAX_MASK_FILL_S: the request ends "abort"
        self._bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)

    def bitmask(self) -> bytes:
        """The tokens allowed next: ``ceil(vocab_size / 32)`` little-endian int32 words as
        bytes (a copy; about 6 KB for a 49,152-token vocabulary). A fill longer than
        ``MAX_MASK_FILL_S`` sets ``overran`` (logged): the mask is still used this step."""
        started = time.thread_time()
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        elapsed = time.thread_time() - started
        if elapsed > MAX_MASK_FILL_S and not self.overran:
            self.overran = True
            log.warning("a structured output's mask took %.3f s of CPU to fill (more than %.3f s, on the engine's "
                        "thread): the request ends (abort)", elapsed, MAX_MASK_FILL_S)
        return self._bitmask.numpy().tobytes()

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False when the grammar does not allow it: its
        mask allowed no token (a rule with no sentence the tokenizer can form), or a bug.
        The scheduler then ends the request without that token."""
        accepted = self._matcher.accept_token(token_id)
        self._refused |= not accepted
        return accepted

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted (or it
        refused a token)."""
        return self._refused or self._matcher.is_terminated()
