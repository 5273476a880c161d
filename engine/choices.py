"""The allowed values of every enumerated engine setting, written once. `EngineArgs` holds the
defaults; the engine's checks, `AppConfig`'s fields and both CLIs' `choices` read these tuples
(tests/test_settings_vocabulary.py fails on a second list that disagrees). No torch here: the
serving layer's config imports it."""

from __future__ import annotations

DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto": bf16 where fast (model_config.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # "auto": the model's dtype
QUANTIZATION_METHODS = ("int8", "int4", "int4:g32", "int4:g64", "int4:g128", "gguf", "gptq", "awq")  # or None
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("ngram", "draft", "self")
POOLING_TYPES = ("last", "mean")  # an embedding: the last prompt token's final hidden state, or their mean
KV_OFFLOAD_MEDIA = ("disk", "host")  # the offload tier: memory-mapped files, or (pinned) host memory
