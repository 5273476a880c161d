"""Shared fixtures: one torch thread budget, the embedded model's HF directory and tokenizer."""

from __future__ import annotations

import os
import sys

import engine  # noqa: F401 - OpenMP's wait defaults (engine/__init__.py) before torch loads it

# isort: split
import pytest
import torch

# Several agents/replicas on 2 cores: keep each process explicit and small.
torch.set_num_threads(int(os.environ.get("ORBITAL_TEST_THREADS", "2")))  # under xdist: per test, below
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


# The packages that deploy onto the shared Serve cluster (tests/serve_cluster.py), in this order,
# run after all others and back to back, so that the cluster starts once per run.
SHARED_SERVE_PACKAGES = ("disagg", "e2e", "failover", "router", "routing")

# Under `make test` the suite runs on two pytest-xdist workers. Each worker runs Ray at most once
# at a time, and the two together as little as possible (two clusters at once ran much slower
# than one): the packages that deploy onto the shared Serve cluster are one work unit, run in the
# one-process order; the Ray packages with clusters of their own are another, handed out last; the
# other files are a unit each, the slow-marked first. One worker starts the Serve unit while the
# other runs the files and then the last unit (threads: pytest_runtest_setup).
OWN_RAY_PACKAGES = ("workers", "cluster")
RAY_PACKAGES = OWN_RAY_PACKAGES + SHARED_SERVE_PACKAGES


def _package(nodeid: str) -> str:
    return nodeid.split("/")[1] if nodeid.count("/") >= 2 else ""


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            package = _package(nodeid)
            if package in SHARED_SERVE_PACKAGES:
                return "serve"
            return "own-ray" if package in OWN_RAY_PACKAGES else nodeid.split("::")[0]

    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        package = _package(item.nodeid)
        if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: the shared Serve packages last
            return 1 + SHARED_SERVE_PACKAGES.index(package) if package in SHARED_SERVE_PACKAGES else 0
        if package in SHARED_SERVE_PACKAGES:
            return SHARED_SERVE_PACKAGES.index(package)
        if package in OWN_RAY_PACKAGES:
            return len(SHARED_SERVE_PACKAGES) + 2
        return len(SHARED_SERVE_PACKAGES) + (0 if item.get_closest_marker("slow") else 1)

    items.sort(key=rank)  # stable: the order inside a package is pytest's


def pytest_configure(config):
    """xdist's workers start with this process's environment, where `import engine` has set the
    offline OpenMP wait: without it they (and their Ray) pick their own, as a fresh process does."""
    from engine import USER_OMP_WAIT

    if config.getoption("numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER") and not USER_OMP_WAIT:
        os.environ.pop("GOMP_SPINCOUNT", None)


def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and "ORBITAL_TEST_THREADS" not in os.environ:
        torch.set_num_threads(2 if _package(item.nodeid) in RAY_PACKAGES else 1)


_FILE_SECONDS: dict[str, float] = {}  # test file -> its tests' setup + call + teardown seconds


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The files that take the most time (module fixtures included): where the suite's minutes go."""
    slowest = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:25]
    if slowest:
        terminalreporter.write_sep("=", f"slowest {len(slowest)} files of {len(_FILE_SECONDS)}")
        for path, seconds in slowest:
            terminalreporter.write_line(f"{seconds:8.1f}s  {path}")


@pytest.fixture(scope="session", autouse=True)
def shared_serve_cluster_stops():
    """The shared Serve cluster, if a test started it, is shut down when the run ends."""
    yield
    if "ray" in sys.modules:
        from tests.serve_cluster import release_ray

        release_ray()


@pytest.fixture(scope="session")
def smollm_dir():
    from engine.model.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def chat_stand_in(tmp_path_factory, smollm_dir):
    """The embedded model's tokenizer on a 2-layer random Llama (tests/tiny_llama.py), saved once
    per run: the serving-plumbing packages serve it where exact streams matter, not their words."""
    from tests.tiny_llama import save_chat_stand_in

    return str(save_chat_stand_in(tmp_path_factory.mktemp("chat-stand-in"), smollm_dir))


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="session")
def hf_smollm(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
