"""Orbital load tester: workloads, arrival patterns, a streaming OpenAI client, metrics and reports.

Talks to any OpenAI-compatible endpoint over HTTP (httpx); never imports the engine.
Entry point: ``python -m loadtest run|sweep|compare|plot|workload ...``.
"""

SCHEMA_VERSION = 1
