"""Multi-LoRA in the engine (engine/lora/): four random peft adapters of different ranks and
targets and the base model in one batch (per adapter, gathered and grouped), token for token and logprob for logprob against
transformers + peft in float32; the prefix cache rooted by the adapter; slots, the host LRU,
load and unload; adapters refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.lora.batch import LoRABatch
from engine.lora.request import LoRARequest
from tests.engine.hf_reference import hf_greedy
from tests.engine.lora_models import ADAPTERS, load_base, save_adapter, save_tiny_llama

PROMPTS = [[5, 17, 300, 2048, 77], [1000 + i for i in range(40)], list(range(7, 7 + 60, 3))]
MAX_TOKENS = 12
# The engine's correctness contract (ARCHITECTURE.md): logprobs within 1e-3 of transformers' in
# float32. A delta differs from peft's by the rounding of one scaling folded into B (~1e-7
# relative) and of the summation order, far below it.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    save_tiny_llama(base_dir, smollm_tokenizer)
    eos = smollm_tokenizer.eos_token_id
    refs = {None: load_base(base_dir)}
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        refs[name] = save_adapter(base_dir, paths[name], seed=i + 1, **kw)
    expected = {name: [hf_greedy(m, p, MAX_TOKENS, eos) for p in PROMPTS] for name, m in refs.items()}
    return base_dir, paths, expected


def _llm(base_dir, **kw) -> LLM:
    args = dict(dtype="float32", num_blocks=96, block_size=8, max_num_batched_tokens=48, num_threads=1, max_lora_rank=8)
    return LLM(str(base_dir), enable_lora=True, **(args | kw))


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def _check(out, expected) -> None:
    ids, lps = expected
    assert out.outputs[0].token_ids == ids
    got = [lp.logprob for lp in out.outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(got, lps)) < LOGPROB_TOL


def test_adapters_change_the_output(lora_setup):
    """Each adapter's reference differs from the base's (else the tests below could not fail)."""
    _, _, expected = lora_setup
    for name in ADAPTERS:
        assert [e[0] for e in expected[name]] != [e[0] for e in expected[None]], name


# plain; plain with PyTorch's forms only (no C++ per-row op); n-gram speculation (drafts verified
# with each row's adapter); a pool so small that requests are preempted and resume (their slots
# pinned again), with PyTorch's forms.
MODES = {
    "plain": {},
    "plain-torch": {},
    # every step drafts what it finds (the adaptive policy, timed on this machine, may choose k = 0)
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}},
    "preempt": {"num_blocks": 20},
}
TORCH_FORMS = {"plain-torch", "preempt"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mixed_batch_matches_peft(lora_setup, mode, monkeypatch):
    """Four adapters and the base in one batch (interleaved, prefill chunks beside decode rows).
    Where the C++ ops are built every step computes the deltas per row in one call per linear;
    with PyTorch's forms, steps of many rows over all four use grouped matmuls, decode steps over
    two or more gather each row's weights, the others go per adapter (engine/lora/batch.py)."""
    base_dir, paths, expected = lora_setup
    loras = {name: LoRARequest(name, i + 1, str(paths[name])) for i, name in enumerate(ADAPTERS)}
    forms = []  # the form of each step's LoRA batch
    build = LoRABatch.build

    def spied_build(*args, **kwargs):
        b = build(*args, **kwargs)
        if b is not None:
            forms.append("per row" if b.rows is not None else "grouped" if b.order is not None else "per adapter")
        return b

    monkeypatch.setattr(LoRABatch, "build", staticmethod(spied_build))
    llm = _llm(base_dir, max_loras=len(ADAPTERS), **MODES[mode])
    lora = llm.engine.core.executor.runner.lora
    kernel = lora.bgmv and mode not in TORCH_FORMS
    lora.bgmv = kernel
    order = [(name, j) for j in range(len(PROMPTS)) for name in [*ADAPTERS, None]]
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[j]} for _, j in order],
        _params(),
        use_tqdm=False,
        lora_request=[loras.get(name) for name, _ in order],
    )
    for out, (name, j) in zip(outs, order):
        _check(out, expected[name][j])
    stats = llm.stats()
    assert stats["num_lora_loads"] == len(ADAPTERS)
    if mode.startswith("plain"):
        assert stats["num_steps"] < 3 * MAX_TOKENS  # one batch: every request in every step
        assert set(forms) == {"per row"} if kernel else {"grouped", "per row"} <= set(forms), forms
    if mode == "preempt":
        assert "per adapter" in forms, forms
        assert stats["num_preemptions"] > 0
    if mode == "ngram":
        assert stats["spec_num_draft_tokens"] > 0


def test_one_slot_serves_every_adapter_in_turn(lora_setup):
    """max_loras=1 with requests of every adapter waiting at once: each adapter waits for the
    slot (never a deadlock), and every output still equals the reference."""
    base_dir, paths, expected = lora_setup
    llm = _llm(base_dir, max_loras=1, max_cpu_loras=2)
    names = [*ADAPTERS, "qv", None]
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[1]}] * len(names),
        _params(),
        use_tqdm=False,
        lora_request=[LoRARequest(n, 1 + list(ADAPTERS).index(n), str(paths[n])) if n else None for n in names],
    )
    for out, name in zip(outs, names):
        _check(out, expected[name][1])
    s = llm.stats()
    assert len(s["lora_loaded"]) == 2  # the host LRU holds max_cpu_loras
    assert s["num_lora_evictions"] >= 1


def test_prefix_cache_is_rooted_by_the_adapter(lora_setup):
    base_dir, paths, _ = lora_setup
    llm = _llm(base_dir, max_loras=2, num_blocks=64)
    qv, every = (LoRARequest(n, i + 1, str(paths[n])) for i, n in enumerate(("qv", "all")))
    prompt = {"prompt_token_ids": PROMPTS[1]}  # 40 tokens: 4 full blocks of 8 may hit (not the last token)

    def cached(lora) -> int:
        (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, lora_request=lora)
        return out.num_cached_tokens

    assert cached(qv) == 0
    assert cached(qv) >= 32  # the same adapter: its blocks
    assert cached(every) == 0  # another adapter never shares them
    assert cached(None) == 0  # nor does the base model
    assert cached(every) >= 32 and cached(None) >= 32


def test_block_hash_roots_differ_per_adapter(lora_setup):
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.request import Request

    _, paths, _ = lora_setup
    kv = KVCacheManager(8, 16)
    a, b = LoRARequest("qv", 1, str(paths["qv"])), LoRARequest("all", 2, str(paths["all"]))
    roots = [kv.root_of(Request("r", [1], SamplingParams(), lora_request=x)) for x in (None, a, b, a)]
    assert roots[0] is None and len({roots[1], roots[2]}) == 2 and roots[1] == roots[3]


def test_load_and_unload(lora_setup):
    base_dir, paths, expected = lora_setup
    llm = _llm(base_dir, lora_modules=[f"qv={paths['qv']}"])
    assert [a.lora_name for a in llm.list_loras()] == ["qv"]
    eng = llm.engine
    eng.load_lora_adapter("mlp1", str(paths["mlp1"]))
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request="mlp1")
    # by name, as the serving layer passes it
    _check(out, expected["mlp1"][0])
    rid = eng.add_request(None, {"prompt_token_ids": PROMPTS[0]}, _params(), lora_request="qv")
    with pytest.raises(InvalidRequestError, match="in use"):
        llm.remove_lora("qv")
    while eng.has_unfinished_requests():
        eng.step()
    llm.remove_lora("qv")
    llm.remove_lora("mlp1")
    assert llm.list_loras() == [] and llm.stats()["lora_loaded"] == ()
    with pytest.raises(AdapterNotFoundError):
        eng.add_request(None, {"prompt_token_ids": PROMPTS[0]}, _params(), lora_request="qv")
    with pytest.raises(AdapterNotFoundError):
        llm.remove_lora("qv")
    assert rid


def test_bad_adapters_are_refused(lora_setup, tmp_path):
    base_dir, paths, _ = lora_setup
    llm = _llm(base_dir, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="not a directory"):
        llm.add_lora(LoRARequest("x", 1, str(tmp_path / "missing")))
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        llm.add_lora(LoRARequest("x", 1, str(tmp_path)))
    with pytest.raises(InvalidRequestError, match="rank 8 is larger than max_lora_rank=4"):
        llm.add_lora(LoRARequest("all", 2, str(paths["all"])))
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (dora / f).write_bytes((paths["qv"] / f).read_bytes())
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    with pytest.raises(InvalidRequestError, match="DoRA"):
        llm.add_lora(LoRARequest("dora", 3, str(dora)))
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        LLM(str(base_dir), dtype="float32", num_blocks=8, lora_modules=[f"qv={paths['qv']}"])
    assert torch.get_num_threads() >= 1


def test_an_adapter_that_cannot_be_read_fails_its_request_only(lora_setup, tmp_path):
    """Its directory emptied after it was added: the step that would load it fails, the request
    that brought it fails alone, and the slot is loaded afresh for the next user."""
    base_dir, paths, expected = lora_setup
    gone = tmp_path / "gone"
    gone.mkdir()
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (gone / f).write_bytes((paths["qv"] / f).read_bytes())
    llm = _llm(base_dir, max_loras=1)
    llm.add_lora(LoRARequest("gone", 9, str(gone)))
    (gone / "adapter_model.safetensors").unlink()
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * 2,
        _params(),
        use_tqdm=False,
        lora_request=[LoRARequest("gone", 9, str(gone)), None],
    )
    assert outs[0].outputs[0].finish_reason == "error"
    _check(outs[1], expected[None][0])
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request="gone")
    assert out.outputs[0].finish_reason == "error"
    qv = LoRARequest("qv", 1, str(paths["qv"]))
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False, lora_request=qv)
    _check(out, expected["qv"][0])


def test_load_and_unload_under_traffic(lora_setup):
    """Adapters added and removed between steps while others' requests run: each request keeps
    its adapter's output, and an adapter is removed once its requests have ended."""
    base_dir, paths, expected = lora_setup
    llm = _llm(base_dir, max_loras=2, max_cpu_loras=2)
    eng, done = llm.engine, {}

    def step() -> None:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    def submit(name: str | None, j: int) -> str:
        return eng.add_request(None, {"prompt_token_ids": PROMPTS[j]}, _params(), lora_request=name)

    eng.load_lora_adapter("qv", str(paths["qv"]))
    first = {submit("qv", 0): ("qv", 0), submit(None, 1): (None, 1)}
    step()
    eng.load_lora_adapter("all", str(paths["all"]))
    second = {submit("all", 2): ("all", 2)}
    step()
    qv_id = next(iter(first))
    while qv_id not in done:
        step()
    llm.remove_lora("qv")  # its request ended; "all" still runs
    eng.load_lora_adapter("mlp1", str(paths["mlp1"]))
    third = {submit("mlp1", 1): ("mlp1", 1)}
    while eng.has_unfinished_requests():
        step()
    for rid, (name, j) in {**first, **second, **third}.items():
        _check(done[rid], expected[name][j])
    assert sorted(a.lora_name for a in llm.list_loras()) == ["all", "mlp1"]
    assert "qv" not in llm.stats()["lora_loaded"]
