"""A pipeline stage hop, four ways, side by side in one run: the hidden states of a step going
from the driver (which runs the first stage, as the engine's rank 0 does) to the next stage's
actor, and that stage's small result (the sampled ids) coming back.

  - `ray call + gloo` (the engine's transport, engine/pipeline.py): each step a Ray call starts
    the next stage's step, and the tensor goes over a gloo process group (send/recv);
  - `compiled graph`: a Ray compiled graph (`experimental_compile`) whose input is the tensor;
    its shared-memory channels replace both the per-step call and the send;
  - `compiled graph + gloo`: the compiled graph starts the step and returns its result, the
    tensor goes over gloo as in the first;
  - `ray call, tensor as argument`: the tensor passed to the Ray call (the object store).

Shapes: a decode hop of 16 and of 256 rows and a 2,048-token prefill chunk, of the embedded
model's hidden size (576) and of a 70B model's (8192), float32. Median over `--steps` hops after
a warm-up, one torch thread per process; the stage's actor runs on the same node, so this
measures the per-step overhead of each mechanism, not a network.

    python -m bench.bench_pp_transport --steps 200
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from typing import Iterator

import ray
import torch
import torch.distributed as dist

from bench.timing import median_time
from tests.net import free_port

TIMEOUT = datetime.timedelta(seconds=60)


@ray.remote(num_cpus=0)
class Stage:
    """The next stage: rank 1 of a gloo group with the driver."""

    def __init__(self, port: int) -> None:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
        self.pg = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)

    def step_recv(self, shape: tuple[int, int]) -> int:
        x = torch.empty(shape)
        self.pg.recv([x], 0, 0).wait()
        return int(x[0, 0].item())

    def step_arg(self, x: torch.Tensor) -> int:
        return int(x[0, 0].item())


@contextlib.contextmanager
def compiled_graph(method, buffer_bytes: int) -> Iterator:
    """A one-node compiled graph: the driver's input to `method`, its result back."""
    from ray.dag import InputNode

    with InputNode() as inp:
        dag = method.bind(inp)
    compiled = dag.experimental_compile(_buffer_size_bytes=buffer_bytes)
    try:
        yield compiled
    finally:
        compiled.teardown()


def check(ref) -> None:
    assert ray.get(ref) == 1


def median_ms(fn, steps: int) -> float:
    for _ in range(max(5, steps // 10)):  # a graph's or a group's first hops set up buffers
        fn()
    return 1e3 * median_time(fn, steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [(16, 576), (256, 576), (2048, 576), (16, 8192), (256, 8192), (2048, 8192)]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        stage = Stage.remote(port)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT)
        pg = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
        rows = []
        for shape in shapes:
            x = torch.full(shape, 1.0)

            def gloo(x=x, shape=shape) -> None:
                ref = stage.step_recv.remote(shape)
                pg.send([x], 1, 0).wait()
                assert ray.get(ref) == 1

            def as_arg(x=x) -> None:
                assert ray.get(stage.step_arg.remote(x)) == 1

            row = {
                "shape": shape,
                "MB": x.nbytes / 1e6,
                "ray call + gloo": median_ms(gloo, args.steps),
                "ray call, tensor as argument": median_ms(as_arg, args.steps),
            }
            # The channel holds one step's input (and its serialisation header).
            with compiled_graph(stage.step_arg, x.nbytes + (1 << 20)) as compiled:
                row["compiled graph"] = median_ms(lambda x=x, c=compiled: check(c.execute(x)), args.steps)
            with compiled_graph(stage.step_recv, 1 << 20) as compiled:

                def graph_gloo(x=x, shape=shape, c=compiled) -> None:
                    ref = c.execute(shape)
                    pg.send([x], 1, 0).wait()
                    check(ref)

                row["compiled graph + gloo"] = median_ms(graph_gloo, args.steps)
            rows.append(row)
            print(row, flush=True)
    finally:
        ray.shutdown()
    print(
        "\n| hop (rows x hidden) | MB | ray call + gloo ms | compiled graph ms | compiled graph + gloo ms | "
        "tensor as argument ms | compiled graph + gloo / ray call + gloo |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape'][0]} x {r['shape'][1]} | {r['MB']:.2f} | {r['ray call + gloo']:.3f} | "
            f"{r['compiled graph']:.3f} | {r['compiled graph + gloo']:.3f} | {r['ray call, tensor as argument']:.3f} | "
            f"{r['compiled graph + gloo'] / r['ray call + gloo']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
