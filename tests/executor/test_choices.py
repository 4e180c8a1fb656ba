"""The n > 1 fan-out on the engine side, without gRPC: ``merge_choices`` over plain
async generators (no model), and ``AsyncEngine.generate_choices`` on the default
model (choices equal the offline engine's, abort and slow readers free every block,
one validation per request whatever its choices)."""

from __future__ import annotations

import asyncio

import pytest

import executor.engine.llm_engine as llm_engine_module
from executor.engine.async_engine import AsyncEngine
from executor.engine.choices import merge_choices
from executor.engine.outputs import RequestOutput
from meshserve.errors import InvalidArgument, ResourceExhausted
from meshserve.sampling import SamplingParams, validate

N = 3


class Source:
    """An async generator of ``RequestOutput``s for one choice: ``count`` outputs (the
    last finished) or, with ``count`` None, unfinished ones forever; records how many
    it handed out and whether it was closed."""

    def __init__(self, name: str, count: int | None = None, error: Exception | None = None):
        self.name, self.count, self.error = name, count, error
        self.pulled = 0
        self.closed = False

    async def stream(self):
        try:
            while self.count is None or self.pulled < self.count:
                if self.error is not None and self.pulled == 1:
                    raise self.error
                self.pulled += 1
                await asyncio.sleep(0)  # a real stream suspends between outputs
                yield RequestOutput(self.name, [self.pulled], self.pulled == self.count,
                                    "length" if self.pulled == self.count else None)
        finally:
            self.closed = True


async def settle(loop_turns: int = 100) -> None:
    """Lets every ready task run until nothing can move (pure asyncio, no threads)."""
    for _ in range(loop_turns):
        await asyncio.sleep(0)


async def test_merge_yields_every_choice_with_its_index_until_all_finished():
    sources = [Source("a", 2), Source("b", 4), Source("c", 1)]
    got = [(i, out.request_id, out.new_token_ids[0], out.finished)
           async for i, out in merge_choices([s.stream() for s in sources])]
    by_choice = {i: [(rid, t, f) for j, rid, t, f in got if j == i] for i in range(N)}
    assert by_choice == {0: [("a", 1, False), ("a", 2, True)],
                         1: [("b", 1, False), ("b", 2, False), ("b", 3, False), ("b", 4, True)],
                         2: [("c", 1, True)]}
    assert all(s.closed for s in sources)


async def test_merge_of_one_choice_reads_its_stream_directly():
    source = Source("only", 3)
    got = [(i, out.new_token_ids, out.finished) async for i, out in merge_choices([source.stream()])]
    assert got == [(0, [1], False), (0, [2], False), (0, [3], True)]
    assert source.closed


async def test_merge_raises_a_choice_error_after_what_was_merged_and_closes_every_stream():
    sources = [Source("a"), Source("b", error=ResourceExhausted("slow")), Source("c")]
    got = []
    with pytest.raises(ResourceExhausted, match="slow"):
        async for i, out in merge_choices([s.stream() for s in sources]):
            got.append((i, out.new_token_ids[0]))
    assert (1, 1) in got and (1, 2) not in got  # choice 1's only output came before its error
    assert all(s.closed for s in sources)


async def test_C27_merge_is_bounded_by_n_then_the_streams_back_up():
    """A reader that takes one output and stops: the merge queue holds n, each pump
    one more, and no stream is read further (the rest backs up into the choices' own
    bounded queues, where ``AsyncEngine`` ends a slow choice)."""
    sources = [Source(name) for name in "abc"]
    merged = merge_choices([s.stream() for s in sources])
    await anext(merged)
    await settle()
    assert sum(s.pulled for s in sources) == 1 + N + N
    await settle()
    assert sum(s.pulled for s in sources) == 1 + N + N
    await merged.aclose()
    assert all(s.closed for s in sources)


async def test_closing_the_merge_closes_every_stream_before_it_returns():
    sources = [Source(name) for name in "abc"]
    merged = merge_choices([s.stream() for s in sources])
    await anext(merged)
    await merged.aclose()
    assert all(s.closed for s in sources)  # no pump left running after aclose


# -- AsyncEngine.generate_choices on the default model --------------------------------


async def wait_until(predicate, max_polls: int = 60_000) -> None:
    """Polls ``predicate`` between event-loop turns (the cap only ends a hung test)."""
    for _ in range(max_polls):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def collect_choices(eng: AsyncEngine, request_id: str, checked) -> dict[int, tuple[list[int], list]]:
    """choice index -> (its tokens, its finish reasons in order)."""
    out: dict[int, tuple[list[int], list]] = {}
    async for index, o in eng.generate_choices(request_id, checked):
        tokens, reasons = out.setdefault(index, ([], []))
        tokens += o.new_token_ids
        if o.finished:
            reasons.append(o.finish_reason)
    return out


@pytest.mark.model
async def test_seeded_choices_each_equal_the_offline_engine_for_that_choice(engine, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, n=N)
    eng = AsyncEngine(engine)
    await eng.start()
    try:
        got = await collect_choices(eng, "story", engine.check_request(prompt, params))
        assert eng._streams == {}
    finally:
        await eng.stop()
    expected = [engine.generate([prompt], params.for_choice(i))[0] for i in range(N)]
    assert got == {i: (expected[i], ["length"]) for i in range(N)}
    assert len({tuple(tokens) for tokens in expected}) == N  # seeds seed + i: three different samples


@pytest.mark.model
async def test_abort_of_n_choices_frees_every_block_and_the_id_is_reusable_at_once(engine):
    """Closing the stream of an n=3 request while every choice runs aborts all three,
    leaves no choice stream open, and frees every block; the same id is taken again at
    once and gives the offline result."""
    long = engine.check_request([3] * 40, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True, n=N))
    eng = AsyncEngine(engine)
    await eng.start()
    try:
        start = eng.stats()
        choices = eng.generate_choices("r", long)
        seen = set()
        while len(seen) < N:
            index, out = await anext(choices)
            assert not out.finished
            seen.add(index)
        stats = eng.stats()
        held = eng.num_blocks_by_request(stats)
        assert len(stats.num_blocks_by_request) == N and held == {"r": sum(b for _, b in stats.num_blocks_by_request)}
        assert held["r"] >= N * 3  # 40 prompt tokens: three blocks of 16 per choice
        await choices.aclose()
        assert eng._streams == {} and eng.num_blocks_by_request() == {}
        short = engine.check_request([9] * 12, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=2))
        again = await collect_choices(eng, "r", short)
        await wait_until(lambda: eng.stats().num_free_blocks == engine.num_blocks and eng.stats().num_running == 0)
        assert eng.stats().num_aborted == start.num_aborted + N
        assert eng.num_overflowed == 0
    finally:
        await eng.stop()
    expected = engine.generate([[9] * 12], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert again == {0: (expected, ["length"]), 1: (expected, ["length"])}
    assert engine.stats().num_free_blocks == engine.num_blocks


@pytest.mark.model
async def test_C27_slow_reader_of_n_choices_ends_every_choice_and_frees_every_block(engine):
    """A reader of an n=3 request that stops after one output: each choice backs up to
    the bound and is ended (three slow-reader aborts, all blocks freed while it still
    does not read); it then reads what was merged, greedy tokens the offline engine
    gives, and ``ResourceExhausted``."""
    bound = 3
    prompt = [5] * 20
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=N)
    eng = AsyncEngine(engine, max_buffered_outputs=bound)
    await eng.start()
    try:
        choices = eng.generate_choices("slow", engine.check_request(prompt, params))
        got = [await anext(choices)]
        await wait_until(lambda: eng.num_overflowed == N)
        await wait_until(lambda: eng.stats().num_free_blocks == engine.num_blocks and eng.stats().num_running == 0)
        assert eng.max_buffered_seen == bound
        with pytest.raises(ResourceExhausted, match=f"bound {bound}"):
            async for item in choices:
                got.append(item)
        assert eng._streams == {}
    finally:
        await eng.stop()
    assert len(got) <= 1 + N + N + N * bound  # read + merge queue + one per pump + each choice's queue
    tokens = [[t for i, out in got if i == index for t in out.new_token_ids] for index in range(N)]
    longest = max(len(t) for t in tokens)
    offline = engine.generate([prompt], SamplingParams(max_tokens=longest, temperature=0.0, ignore_eos=True))[0]
    assert [t == offline[:len(t)] for t in tokens] == [True] * N


@pytest.mark.model
async def test_generate_choices_refuses_an_empty_id_or_one_in_use(engine):
    checked = engine.check_request([1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, n=2))
    eng = AsyncEngine(engine)
    await eng.start()
    try:
        with pytest.raises(InvalidArgument, match="request_id must not be empty"):
            await anext(eng.generate_choices("", checked))
        first = eng.generate_choices("dup", checked)
        await anext(first)
        with pytest.raises(InvalidArgument, match="request_id 'dup#0' is already in use"):
            await anext(eng.generate_choices("dup", checked))
        await first.aclose()
        await wait_until(lambda: eng.stats().num_free_blocks == engine.num_blocks and eng.stats().num_running == 0)
    finally:
        await eng.stop()


@pytest.mark.model
async def test_a_request_is_validated_once_whatever_its_choices(engine, monkeypatch):
    """The executor checks a request once (``check_request``); neither the fan-out nor
    the engine thread's add validates its params again, and the public ``generate``
    and ``add_request`` check once each."""
    calls = []

    def counted(params, **limits):
        calls.append(params)
        return validate(params, **limits)

    monkeypatch.setattr(llm_engine_module, "validate", counted)
    params = SamplingParams(max_tokens=3, temperature=0.7, seed=1, ignore_eos=True, n=N, top_k=-1)
    eng = AsyncEngine(engine)
    await eng.start()
    try:
        checked = engine.check_request([4] * 8, params)
        assert checked.sampling_params.top_k == 0 and len(calls) == 1  # normalised by the one check
        got = await collect_choices(eng, "once", checked)
        assert sorted(got) == list(range(N)) and len(calls) == 1
        async for _ in eng.generate("single", [4] * 8, params):
            pass
        assert len(calls) == 2
    finally:
        await eng.stop()
    engine.generate([[4] * 8], params)
    assert len(calls) == 3
