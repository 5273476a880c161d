"""Fetching a prompt's prefix from a peer engine's prefix cache, at engine level in one process:
a holder engine has the prefix cached and reads it out (`export_cached_kv`), a second engine
given a `peer_prefix` hint holds blocks for it, loads them and computes only the rest. Tokens
and logprobs equal those of recomputing (greedy and seeded sampling, float and int8 caches),
a holder whose blocks are gone answers None and the fetcher recomputes, and every block goes
back to both pools. The serving path is tested in tests/routing/test_peer_fetch.py."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine_args import EngineArgs
from engine.kv_transfer.peer_prefix import PeerPrefix
from tests.engine.path_agreement import FLOAT32_NOISE
from tests.tiny_llama import save_tiny_llama

BS = 16
PREFIX = [(7 * i + 3) % 500 + 1 for i in range(6 * BS + 5)]  # 6 full blocks and a bit
PROMPT = PREFIX + [11, 42, 99, 123, 7, 250, 31]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, logprobs=3),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=1234, logprobs=2),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_dir):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-peer"), seed=5, tokenizer_from=smollm_dir))


def _llm(model: str, kv_cache_dtype: str) -> LLM:
    return LLM(
        model,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        num_threads=1,
        max_model_len=512,
        kv_cache_memory_bytes=2 << 20,
    )


@pytest.fixture(scope="module", params=["auto", "int8", "fp8_e4m3"])
def engines(request, tiny):
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "fp8_e4m3":  # the C++ CPU ops refuse fp8 rows: the reference backend reads them
            mp.setenv("ORBITAL_ATTENTION_BACKEND", "reference")
        holder, fetcher = _llm(tiny, request.param), _llm(tiny, request.param)
        yield holder, fetcher
        holder.shutdown()
        fetcher.shutdown()


@pytest.fixture(scope="module")
def float_cache(tiny):
    """The same model with a float32 cache: what a quantized cache's rounding is measured against."""
    llm = _llm(tiny, "auto")
    yield llm
    llm.shutdown()


@pytest.fixture
def bound(request, engines, float_cache):
    """How far the fetched and the recomputed path may differ (tests/engine/path_agreement.py):
    float32 noise with a float32 cache; with an int8/fp8 cache the tail is quantized after float
    sums of another order, so twice the cache's own rounding effect, measured on this prompt."""
    if request.node.callspec.params["engines"] == "auto":
        return lambda params: FLOAT32_NOISE

    def measured(params: SamplingParams) -> float:
        fetcher = engines[1]
        fetcher.engine.core.scheduler.reset_prefix_cache()
        float_cache.engine.core.scheduler.reset_prefix_cache()
        coarse, fine = _run(fetcher, "coarse", params), _run(float_cache, "fine", params)
        fetcher.engine.core.scheduler.reset_prefix_cache()
        return max(FLOAT32_NOISE, 2 * _effect(coarse, fine))

    return measured


def _run(llm: LLM, rid: str, params: SamplingParams, hint: PeerPrefix | None = None, on_load=None):
    """Run PROMPT to the end on `llm`'s core; `on_load(load)` serves the loads it asks for.
    Returns (token ids, logprobs, cached tokens reported)."""
    eng = llm.engine
    [req] = eng.inputs.make_requests(rid, list(PROMPT), params)
    req.peer_prefix = hint
    eng.core.add_request(req)
    tokens, logprobs, cached = [], [], None
    while eng.core.has_unfinished_requests():
        for out in eng.core.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
            cached = out.num_cached_tokens if out.new_token_ids and cached is None else cached
        for load in eng.core.take_kv_loads():
            on_load(load)
    return tokens, logprobs, cached


def _effect(coarse, fine) -> float:
    """The largest logprob change between two runs over the positions where their tokens agree."""
    worst = 0.0
    for x, y in zip(coarse[1], fine[1]):
        if x.token_id != y.token_id:
            break
        theirs = dict(y.top) | {y.token_id: y.logprob}
        mine = dict(x.top) | {x.token_id: x.logprob}
        worst = max([worst] + [abs(v - theirs[t]) for t, v in mine.items() if t in theirs])
    return worst


def _same(a, b, bound: float) -> None:
    """Two paths of one computation (tests/engine/path_agreement.py): the fetched KV is the
    holder's bytes, but the rest of the prompt runs in another shape of step. Tokens equal up to
    the first position where `b`'s best two candidates are within reach of `bound` (either path
    may take either one there; all of them when there is none), logprobs of the same token and of
    every top candidate both list within `bound` up to it."""
    tied = next((i for i, y in enumerate(b[1]) if len(y.top) >= 2 and y.top[0][1] - y.top[1][1] <= 2 * bound), None)
    if tied is None:
        assert a[0] == b[0]
    else:
        assert a[0][:tied] == b[0][:tied], f"differ before the near-tie at {tied}"
    for x, y in list(zip(a[1], b[1]))[: None if tied is None else tied + 1]:
        theirs = dict(y.top) | {y.token_id: y.logprob}
        mine = dict(x.top) | {x.token_id: x.logprob}
        assert all(abs(v - theirs[t]) <= bound for t, v in mine.items() if t in theirs)


def _used(llm: LLM) -> int:
    sched = llm.engine.core.scheduler
    sched.check_integrity()
    assert sched.num_waiting_for_remote_kv == 0
    return sched.kv_cache_manager.block_pool.get_num_used_blocks()


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_fetched_prefix_gives_the_recomputed_outputs(engines, params, bound):
    holder, fetcher = engines
    tol = bound(params)
    for llm in engines:
        llm.engine.core.scheduler.reset_prefix_cache()
    ref = _run(fetcher, "ref", params)  # computed here, from nothing
    fetcher.engine.core.scheduler.reset_prefix_cache()
    _run(holder, "warm", SamplingParams(temperature=0, max_tokens=2))  # caches PROMPT's blocks
    assert _used(holder) == _used(fetcher) == 0
    free_before = [llm.engine.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() for llm in engines]

    loads, moved = [], []

    def fetch(load):
        loads.append(load)
        blocks = holder.engine.core.export_cached_kv(
            load.prompt_token_ids, load.first_block, load.num_blocks, load.lora_request, load.cache_salt
        )
        assert blocks is not None
        moved.append(blocks)
        fetcher.engine.core.load_kv(load.request_id, blocks)

    hint = PeerPrefix("holder", 6 * BS)
    got = _run(fetcher, "fetched", params, hint, fetch)
    _same(got, ref, tol)
    [load] = loads
    assert load.source == "holder" and load.first_block == 0 and load.num_tokens == 6 * BS
    assert moved[0].num_blocks == 6 and moved[0].nbytes == 6 * moved[0].layout.bytes_per_block
    assert got[2] == 6 * BS  # the fetched tokens count as cached
    stats = fetcher.stats()
    assert stats["num_peer_fetches"] >= 1 and stats["num_remote_prefills"] == 0
    # Nobody holds a block: the holder's read let go of its blocks, the fetcher's finished.
    assert _used(holder) == _used(fetcher) == 0
    assert holder.engine.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before[0]
    assert fetcher.engine.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before[1]

    # The fetched blocks are in the fetcher's prefix cache now: a second run hits them locally.
    again = _run(fetcher, "again", params, hint, lambda load: pytest.fail("fetched twice"))
    _same(again, ref, tol)


def test_only_the_missing_blocks_are_fetched(engines, bound):
    holder, fetcher = engines
    for llm in engines:
        llm.engine.core.scheduler.reset_prefix_cache()
    params = PARAMS[0]
    tol = bound(params)
    ref = _run(fetcher, "ref2", params)
    fetcher.engine.core.scheduler.reset_prefix_cache()
    _run(holder, "warm2", SamplingParams(temperature=0, max_tokens=2))
    # The fetcher holds the first 2 blocks itself.
    [short] = fetcher.engine.inputs.make_requests("short", PROMPT[: 2 * BS + 3], SamplingParams(max_tokens=1))
    fetcher.engine.core.add_request(short)
    while fetcher.engine.core.has_unfinished_requests():
        fetcher.engine.core.step()
    loads = []

    def fetch(load):
        loads.append(load)
        args = (load.prompt_token_ids, load.first_block, load.num_blocks, load.lora_request, load.cache_salt)
        fetcher.engine.core.load_kv(load.request_id, holder.engine.core.export_cached_kv(*args))

    got = _run(fetcher, "partial", params, PeerPrefix("holder", 6 * BS), fetch)
    _same(got, ref, tol)
    [load] = loads
    assert (load.first_block, load.num_blocks) == (2, 4)
    assert _used(holder) == _used(fetcher) == 0


def test_evicted_blocks_answer_none_and_the_fetcher_recomputes(engines, bound):
    holder, fetcher = engines
    for llm in engines:
        llm.engine.core.scheduler.reset_prefix_cache()
    params = PARAMS[1]
    tol = bound(params)
    ref = _run(fetcher, "ref3", params)
    fetcher.engine.core.scheduler.reset_prefix_cache()
    _run(holder, "warm3", SamplingParams(temperature=0, max_tokens=2))
    holder.engine.core.scheduler.reset_prefix_cache()  # the holder lost the prefix meanwhile
    answers = []

    def fetch(load):
        blocks = holder.engine.core.export_cached_kv(
            load.prompt_token_ids, load.first_block, load.num_blocks, load.lora_request, load.cache_salt
        )
        answers.append(blocks)
        fetcher.engine.core.kv_load_failed(load.request_id)  # what the serving layer does with None

    failures = fetcher.stats()["num_peer_fetch_failures"]
    got = _run(fetcher, "evicted", params, PeerPrefix("holder", 6 * BS), fetch)
    assert answers == [None]
    _same(got, ref, tol)
    assert got[2] == 0
    assert fetcher.stats()["num_peer_fetch_failures"] == failures + 1
    assert _used(holder) == _used(fetcher) == 0


def test_a_hint_covering_no_more_than_the_local_hit_fetches_nothing(engines):
    holder, fetcher = engines
    fetcher.engine.core.scheduler.reset_prefix_cache()
    _run(fetcher, "local", SamplingParams(temperature=0, max_tokens=2))
    # A short hint, and one past the prompt (capped at its last full block before the last token).
    for n in (BS, 10 * BS):
        _run(fetcher, f"hinted{n}", PARAMS[0], PeerPrefix("holder", n), lambda load: pytest.fail(str(load)))
    assert _used(fetcher) == 0


def test_requests_whose_fetches_failed_never_hold_the_pool_between_them(tiny):
    """Two requests hold blocks for a peer's prefix in a pool that has room for about one
    prompt besides; both fetches fail. The head of the queue cannot get its last blocks while
    the other holds its own, and nothing runs: the one behind lets go of them, and both finish
    with every block back in the pool (a deadlock before)."""
    llm = LLM(tiny, dtype="float32", num_threads=1, max_model_len=512, num_blocks=13, block_size=BS)
    try:
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for k in range(2):
            prompt = [(7 * i + 3 + k) % 500 + 1 for i in range(6 * BS + 5)] + PROMPT[-7:]
            [req] = eng.inputs.make_requests(f"held-{k}", prompt, params)
            req.peer_prefix = PeerPrefix("peer", 6 * BS)
            eng.core.add_request(req)
        tokens, finished, steps = {}, set(), 0
        while eng.core.has_unfinished_requests():
            assert steps < 400, "the requests never finished"
            for out in eng.core.step():
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finished:
                    assert out.error is None, out.error
                    finished.add(out.request_id)
            for load in eng.core.take_kv_loads():
                eng.core.kv_load_failed(load.request_id)  # the holder's blocks are gone
            steps += 1
        assert finished == {"held-0", "held-1"} and tokens == {"held-0": 24, "held-1": 24}
        assert eng.core.scheduler.num_holders_released >= 1
        assert _used(llm) == 0
    finally:
        llm.shutdown()


def _followers(k: int) -> list[list[int]]:
    """`k` prompts that share PREFIX and differ after it."""
    return [PREFIX + [11 + j, 42, 99, 123, 7, 250, 31] for j in range(k)]


@pytest.mark.parametrize("engines", ["auto"], indirect=True)
def test_requests_of_one_prefix_fetch_it_once_and_hit_it_after(engines):
    """Three requests with one hinted prefix arrive together: one fetch goes to the peer, the two
    others wait for it (not a fetch each) and then hit the fetched blocks, counted once each in
    the prefix-cache figures however many steps they waited. While the fetch is out nothing can
    run, and the engine reports no work (its loop sleeps rather than scheduling nothing again)."""
    holder, fetcher = engines
    for llm in engines:
        llm.engine.core.scheduler.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = _followers(3)
    refs = {f"ref{j}": p for j, p in enumerate(prompts)}
    want = {}
    for rid, p in refs.items():  # recomputed references, one at a time
        [r] = fetcher.engine.inputs.make_requests(rid, p, params)
        fetcher.engine.core.add_request(r)
        while fetcher.engine.core.has_unfinished_requests():
            for out in fetcher.engine.core.step():
                ids, lps = want.get(rid, ([], []))
                want[rid] = (ids + out.new_token_ids, lps + (out.new_logprobs or []))
        fetcher.engine.core.scheduler.reset_prefix_cache()
    _run(holder, "warm-once", SamplingParams(temperature=0, max_tokens=2))
    core = fetcher.engine.core
    pool = core.scheduler.kv_cache_manager.block_pool
    q0, h0 = pool.prefix_cache_queries, pool.prefix_cache_hits
    for j, p in enumerate(prompts):
        [r] = fetcher.engine.inputs.make_requests(f"f{j}", p, params)
        r.peer_prefix = PeerPrefix("holder", 6 * BS)
        core.add_request(r)
    got: dict[str, tuple[list, list]] = {}
    loads = []
    for i in range(5):  # the fetch is out for several steps
        assert not core.step()
        loads += core.take_kv_loads()
        # (The first step also tells the runner to forget the references' requests.)
        assert i == 0 or not core.has_work(), "nothing can run while the fetch is out"
    [load] = loads
    assert load.request_id == "f0" and (load.first_block, load.num_blocks) == (0, 6)
    args = (load.prompt_token_ids, load.first_block, load.num_blocks, load.lora_request, load.cache_salt)
    core.load_kv(load.request_id, holder.engine.core.export_cached_kv(*args))
    assert core.has_work()
    while core.has_unfinished_requests():
        for out in core.step():
            ids, lps = got.get(out.request_id, ([], []))
            got[out.request_id] = (ids + out.new_token_ids, lps + (out.new_logprobs or []))
        assert not core.take_kv_loads()
    for j in range(3):  # batched with fetched KV against alone and recomputed: one computation, two paths
        _same(got[f"f{j}"], want[f"ref{j}"], FLOAT32_NOISE)
    # f0's lookup found nothing here (the fetched tokens are counted as fetched, not as hits);
    # f1 and f2 each found the 6 fetched blocks, once.
    assert pool.prefix_cache_queries - q0 == sum(len(p) for p in prompts)
    assert pool.prefix_cache_hits - h0 == 2 * 6 * BS
    assert _used(holder) == _used(fetcher) == 0


def test_the_engine_loop_sleeps_while_a_fetch_is_out(tiny):
    """AsyncEngine: two requests wait on one fetch that has not come back and nothing else can
    run; the step loop waits for an event instead of scheduling nothing over and over (without
    `Scheduler.stalled` it schedules the same nothing tens of thousands of times a second)."""

    async def main() -> None:
        eng = AsyncEngine(
            EngineArgs(model=tiny, dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory_bytes=2 << 20)
        )
        loads: list = []
        eng.on_kv_loads = loads.extend
        try:
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

            async def one(j: int, p: list[int]) -> int:
                n = 0
                async for out in eng.generate_tokens(f"s{j}", p, params, peer_prefix=PeerPrefix("holder", 6 * BS)):
                    n += len(out.new_token_ids)
                return n

            tasks = [asyncio.create_task(one(j, p)) for j, p in enumerate(_followers(2))]
            while not loads:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            steps = eng.step_count
            await asyncio.sleep(0.5)
            assert eng.step_count - steps <= 1, eng.step_count - steps
            assert len(loads) == 1
            eng.kv_load_failed(loads[0].request_id)  # the holder lost it: recomputed here
            assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == [4, 4]
            # The other hit the blocks the recompute published (scheduled ones are): no fetch.
            assert len(loads) == 1
        finally:
            eng.shutdown()

    asyncio.run(main())
