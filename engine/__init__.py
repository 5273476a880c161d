"""Orbital's single-process engine: paged KV cache, prefix caching, continuous batching.

Exports are lazy: `import engine.engine_args` (the serving layer's config does) stays free of
torch and transformers.
"""

import importlib as _importlib
import os as _os

# Idle OpenMP threads spin ~20 us, then sleep. A decode step is hundreds of short parallel
# regions: with passive waits (sleep at once) each one pays a futex wake-up, and a one-row step
# took 1.8x as long (19.2 vs 10.6 ms, 4-bit SmolLM2, 2 threads); unbounded spinning starves other
# processes sharing the cores. `python -m bench.bench_omp_wait` measures the three. A user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins (USER_OMP_WAIT; served engines spin longer unless the
# user chose: router/serve_tuning.py). Read when libgomp loads: must precede the first torch import.
USER_OMP_WAIT = "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ
if not USER_OMP_WAIT:
    _os.environ["GOMP_SPINCOUNT"] = "2000"

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineArgs": "engine.engine_args",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "engine.structured.spec",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "OrbitalError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "AdapterNotFoundError": "engine.errors",
    "LoRARequest": "engine.lora.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
