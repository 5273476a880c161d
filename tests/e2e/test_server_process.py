"""The whole product as a user starts it: `orbital serve` in its own process (what `make run`
does), the official openai client against it, then the load tester's short run against the
same server writing a result file and plots. The server is stopped with SIGINT, as Ctrl-C, and
must be gone within 30 s even though it starts with SIGINT ignored, as under nohup or a
supervisor that ignores it (Python then never raises KeyboardInterrupt on its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.net import free_port, listening_pid
from tests.router.conftest import disconnect_frees_blocks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    env = dict(os.environ)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
            "--num-cpus",
            "2",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--max-model-len",
            "2048",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited early:\n{log.read()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("server did not become healthy in 240 s")
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail("the server ignored SIGINT for 30 s")
        finally:
            log.close()


def test_openai_client_against_the_server_process(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="none")
    models = [m.id for m in client.models.list().data]
    out = client.completions.create(model=models[0], prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.choices[0].text.startswith(" Paris")
    assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"


def test_the_router_replica_serves_the_port_itself(server):
    """No proxy between the client and the router on the local cluster `orbital serve` starts
    (router/direct_ingress.py): the socket listening on the port is the Ingress replica's."""
    pid = listening_pid(int(server.rsplit(":", 1)[1]))
    assert pid is not None
    title = open(f"/proc/{pid}/cmdline", "rb").read()
    assert b"ServeReplica:orbital:Ingress" in title, title


def test_streams_and_disconnects_through_the_router_replicas_own_server(server):
    """Streaming and a client leaving mid-stream, with the router replica serving HTTP itself:
    the request is aborted and its KV blocks return (Serve's proxy did that relay before)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="none")
    model = client.models.list().data[0].id
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, stream=True, temperature=0
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    disconnect_frees_blocks(server)


def test_loadtest_short_run_writes_results_and_plots(server, tmp_path):
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    cmd = [
        sys.executable,
        "-m",
        "loadtest",
        "run",
        "--base-url",
        server,
        "-n",
        "4",
        "--concurrency",
        "2",
        "--output-tokens",
        "8",
        "--workload",
        "mixed",
        "--out",
        str(out),
        "--plots",
        str(plots),
        "--timeout",
        "120",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    records = data["requests"]
    assert len(records) == 4
    assert all(r["success"] and r["error_kind"] is None for r in records), records
    assert all(r["output_tokens"] == 8 and r["ttft"] > 0 for r in records)
    pngs = list(plots.glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
