"""Serve settings of the router and engine replica actors that cut per-token work.

By default a Serve replica runs user code on a second event loop in its own thread, and a
DeploymentHandle routes and receives on a third: every streamed chunk then crosses threads
several times (call_soon_threadsafe, wrapped futures) in the router and the engine replica.
Serve's own throughput-optimized mode turns both off; these are two of its switches, set per
actor through the runtime environment (read when the replica process imports Serve).
Our user code never blocks its loop for long (the engine steps on its own thread).

Engine replicas also spin longer before idle OpenMP threads sleep (ENGINE_OMP_ENV). A served
step shares the cores with the processes that stream its tokens (Ray's threads, the
ingress, the proxy). With the engine package's offline default (GOMP_SPINCOUNT=2000, ~20 us:
engine/__init__.py) every such wake-up outlasts the spin, the thread waiting at the next barrier
goes to sleep and each of a step's hundreds of parallel regions pays a futex wake-up: a 2-thread
one-row GGUF step took 48 ms inside the replica on a 2-core AVX2 EPYC against 12.5 offline, 19.5
with 200000 (~2 ms). Over HTTP at 8 streams that is 1.34x the tokens/s, 1.05-1.23x at 4
(`python -m bench.bench_spare_core --compare spin`). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT
(the driver's environment or the engine's runtime_env) wins.
"""

from __future__ import annotations

from engine import USER_OMP_WAIT

SINGLE_LOOP_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
ENGINE_OMP_ENV = {"GOMP_SPINCOUNT": "200000"}
_OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def engine_omp_wait(actor_options: dict) -> dict:
    """The engine replica's `ray_actor_options` with ENGINE_OMP_ENV added, unless the user set how
    OpenMP threads wait (in this process's environment before `engine` was imported, which Ray
    passes on, or in the actor's runtime_env)."""
    env = (actor_options.get("runtime_env") or {}).get("env_vars") or {}
    if USER_OMP_WAIT or any(k in env for k in _OMP_KEYS):
        return dict(actor_options)
    return _with_env(actor_options, ENGINE_OMP_ENV)


def single_loop(actor_options: dict) -> dict:
    """`ray_actor_options` with the switches added (env vars the caller set win)."""
    return _with_env(actor_options, SINGLE_LOOP_ENV)


def _with_env(actor_options: dict, defaults: dict[str, str]) -> dict:
    """A copy of `ray_actor_options` whose runtime_env env_vars start from `defaults` (the
    caller's own env vars win)."""
    out = dict(actor_options)
    runtime_env = dict(out.get("runtime_env") or {})
    runtime_env["env_vars"] = {**defaults, **(runtime_env.get("env_vars") or {})}
    out["runtime_env"] = runtime_env
    return out
