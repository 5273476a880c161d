"""The router needs the model's tokenizer and config, never its weights: where the model path
does not exist (a head node; the weights are on the GPU nodes), the ingress gets them from an
engine replica. Here the engine replicas run in a Ray working_dir that holds the model, named by
a relative path the ingress cannot resolve."""

from __future__ import annotations

import shutil

import httpx
import pytest

from engine.model.text_side import materialise_text_side, text_side_files
from tests.router.conftest import BASE
from tests.tiny_llama import save_tiny_llama

MODEL = "tiny-model-on-engine-nodes-only"


def test_text_side_files_leave_the_weights_out(tmp_path):
    d = save_tiny_llama(tmp_path / "m")
    files = text_side_files(d)
    assert "config.json" in files and not any(n.endswith(".safetensors") for n in files)
    a, b = materialise_text_side(files, tmp_path / "cache"), materialise_text_side(files, tmp_path / "cache")
    assert a == b and sorted(p.name for p in a.iterdir()) == sorted(files)
    with pytest.raises(ValueError):
        materialise_text_side({"../config.json": b"{}"}, tmp_path / "cache")


@pytest.mark.slow
def test_ingress_gets_the_tokenizer_from_an_engine_replica(serve_cluster, tmp_path, smollm_dir):
    from ray import serve

    from router.app import build_app
    from router.config import AppConfig

    workdir = tmp_path / "engine-node"
    save_tiny_llama(workdir / MODEL, tokenizer_from=smollm_dir, vocab_size=49152)  # chat tokens
    shutil.copy(smollm_dir / "chat_template.jinja", workdir / MODEL)
    # A deployment's working_dir must be a URI (a zip with one top-level directory).
    package = shutil.make_archive(str(tmp_path / "engine-node"), "zip", tmp_path, "engine-node")
    cfg = AppConfig(**BASE, model=MODEL, max_model_len=256, engine_runtime_env={"working_dir": f"file://{package}"})
    serve.run(build_app(cfg), name="textside", route_prefix="/textside")
    try:
        url = f"{serve_cluster['url']}/textside"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]] == [MODEL]
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["model"] == MODEL
    finally:
        serve.delete("textside")
