"""Serve settings of the router and engine replica actors that cut per-token work.

By default a Serve replica runs user code on a second event loop in its own thread, and a
DeploymentHandle routes and receives on a third: every streamed chunk then crosses threads
several times (call_soon_threadsafe, wrapped futures) in the router and the engine replica.
Serve's own throughput-optimized mode turns both off; these are two of its switches, set per
actor through the runtime environment (read when the replica process imports Serve).
Our user code never blocks its loop for long (the engine steps on its own thread).
"""

from __future__ import annotations

SINGLE_LOOP_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def single_loop(actor_options: dict) -> dict:
    """`ray_actor_options` with the switches added (env vars the caller set win)."""
    out = dict(actor_options)
    runtime_env = dict(out.get("runtime_env") or {})
    runtime_env["env_vars"] = {**SINGLE_LOOP_ENV, **(runtime_env.get("env_vars") or {})}
    out["runtime_env"] = runtime_env
    return out
