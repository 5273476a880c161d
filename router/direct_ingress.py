"""Direct ingress: the router replica serves HTTP itself, with no Serve proxy between it and the
client (Ray Serve's own `RAY_SERVE_ENABLE_DIRECT_INGRESS`, one of its throughput-optimized
switches).

Why: through the proxy every streamed chunk is one more Ray message (router -> proxy actor), its
serialization on both ends and a wake-up of a third process. On a 2-core AVX2 EPYC at one stream
that relay cost ~2.4 ms of CPU per token (the proxy 1.7 ms, the router's send 0.9 ms) next to a
~12.5 ms step; 8 streams got 1.10x the tokens/s without it (`python -m bench.bench_spare_core
--compare ingress`), and the saved CPU is what let every step use both cores (engine/step_threads.py).

Used by `orbital serve` on the local cluster it starts (one router replica, one node): Serve
then binds the router replica itself to the user's port. Serve still starts its proxy on the
head node (it needs one for its own routes); it gets a spare port on the same host. A cluster
others share (`--address`) keeps its proxies: with several routers and nodes a load balancer
must spread clients over the replicas' ports (Serve's HAProxy mode), which is the operator's.
"""

from __future__ import annotations

import socket


def direct_ingress_env(port: int) -> dict[str, str]:
    """Environment of a local Ray cluster whose one router replica listens on `port`."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # The replica's port comes from this range: exactly the user's.
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        # Both exist for a load balancer in front (deregistration, stale slots); with none, a
        # restarted router replica must get the port back at once and a stop must not wait 30 s.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def port_free(host: str, port: int) -> bool:
    """Whether `host:port` can be bound now (checked before the cluster starts: a replica that
    cannot bind only retries and fails deep inside Serve)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no holder
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def spare_port(host: str) -> int:
    """A port on `host` nobody holds now (for Serve's proxy, off the user's port)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
