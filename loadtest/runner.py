"""Drive a request list against a server under an arrival pattern, bounded in count and time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from loadtest import records as R
from loadtest.arrivals import Arrival, ClosedLoop
from loadtest.client import ClientConfig, discover_model, send
from loadtest.records import RequestRecord
from loadtest.workloads import RequestSpec


@dataclass
class RunOutput:
    records: list[RequestRecord]
    duration_s: float  # run start to the end of the last request
    model: str
    not_sent: int = 0  # requests the duration bound kept from being sent
    started_at: float = field(default_factory=time.time)


async def run_async(
    specs: list[RequestSpec],
    cfg: ClientConfig,
    arrival: Arrival,
    *,
    max_requests: int | None = None,
    max_duration: float | None = None,
    max_concurrency: int | None = None,
    drain_timeout: float | None = None,
    progress: bool = True,
    desc: str = "requests",
) -> RunOutput:
    """Send ``specs`` (at most ``max_requests``), dispatching only until ``max_duration`` seconds;
    requests in flight then get ``drain_timeout`` (default: request timeout + 5 s) to finish and
    are recorded as ``cancelled`` after that. A multi-turn request waits for the turn before it."""
    specs = specs[:max_requests] if max_requests else list(specs)
    started_at = time.time()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        model = await discover_model(client, cfg)
        ended = {s.id: asyncio.Event() for s in specs}
        records: list[RequestRecord] = []
        inflight: dict[str, tuple[RequestSpec, float]] = {}
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(specs), disable=not progress, desc=desc, unit="req", dynamic_ncols=True)
        run_start = time.perf_counter()
        deadline = run_start + max_duration if max_duration else None
        errors = 0

        async def one(spec: RequestSpec) -> None:
            nonlocal errors
            if spec.depends_on in ended:
                await ended[spec.depends_on].wait()
            inflight[spec.id] = (spec, time.perf_counter() - run_start)
            try:
                if sem is not None:
                    async with sem:
                        rec = await send(client, cfg, model, spec, run_start)
                else:
                    rec = await send(client, cfg, model, spec, run_start)
                inflight.pop(spec.id, None)
                records.append(rec)
                errors += not rec.success
                bar.update(1)
                bar.set_postfix(errors=errors, refresh=False)
            finally:
                ended[spec.id].set()

        def expired() -> bool:
            return deadline is not None and time.perf_counter() >= deadline

        tasks: list[asyncio.Task] = []
        sent = 0
        if isinstance(arrival, ClosedLoop):
            queue = iter(specs)

            async def worker() -> None:
                nonlocal sent
                for spec in queue:
                    if expired():
                        return
                    sent += 1
                    await one(spec)

            tasks = [asyncio.create_task(worker()) for _ in range(arrival.concurrency)]
        else:
            for spec, t in zip(specs, arrival.times(len(specs))):
                wait = run_start + t - time.perf_counter()
                if deadline is not None and run_start + t >= deadline:
                    break
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(spec)))
                sent += 1

        if tasks:
            if deadline is not None:
                await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            grace = cfg.timeout + 5.0 if drain_timeout is None else drain_timeout
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for spec, start in list(inflight.values()):
            rec = RequestRecord(
                id=spec.id,
                kind=spec.kind,
                start=start,
                prompt_tokens=spec.prompt_tokens,
                expected_output_tokens=spec.max_tokens,
            )
            records.append(rec.fail(R.CANCELLED, "cut off by the duration bound"))
        bar.close()
        ends = [r.end for r in records if r.end is not None]
        duration = max(ends + [time.perf_counter() - run_start if not ends else 0.0])
        records.sort(key=lambda r: r.start)
        return RunOutput(records, duration, model, not_sent=len(specs) - sent, started_at=started_at)


def run(specs: list[RequestSpec], cfg: ClientConfig, arrival: Arrival, **kw) -> RunOutput:
    return asyncio.run(run_async(specs, cfg, arrival, **kw))
