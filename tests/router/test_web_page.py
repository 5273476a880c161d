"""The web page at GET / (router/ingress/web/index.html) and the state it shows
(GET /cluster/state, router/ingress/cluster_state.py).

Without Ray: the page is HTML whose inline script and style the Content-Security-Policy allows by
hash, the wheel ships it, and a pool's state keeps a failed replica (unhealthy, no load) next to
a healthy one, in the documented shape.

End to end (slow): an app of the chat stand-in with two engine replicas and an API key, driven
over HTTP and through a real headless Chromium (Debian's chromium and chromedriver, through
Selenium). The page loads; without the key its state panel shows the 401, with the key (kept in
localStorage) it lists the replicas /health counts; a message streams, in several updates, the
answer a non-streamed greedy chat completion gives for the same messages (a second turn
carries the first); an API error is shown in the conversation."""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import re
import tomllib
from pathlib import Path

import httpx
import pytest

from engine.stats import EngineStats
from router.ingress.cluster_state import pool_state
from router.ingress.response_models import ClusterState
from router.ingress.web_page import PAGE, web_page
from tests.router.conftest import BASE

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
MODEL = "stand-in"
KEY = "page-test-key"
MAX_TOKENS = 24
# Without the background-networking switches Chromium stalls on its refused connections (no network).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)


# --- without Ray --------------------------------------------------------------------------------


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def test_the_page_is_html_whose_script_the_policy_allows():
    r = web_page()
    html = r.body.decode("utf-8")
    assert r.media_type == "text/html" and "<title>Orbital</title>" in html
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.S)
    assert len(scripts) == 1 and "v1/chat/completions" in scripts[0] and "cluster/state" in scripts[0]
    assert len(styles) == 1
    # Nothing from another origin: no script or style source, no URL with a scheme.
    assert not re.search(r"<script[^>]*\ssrc=|<link[^>]*stylesheet|https?://", html)
    policy = dict(p.strip().split(" ", 1) for p in r.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["script-src"] == _sha256(scripts[0]) and policy["style-src"] == _sha256(styles[0])
    # A changed script would not run under this policy: the check can fail.
    assert _sha256(scripts[0] + " ") != policy["script-src"]


def test_the_wheel_ships_the_page():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    inside = PAGE.relative_to(ROOT / "router").as_posix()
    assert any(fnmatch.fnmatch(inside, pattern) for pattern in package_data["router"]), inside


def _replica_stats(replica_id: str, **figures) -> dict:
    """A replica's `stats()` as router/replica/replica_stats.py builds it (the parts the state reads)."""
    return {
        **EngineStats(**figures).as_dict(),
        "prompt_tokens": 40,
        "generation_tokens": 7,
        "replica_id": replica_id,
        "node_id": "node-1",
        "queue": {"queued": 1, "in_flight": 2, "rejected": 0},
    }


def test_pool_state_keeps_a_failed_replica():
    up = _replica_stats(
        "r1",
        num_running=2,
        num_blocks=10,
        blocks_used=4,
        kv_usage=0.4,
        prefix_cache_queries=30,
        prefix_cache_hits=12,
        prefix_hit_rate=0.4,
    )
    checks = [("r1", None), ("r2", RuntimeError("the engine loop is not running\nTraceback ..."))]
    stats = [("r1", up), ("r2", TimeoutError())]
    router = {"queued": 0, "in_flight": 1, "rejected": 3, "migrations": 0, "migration_failures": 0}
    health = {"status": "unavailable", "replicas": 2, "expected_replicas": 2, "unhealthy": ["r2"]}
    routing = {"r1": {"routed": 5, "predicted_cached_tokens": 16, "actual_cached_tokens": 16}}
    pool = pool_state("m", None, health, checks, stats, router, routing)
    state = ClusterState.model_validate({"status": "unavailable", "pools": [pool]})
    r1, r2 = state.pools[0].replicas
    assert (r1.replica_id, r1.healthy, r1.error, r1.node_id) == ("r1", True, None, "node-1")
    assert r1.load.kv_usage == 0.4 and r1.load.prefix_hit_rate == 0.4 and r1.load.in_flight == 2
    assert r1.routing.routed == 5
    assert (r2.healthy, r2.load, r2.routing) == (False, None, None)
    assert r2.error == "RuntimeError: the engine loop is not running"
    totals = state.pools[0].totals
    assert (totals.num_running, totals.kv_usage, totals.prefix_hit_rate) == (2, 0.4, 0.4)
    assert state.pools[0].router.rejected == 3


# --- end to end -----------------------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def app(chat_stand_in, tmp_path_factory):
    from tests.serve_cluster import serve_app

    key_file = tmp_path_factory.mktemp("page-key") / "api-key"
    key_file.write_text(KEY + "\n")
    with serve_app(
        "page",
        "/page",
        **BASE,
        model=chat_stand_in,
        served_model_name=MODEL,
        num_replicas=2,
        api_key_file=str(key_file),
    ) as a:
        yield a


def _chat(url: str, messages: list[dict], **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def _state(url: str) -> ClusterState:
    r = httpx.get(f"{url}/cluster/state", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    return ClusterState.model_validate(r.json())


@pytest.mark.slow
def test_page_and_state_over_http(app):
    url = app["url"]
    for page_url in (url, f"{url}/"):  # the route prefix with and without its slash (redirected to it)
        r = httpx.get(page_url, timeout=30, follow_redirects=True)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (page_url, r.text[:200])
        assert str(r.url) == f"{url}/", r.history
        assert "<script>" in r.text and "content-security-policy" in r.headers
    # The state is behind the key, in the OpenAI error shape.
    r = httpx.get(f"{url}/cluster/state", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    health = httpx.get(f"{url}/health", timeout=30).json()
    before = _state(url)
    assert before.status == "ok" and [p.name for p in before.pools] == [MODEL]
    pool = before.pools[0]
    assert len(pool.replicas) == health["replicas"] == pool.expected_replicas == 2
    assert all(rep.healthy and rep.load is not None for rep in pool.replicas)
    # The figures are the replicas' own: one request adds its tokens and one routing decision.
    answer = _chat(url, [{"role": "user", "content": "Count the waves."}])
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    after = _state(url).pools[0]

    def total(state, key: str) -> int:
        return sum(getattr(rep.load, key) for rep in state.replicas)

    def routed(state) -> int:
        return sum(rep.routing.routed for rep in state.replicas if rep.routing is not None)

    assert total(after, "prompt_tokens") - total(pool, "prompt_tokens") == usage["prompt_tokens"]
    assert total(after, "generation_tokens") - total(pool, "generation_tokens") == usage["completion_tokens"]
    assert routed(after) - routed(pool) == 1
    assert after.totals.prefix_cache_queries == total(after, "prefix_cache_queries")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, until, timeout: float = 60.0, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(until, message)


def _text(driver, css: str) -> str:
    """textContent (exact, whitespace kept) of the first element matching `css`; "" with none."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)


def _open(driver, url: str, key: str | None) -> None:
    """The page with `key` stored (None: none), as a user who typed it earlier would have it."""
    driver.get(url)
    driver.execute_script(
        "arguments[0] === null ? localStorage.removeItem('orbital.apiKey')"
        " : localStorage.setItem('orbital.apiKey', arguments[0]);",
        key,
    )
    driver.refresh()
    _wait(driver, lambda d: d.title == "Orbital")


def _set(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


@pytest.mark.slow
def test_the_state_panel_shows_the_replicas(app, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url = app["url"]
    _open(browser, url, None)
    refused = httpx.get(f"{url}/cluster/state", timeout=30).json()["error"]["message"]
    _wait(browser, lambda d: refused in _text(d, "#state-error"), message="the 401 is not shown")
    assert browser.find_elements(By.CSS_SELECTOR, "tr.replica") == []

    _set(browser, "api-key", KEY)
    browser.find_element(By.ID, "api-key").send_keys(Keys.TAB)  # `change`: stored, models and state load
    health = httpx.get(f"{url}/health", timeout=30).json()
    listed = "the panel does not list the replicas /health counts"
    rows = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'.pool[data-pool="{MODEL}"] tr.replica'))
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.replica")) == health["replicas"], message=listed)
    ids = {r.get_attribute("data-replica-id") for r in browser.find_elements(By.CSS_SELECTOR, "tr.replica")}
    assert ids == {rep.replica_id for rep in _state(url).pools[0].replicas} and len(rows) == 2
    assert {r.get_attribute("data-healthy") for r in browser.find_elements(By.CSS_SELECTOR, "tr.replica")} == {"true"}
    assert _text(browser, "#state-error") == ""
    _wait(browser, lambda d: [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#model option")])
    assert [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")] == [MODEL]

    # The key outlives a reload.
    browser.refresh()
    _wait(browser, lambda d: d.find_element(By.ID, "api-key").get_attribute("value") == KEY)
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.replica")) == health["replicas"], message=listed)


LAST_ANSWER = """const all = document.querySelectorAll('.msg.assistant');
const m = all[all.length - 1];
return {count: all.length, done: m.dataset.done === 'true', failed: m.dataset.failed === 'true',
        content: m.querySelector('.content').textContent, error: m.querySelector('.error').textContent};"""


def _send(driver, text: str) -> dict:
    """Sends `text` from the page; once its answer is done returns the answer's `content`,
    `error`, `failed`, and `seen`: its distinct contents while it streamed."""
    from selenium.webdriver.common.by import By

    driver.execute_script(
        """window.seen = [];
        new MutationObserver(() => {
          const all = document.querySelectorAll('.msg.assistant .content');
          const c = all.length ? all[all.length - 1].textContent : '';
          if (c && window.seen[window.seen.length - 1] !== c) window.seen.push(c);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});"""
    )
    n = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    _set(driver, "prompt", text)
    driver.find_element(By.ID, "send").click()
    _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == n + 1)
    answer = _wait(driver, lambda d: (a := d.execute_script(LAST_ANSWER))["done"] and a, 120, "no end of the answer")
    return {**answer, "seen": driver.execute_script("return window.seen;")}


@pytest.mark.slow
def test_a_message_streams_the_greedy_answer(app, browser):
    url = app["url"]
    _open(browser, url, KEY)
    _wait(browser, lambda d: _text(d, "#model option") == MODEL)
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", str(MAX_TOKENS))

    first = "Tell me about the sea."
    want = _chat(url, [{"role": "user", "content": first}])
    assert want.status_code == 200, want.text
    want_text = want.json()["choices"][0]["message"]["content"]
    assert want_text  # the comparison below means something
    got = _send(browser, first)
    assert not got["failed"] and got["error"] == "", got
    assert got["content"] == want_text
    assert len(got["seen"]) >= 2 and got["seen"][-1] == want_text, got["seen"]  # it arrived in pieces
    assert _text(browser, "#messages > .msg.user .content") == first

    # The second turn carries the first.
    second = "And the sky?"
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": want_text},
        {"role": "user", "content": second},
    ]
    want2 = _chat(url, history)
    assert want2.status_code == 200, want2.text
    got2 = _send(browser, second)
    assert not got2["failed"], got2
    assert got2["content"] == want2.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_an_api_error_is_shown(app, browser):
    url = app["url"]
    _open(browser, url, KEY)
    _wait(browser, lambda d: _text(d, "#model option") == MODEL)
    # A model the server does not serve (the select offers only served ones).
    browser.execute_script(
        "const o = new Option('no-such-model', 'no-such-model', true, true); document.getElementById('model').add(o);"
    )
    refused = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers=AUTH,
        timeout=60,
    )
    assert refused.status_code == 404
    got = _send(browser, "hi")
    assert got["failed"] and got["content"] == ""
    assert got["error"] == f"HTTP 404: {refused.json()['error']['message']}"
