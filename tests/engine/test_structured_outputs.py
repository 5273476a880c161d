"""Structured outputs (engine/structured/) and logit_bias on the embedded model in float32:
every output matches its JSON schema, regex, choice or grammar, also sampled, with n-gram
drafts (identical to drafting off), through preemption and when resumed; bad specs are
refused up front; every KV block goes back to the pool. A grammar held back until the output
contains a token sequence (a reasoning model's `</think>`) leaves the output free up to it and
holds the rest, also with drafts that cross it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.layers.sampler import Sampler
from engine.runner.sampling_metadata import SamplingMetadata
from engine.structured.matcher import bitmask_width
from engine.structured.spec import StructuredOutput

# Engines or Serve apps per test: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]?/'
GBNF = 'root ::= "yes" | "no"'
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _llm(**kw) -> LLM:
    return LLM(dtype="float32", num_threads=2, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def llm():
    llm = _llm(kv_cache_memory_bytes=32 << 20)
    yield llm
    llm.shutdown()


def _check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "city"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 24
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    assert obj["city"] in ("Paris", "Rome", "Oslo")


def _check_pool(llm: LLM) -> None:
    sched = llm.engine.core.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_used_blocks() == 0


# --- the spec: refused up front ------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, value, needle",
    [
        ("json", {"type": "bogus"}, "bogus"),
        ("json", "{not json", "not JSON"),
        ("json", [1, 2], "must be an object"),
        ("regex", "a(b", "unclosed group"),
        ("choice", [], "non-empty list"),
        ("choice", ["a", 3], "non-empty list"),
        ("grammar", "start: undefined_rule", "unknown name"),
        ("grammar", 'root ::= "a', "GBNF"),
        ("grammar", "", "non-empty string"),
        ("xml", "<a/>", "kind must be one of"),
        ("regex", "a" * 70000, "longer than"),
    ],
)
def test_bad_specs_are_refused_with_the_field_named(kind, value, needle):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput(kind, value, param="response_format")
    assert needle in str(e.value) and e.value.param == "response_format"
    assert str(e.value).startswith("response_format: ")


def test_sampling_params_checks():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutput("json_object"))
    for bias in ({5: 101.0}, {5: float("nan")}, {-1: 1.0}, {"5": 1.0}, {5: True}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=bias)
        assert e.value.param == "logit_bias"


# --- the sampler -----------------------------------------------------------------------------


def _bitmask(v: int, allowed: list[int]) -> torch.Tensor:
    words = np.zeros(bitmask_width(v), dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_sampler_masks_rows_and_adds_bias_after_raw_logprobs():
    v = 100
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(dim=-1)
    # Row 0 may take only 31, 63 (bit 31 of a word: the sign bit) and 99; row 1 is unconstrained
    # but biased towards 7; row 2 neither.
    params = [
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0),
    ]
    md = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, bitmasks=[_bitmask(v, [31, 63, 99]), None, None])
    out = Sampler()(logits.clone(), md)
    allowed = torch.tensor([31, 63, 99])
    assert out.sampled_token_ids[0] == allowed[logits[0, allowed].argmax()]
    assert out.sampled_token_ids[1] == 7
    assert out.sampled_token_ids[2] == top[2]
    # Logprobs are the raw distribution's, as for every other processing step.
    assert out.logprobs[0][0].logprob == pytest.approx(
        torch.log_softmax(logits[0], -1)[out.sampled_token_ids[0]].item(), abs=1e-6
    )
    # Sampled rows never leave the mask either.
    md = SamplingMetadata.build(
        [SamplingParams(temperature=1.5, seed=s) for s in range(8)],
        [[1]] * 8,
        [[]] * 8,
        [torch.Generator().manual_seed(s) for s in range(8)],
        bitmasks=[_bitmask(v, [31, 63, 99])] * 8,
    )
    assert set(Sampler()(logits[:1].repeat(8, 1), md).sampled_token_ids.tolist()) <= {31, 63, 99}


# --- the engine ------------------------------------------------------------------------------


def test_outputs_match_their_specs_greedy_and_sampled(llm):
    prompts = [
        CHAT.format("Describe a person living in a European city, as JSON."),
        CHAT.format("Give me any JSON object about cats."),
        CHAT.format("What is the phone number of the city hall?"),
        CHAT.format("Is 'I loved this film' positive, negative or neutral?"),
        CHAT.format("What is six times seven?"),
        CHAT.format("Do cats fly?"),
    ]
    specs = [
        StructuredOutput("json", PERSON),
        StructuredOutput("json_object"),
        StructuredOutput("regex", PHONE),
        StructuredOutput("choice", CHOICES),
        StructuredOutput("grammar", LARK),
        StructuredOutput("grammar", GBNF),
    ]
    greedy = [SamplingParams(temperature=0, max_tokens=80, structured_output=s) for s in specs]
    sampled = [SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=80, structured_output=s) for s in specs]
    for params in (greedy, sampled):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, out in enumerate(outs):
            for c in out.outputs:  # an open-ended JSON object may run to max_tokens
                assert c.finish_reason == "stop" or (i == 1 and c.finish_reason == "length"), c
        for c in outs[0].outputs:
            _check_person(c.text)
        for c in outs[1].outputs:
            assert isinstance(json.loads(c.text), dict) if c.finish_reason == "stop" else c.text.startswith("{")
        for c in outs[2].outputs:
            assert re.fullmatch(PHONE, c.text), c.text
        for c in outs[3].outputs:
            assert c.text in CHOICES
        for c in outs[4].outputs:
            assert re.fullmatch(r"The answer is [1-9][0-9]?\.", c.text), c.text
        for c in outs[5].outputs:
            assert c.text in ("yes", "no")
    # Unconstrained, the first prompt's greedy answer is prose, not the schema's JSON: the
    # mask is what made it match.
    free = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0]
    with pytest.raises(Exception):
        _check_person(free.outputs[0].text)
    _check_pool(llm)


def test_ignore_eos_ends_with_the_grammar_and_length_cuts(llm):
    p = CHAT.format("Is the sky blue?")
    out = llm.generate(
        [p, p],
        [
            SamplingParams(
                temperature=0,
                max_tokens=50,
                ignore_eos=True,
                structured_output=StructuredOutput("choice", ["yes", "no"]),
            ),
            SamplingParams(temperature=0, max_tokens=3, structured_output=StructuredOutput("json", PERSON)),
        ],
        use_tqdm=False,
    )
    assert out[0].outputs[0].text in ("yes", "no") and out[0].outputs[0].finish_reason == "stop"
    cut = out[1].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    _check_pool(llm)


def test_logit_bias(llm):
    p = "The capital of France is"
    base = llm.generate([p], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    first = base.token_ids[0]
    forced = llm.tokenizer(" Rome", add_special_tokens=False).input_ids[0]
    outs = llm.generate(
        [p, p],
        [
            SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100.0}),
            SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100.0}),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == [forced] * 4
    assert first not in outs[1].outputs[0].token_ids


def test_drafts_keep_the_output_identical(llm):
    """n-gram drafts for a constrained request are cut to what its grammar allows, and each
    draft position is sampled under the mask after the drafts before it."""
    spec = _llm(
        kv_cache_memory_bytes=32 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    )
    try:
        example = '{"name": "Ann Lee", "age": 31, "city": "Oslo"}'
        prompts = [
            CHAT.format(f"Copy this JSON exactly: {example} {example}"),
            CHAT.format("Describe a person as JSON."),
        ]
        params = [
            SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutput("json", PERSON)),
            SamplingParams(temperature=0.8, seed=7, max_tokens=60, structured_output=StructuredOutput("json", PERSON)),
        ]
        ref = llm.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        for a, b in zip(ref, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            _check_person(b.outputs[0].text)
        stats = spec.stats()
        assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
        _check_pool(spec)
    finally:
        spec.shutdown()


def test_preemption_keeps_the_grammar(llm):
    small = _llm(num_blocks=14, block_size=16, max_num_batched_tokens=256)
    try:
        prompts = [CHAT.format(f"Describe person number {i} as JSON, with a long name.") for i in range(6)]
        params = SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutput("json", PERSON))
        ref = llm.generate(prompts, params, use_tqdm=False)
        got = small.generate(prompts, params, use_tqdm=False)
        assert small.stats()["num_preemptions"] > 0
        for a, b in zip(ref, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            _check_person(b.outputs[0].text)
        _check_pool(small)
    finally:
        small.shutdown()


def test_resumed_request_continues_in_its_grammar(llm):
    """A request moved from another replica (`resume`) starts its grammar past the output it
    brings; output the grammar refuses is a 400, not a stuck request."""
    p = CHAT.format("Describe a person as JSON.")
    params = SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutput("json", PERSON))
    whole = llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = llm.tokenizer(p, add_special_tokens=False).input_ids
    (req,) = llm.engine.inputs.make_requests("r", ids, params, resume={"r": whole[:5]})
    allowed = req.grammar.bitmasks([])[0]
    nxt = whole[5]
    assert (allowed[nxt // 32].item() >> (nxt % 32)) & 1
    with pytest.raises(InvalidRequestError, match="too costly"):  # its first mask exhausts the limits
        llm.engine.inputs.make_requests(
            "t", ids, SamplingParams(structured_output=StructuredOutput("regex", "x{300000}"))
        )
    with pytest.raises(InvalidRequestError, match="resume"):
        llm.engine.inputs.make_requests("s", ids, params, resume={"s": llm.tokenizer("hello").input_ids})


def test_cli_flags(capsys):
    from engine.cli import main

    argv = ["--prompt", "Call me at", "--regex", PHONE, "--json", "--max-tokens", "20", "--dtype", "float32"]
    assert main([*argv, "--threads", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert re.fullmatch(PHONE, out["text"]) and out["finish_reason"] == "stop"
    assert main(["--prompt", "hi", "--regex", "a("]) == 2  # refused before the model loads
    assert "--regex: is not a valid regex" in capsys.readouterr().err


def test_a_grammar_costly_past_its_start_fails_alone(llm):
    """`(Q|R)x{100000}` passes admission (its first mask is cheap); its second mask runs out of
    the lexer's fuel: that request ends with an explicit error, the one beside it is untouched."""
    p = CHAT.format("Say something.")
    params = [
        SamplingParams(temperature=0, max_tokens=20, structured_output=StructuredOutput("regex", "(Q|R)x{100000}")),
        SamplingParams(temperature=0, max_tokens=20, structured_output=StructuredOutput("regex", PHONE)),
    ]
    bad, good = llm.generate([p, p], params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "grammar failed" in bad.error, bad.error
    assert good.error is None and re.fullmatch(PHONE, good.outputs[0].text)
    _check_pool(llm)


# --- a grammar that starts after a token sequence (a reasoning model's `</think>`) -------------

CITY_HALL = CHAT.format("What is the phone number of the city hall?")
COPY = CHAT.format('Copy this JSON exactly: {"name": "Ann Lee", "age": 31, "city": "Oslo"} ' * 2)


def _free(llm, prompt: str, max_tokens: int = 40):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]


def _after(so: StructuredOutput, after, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw}, structured_output=so.starting_after(after))


def test_a_grammar_after_a_sequence_starts_right_after_it(llm):
    """The greedy answer is `The phone number of the city hall is 123-456-7890.`; a phone regex
    that starts after its tokens " number", " of" leaves those 4 tokens as they were and holds
    every token after them; held from the start the output is the phone number alone."""
    free = _free(llm, CITY_HALL)
    after = free.token_ids[2:4]
    assert llm.tokenizer.decode(free.token_ids[:4]) == "The phone number of", free.text
    out = llm.generate([CITY_HALL], _after(StructuredOutput("regex", PHONE), after), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids[:4] and out.finish_reason == "stop", out
    assert out.text.startswith("The phone number of") and re.fullmatch(PHONE, out.text[19:]), out.text
    whole = llm.generate([CITY_HALL], _after(StructuredOutput("regex", PHONE), ()), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(PHONE, whole.text), whole.text
    _check_pool(llm)


def test_a_grammar_whose_sequence_never_comes_holds_nothing(llm):
    """The sequence is not in the output: it is the free greedy output, to its EOS or cut by
    max_tokens (finish_reason "length"); the sequence in the prompt alone does not start it."""
    free = _free(llm, CITY_HALL)
    paris = llm.tokenizer(" Paris", add_special_tokens=False).input_ids
    in_prompt = llm.tokenizer(" city hall?", add_special_tokens=False).input_ids
    assert in_prompt[-1] not in free.token_ids
    for after in (paris, in_prompt[-1:]):
        so = StructuredOutput("json", PERSON)
        out = llm.generate([CITY_HALL], _after(so, after), use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (free.token_ids, free.finish_reason) == (free.token_ids, "stop")
        cut = llm.generate([CITY_HALL], _after(so, after, max_tokens=5), use_tqdm=False)[0].outputs[0]
        assert (cut.token_ids, cut.finish_reason) == (free.token_ids[:5], "length")
    _check_pool(llm)


def test_a_waiting_matcher_frees_drafts_up_to_the_sequence(llm):
    """Drafts that complete the sequence are free up to its end; the drafts after it are held to
    the grammar from its start, and the step's mask rows say the same."""
    gt, tok = llm.engine.inputs.grammar_tokenizer, llm.tokenizer
    so = StructuredOutput("regex", PHONE)
    a, b = tok(" number of", add_special_tokens=False).input_ids
    phone = tok("(555) 123-4567", add_special_tokens=False).input_ids
    junk = tok(" hello", add_special_tokens=False).input_ids
    m, start = gt.matcher(so.grammar, "p", (a, b)), gt.matcher(so.grammar, "p")
    assert m.waiting and m.valid_prefix(junk + [a] + junk) == len(junk) + 2
    assert m.step_masks([]) is None and m.step_masks(junk) is None
    drafts = junk + [a, b] + phone
    assert m.valid_prefix(drafts + junk) == len(drafts)  # after the phone: only its end
    rows = m.step_masks(drafts)
    k = len(junk) + 2
    assert rows.shape[0] == 1 + len(drafts) and bool((rows[:k] == -1).all())
    assert torch.equal(rows[k:], start.bitmasks(phone))
    late = [b] + phone + junk  # b alone does not complete (a, b): all free
    assert m.valid_prefix(late) == len(late) and m.step_masks(late) is None
    # The sequence split between emitted tokens and a draft: free up to b, then held.
    assert m.accept(a) and m.waiting and not m.is_stopped()
    assert m.valid_prefix(late) == 1 + len(phone)
    assert torch.equal(m.step_masks([b])[1], start.bitmasks([])[0])
    assert m.accept(b) and not m.waiting
    assert torch.equal(m.step_masks([]), start.bitmasks([])) and m.valid_prefix(junk) == 0
    assert not m.accept(junk[0])  # held: refused
    for bad in ([-1], ["a"], [True], [1] * 33):
        with pytest.raises(InvalidRequestError, match="after_token_ids"):
            StructuredOutput("regex", PHONE, after_token_ids=bad)


def test_drafts_across_the_sequence_keep_the_output_identical(llm, monkeypatch):
    """n-gram drafts copied from the prompt cross the point where the grammar starts (the
    greedy copy's `"age": `), some accepted past it; the output equals drafting off."""
    from engine.structured.matcher import GrammarMatcher

    free = _free(llm, COPY, 30)
    after = free.token_ids[19:21]
    prefix = llm.tokenizer.decode(free.token_ids[:21])
    pairs = list(zip(free.token_ids, free.token_ids[1:]))
    assert prefix.endswith('"age": ') and pairs.index(tuple(after)) == 19, prefix  # its first place
    crossed = []
    valid_prefix = GrammarMatcher.valid_prefix

    def recording(self, drafts):
        n = valid_prefix(self, drafts)
        if self.waiting and self._free(drafts) not in (None, n):
            crossed.append((list(drafts), n))  # complete the sequence, then some of the grammar
        return n

    monkeypatch.setattr(GrammarMatcher, "valid_prefix", recording)
    spec = _llm(
        kv_cache_memory_bytes=32 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    )
    try:
        params = [
            _after(StructuredOutput("regex", r"[0-9]+,"), after),
            _after(StructuredOutput("json", PERSON), after, max_tokens=60),
        ]
        ref = llm.generate([COPY, COPY], params, use_tqdm=False)
        crossed.clear()
        got = spec.generate([COPY, COPY], params, use_tqdm=False)
        assert crossed, "no draft crossed the sequence"
        for a, b in zip(ref, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert b.outputs[0].token_ids[:21] == free.token_ids[:21]
        assert got[0].outputs[0].text == prefix + "31,"
        _check_person(got[1].outputs[0].text[len(prefix) :])
        _check_pool(spec)
    finally:
        spec.shutdown()
