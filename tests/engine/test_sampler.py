"""Sampler and SamplingMetadata: greedy, raw logprobs, penalties, filters, seeded reproducibility."""

import pytest
import torch

from engine.kernels.cpu_ops import load_cpu_ops
from engine.layers.sampler import Sampler, argmax_rows, compute_prompt_logprobs
from engine.runner.sampling_metadata import SamplingMetadata
from engine.sampling_params import SamplingParams

torch.set_num_threads(1)
V = 64


def build(params, prompts=None, outputs=None, generators=None, eos=None):
    b = len(params)
    return SamplingMetadata.build(params, prompts or [[1, 2]] * b, outputs or [[]] * b, generators, eos)


def sample(logits, params, **kw):
    return Sampler()(logits, build(params, **kw))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_fast_path_and_ties_lowest_id():
    logits = torch.randn(5, V)
    logits[0, 3] = logits[0, 7] = 100.0  # tie -> lowest id
    md = build([SamplingParams(temperature=0.0)] * 5)
    assert md.all_greedy and not md.needs_processing and md.temperature is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.sampled_token_ids[0].item() == 3
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_ties_nan_and_tails(dtype):
    assert load_cpu_ops() is not None, "the C++ CPU ops did not build"  # the op under test, not the fallback
    torch.manual_seed(0)
    for shape in [(7, 49152), (3, 49153), (2, 17), (1, 5), (4, 16)]:
        x = torch.randn(*shape).to(dtype)
        assert argmax_rows(x).tolist() == x.argmax(-1).tolist(), shape
    x = torch.zeros(6, 1000, dtype=dtype)
    x[1, 900] = x[1, 5] = 1.0  # tie in different lanes and chunks -> lowest id
    x[2, 17] = float("nan")  # NaN wins, as in torch
    x[3, 999] = 2.0
    x[3, 998] = float("nan")  # NaN in the scalar tail
    x[4] = float("-inf")
    x[5, 48] = x[5, 32] = x[5, 16] = 3.0  # same lane, several chunks
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 5, 17, 998, 0, 16]
    wide = torch.randn(4, 64).to(dtype)
    assert argmax_rows(wide[:, :50]).tolist() == wide[:, :50].argmax(-1).tolist()  # strided rows


def test_bf16_logits_computed_in_float32():
    logits = torch.randn(3, V).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 3)
    ref = torch.log_softmax(logits.float(), -1)
    for i in range(3):
        assert abs(out.logprobs[i][0].logprob - ref[i].max().item()) < 1e-6


def test_raw_logprobs_rank_and_top_before_penalties_and_temperature():
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    params = [
        SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5, seed=1),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),  # no logprobs requested
        SamplingParams(temperature=0.0, logprobs=20, presence_penalty=1.0),
    ]
    out = sample(
        logits, params, outputs=[[5, 6], [], [1], [int(logits[3].argmax())]], generators=[gen(1), None, None, None]
    )
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        (lp,) = out.logprobs[i]
        tok = out.sampled_token_ids[i].item()
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[i, tok].item()) < 1e-6
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        k = params[i].logprobs
        vals, ids = ref[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert all(abs(a - b) < 1e-6 for (_, a), b in zip(lp.top, vals.tolist()))
    # Row 3: presence penalty moved greedy off the raw argmax, so the rank is > 1.
    assert out.logprobs[3][0].rank > 1


def test_compute_prompt_logprobs():
    logits = torch.randn(6, V)
    targets = [3, 9, 0, 63, 5, 5]
    lps = compute_prompt_logprobs(logits, targets, k=3)
    ref = torch.log_softmax(logits, -1)
    for t, (lp, tok) in enumerate(zip(lps, targets)):
        assert lp.token_id == tok and abs(lp.logprob - ref[t, tok].item()) < 1e-6
        assert len(lp.top) == 3 and lp.top[0][0] == ref[t].argmax().item()


def test_repetition_penalty_hf_semantics():
    logits = torch.zeros(1, V)
    logits[0, :6] = torch.tensor([2.0, -2.0, 3.0, -1.0, 4.0, 2.5])
    # prompt sees 0, 1; output sees 2, 3. Token 4 (unseen) keeps 4.0 and wins over 3/1.5=2.0.
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    md = build([p], prompts=[[0, 1]], outputs=[[2, 3]])
    from engine.layers.sampler import apply_penalties

    x = logits.clone()
    apply_penalties(x, md)
    assert x[0, :6].tolist() == [1.0, -4.0, 1.5, -2.0, 4.0, 2.5]
    # Penalized 4 -> 2.0 < 2.5: greedy picks 5.
    out = sample(logits, [p], prompts=[[0, 1]], outputs=[[2, 3, 4]])
    assert out.sampled_token_ids.item() == 5


def test_presence_and_frequency_penalties_openai_semantics():
    from engine.layers.sampler import apply_penalties

    logits = torch.zeros(2, V)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0),
    ]  # neutral row in a penalized batch: untouched
    md = build(params, prompts=[[9, 9, 9], [1]], outputs=[[1, 1, 1, 2], [1, 1]])
    assert md.prompt_token_ids is None  # not needed without repetition penalty
    apply_penalties(logits, md)
    assert logits[0, 1].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert logits[0, 2].item() == pytest.approx(-(0.5 + 1 * 0.25))
    assert logits[0, 9].item() == 0.0  # prompt tokens are not penalized by OpenAI penalties
    assert torch.count_nonzero(logits[1]).item() == 0


def test_no_penalty_tensors_when_unused():
    md = build([SamplingParams(temperature=0.5)] * 3)
    assert md.repetition_penalty is None and md.output_token_ids is None
    assert md.top_k is None and md.top_p is None and md.min_p is None


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.zeros(3, V)
    logits[:, 2] = 50.0  # EOS
    logits[:, 7] = 40.0  # stop token id
    logits[:, 11] = 30.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=1),
    ]
    out = sample(logits, params, outputs=[[5], [5, 5, 5], []], eos=[2, 2, 2])
    assert out.sampled_token_ids.tolist() == [11, 2, 7]
    # Also for random rows: EOS never sampled while blocked.
    p = SamplingParams(temperature=1.0, min_tokens=2, seed=0)
    logits = torch.zeros(1, V)
    logits[0, 2] = 5.0
    for s in range(50):
        ids = sample(logits, [p], generators=[gen(s)], eos=[[2, 3]]).sampled_token_ids
        assert ids.item() not in (2, 3)


def support(logits_row, p, draws=400):
    g = gen(1234)
    seen = set()
    for _ in range(draws):
        seen.add(sample(logits_row, [p], generators=[g]).sampled_token_ids.item())
    return seen


def test_top_k_support():
    logits = torch.linspace(0, 2, V).unsqueeze(0)  # increasing: the top-5 are the last 5 ids
    assert support(logits, SamplingParams(temperature=1.0, top_k=5, seed=1)) == set(range(V - 5, V))


def test_top_p_support():
    logits = torch.full((1, V), -10.0)
    logits[0, :4] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # Nucleus of 0.7: {0, 1} (0.5 < 0.7, 0.8 >= 0.7).
    assert support(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=1)) == {0, 1}
    assert support(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=1)) == {0, 1, 2}


def test_min_p_support():
    logits = torch.full((1, V), -10.0)
    logits[0, :4] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # Allowed: prob >= 0.4 * 0.4 = 0.16 -> {0, 1, 2}.
    assert support(logits, SamplingParams(temperature=1.0, min_p=0.4, seed=1)) == {0, 1, 2}


def test_temperature_changes_distribution():
    logits = torch.tensor([[2.0, 1.0] + [-1e9] * (V - 2)])
    g = gen(0)
    hits = sum(
        sample(logits, [SamplingParams(temperature=0.25)], generators=[g]).sampled_token_ids.item() == 0
        for _ in range(300)
    )
    # p(0) = sigmoid(4) ~ 0.982 at T=0.25 (vs 0.73 at T=1).
    assert hits > 280


def test_sampling_matches_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.full((1, V), -1e9)
    logits[0, :3] = probs.log()
    g = gen(7)
    n = 2000
    counts = torch.zeros(3)
    md = build([SamplingParams(temperature=1.0)], generators=[g])
    for _ in range(n):
        counts[Sampler()(logits, md).sampled_token_ids.item()] += 1
    assert torch.allclose(counts / n, probs, atol=0.04)


def test_seeded_row_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    steps = 6
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=42)
    target_logits = [torch.randn(V) for _ in range(steps)]

    def run(batch_size, position, other_seed):
        torch.manual_seed(other_seed)
        g = gen(42)
        others = [
            SamplingParams(
                temperature=float(t), top_k=int(k), min_p=0.05, repetition_penalty=1.3, seed=(s if s % 2 else None)
            )
            for t, k, s in zip(
                torch.rand(batch_size - 1) * 2, torch.randint(0, 10, (batch_size - 1,)), range(batch_size - 1)
            )
        ]
        other_gens = [gen(1000 + i) if p.seed is not None else None for i, p in enumerate(others)]
        ids = []
        for step in range(steps):
            logits = torch.randn(batch_size, V) * 2
            params = others[:position] + [target] + others[position:]
            gens = other_gens[:position] + [g] + other_gens[position:]
            logits[position] = target_logits[step]
            md = SamplingMetadata.build(params, [[1, 2, 3]] * batch_size, [[4, 5]] * batch_size, gens, [2] * batch_size)
            ids.append(Sampler()(logits, md).sampled_token_ids[position].item())
        return ids

    alone = run(1, 0, 0)
    assert run(17, 0, 1) == alone
    assert run(17, 9, 2) == alone
    assert run(17, 16, 3) == alone
    assert len(set(alone)) > 1  # really random, not a degenerate argmax


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(temperature=2.0),
    ]
    g_greedy = gen(5)
    state = g_greedy.get_state()
    out = sample(logits, params, generators=[None, gen(3), g_greedy, None])
    ids = out.sampled_token_ids.tolist()
    assert ids[0] == logits[0].argmax().item() and ids[2] == logits[2].argmax().item()
    # A seeded greedy row does not consume its generator.
    assert torch.equal(g_greedy.get_state(), state)
    assert 0 <= ids[1] < V and 0 <= ids[3] < V
