"""OpenVINO GenAI side of `bench.bench_openvino`, run by the interpreter of a separate virtual
environment that has `openvino-genai` (never by the project's own): standard library, openvino_genai
and what it ships with (openvino, numpy) only, nothing from the project.

    <ov-venv>/bin/python -I bench/openvino_worker.py

JSON lines over stdin/stdout. First line: {"model", "threads", "cache_gb", "max_num_batched_tokens",
"max_num_seqs", "properties"}; answer {"ready", "version", "load_s", "settings"}. Then each line
{"prompts": [[token ids], ...], "max_new_tokens": [n, ...]}: one `generate` call on the whole
batch (greedy, EOS ignored); answer {"seconds", "outputs": [[generated ids], ...]}. End of input ends
it. Native logs go to stderr: stdout carries only the answers.
"""

from __future__ import annotations

import json
import os
import sys
import time

CPU_PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "PERFORMANCE_HINT", "ENABLE_CPU_PINNING")


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the native libraries print stays off the protocol
    sys.stdout = sys.stderr
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    cfg = json.loads(sys.stdin.readline())
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = int(cfg["cache_gb"])  # GB of paged KV cache
    sched.enable_prefix_caching = True
    sched.dynamic_split_fuse = True
    sched.max_num_batched_tokens = int(cfg["max_num_batched_tokens"])
    sched.max_num_seqs = int(cfg["max_num_seqs"])
    props = {"INFERENCE_NUM_THREADS": int(cfg["threads"]), **cfg.get("properties", {})}
    core = ov.Core()
    settings = {}
    for key in CPU_PROPERTIES:
        try:
            value = props.get(key, core.get_property("CPU", key))
        except Exception:  # a property this version does not have
            continue
        if hasattr(value, "get_type_name"):  # an element type: bf16, u8, ...
            value = value.get_type_name()
        settings[key] = str(getattr(value, "name", value))
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(cfg["model"], sched, "CPU", props)
    load_s = time.perf_counter() - t0
    version = ov_genai.get_version() if hasattr(ov_genai, "get_version") else ov_genai.__version__
    answers.write(json.dumps({"ready": True, "version": version, "load_s": load_s, "settings": settings}) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        inputs = [ov.Tensor(np.asarray([ids], dtype=np.int64)) for ids in job["prompts"]]
        configs = []
        for n in job["max_new_tokens"]:
            gc = ov_genai.GenerationConfig()
            gc.max_new_tokens = int(n)
            gc.min_new_tokens = int(n)
            gc.ignore_eos = True
            gc.do_sample = False
            configs.append(gc)
        t0 = time.perf_counter()
        results = pipe.generate(inputs, configs)
        seconds = time.perf_counter() - t0
        outputs = [[int(t) for t in r.m_generation_ids[0]] for r in results]
        answers.write(json.dumps({"seconds": seconds, "outputs": outputs}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
