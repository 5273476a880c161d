"""asyncio front of the engine: a step loop on its own thread, per-request async streams.

The model forward blocks for tens of milliseconds, so it runs on a dedicated thread; the
event loop only moves small messages. Two kinds of streams:
  * `generate()` yields RequestOutput (text, deltas) — the offline/async Python API;
  * `generate_tokens()` yields EngineCoreOutput (token ids only) — the serving path, where the
    router detokenizes and calls `finish()` when a stop string matches.
Cancelling a stream (client gone) aborts the request before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from engine.core.kv_events import KVEventLog
from engine.engine_args import EngineArgs
from engine.errors import EngineDeadError, EngineStepError, InvalidRequestError
from engine.inbox import Abort, AddText, AddTokens, ExportCached, Finish, InboxMessage, KVFailed, LoadKV
from engine.kv_transfer.awaiting_kv import KVLoadRequest
from engine.kv_transfer.blocks import KVBlocks, KVLayout
from engine.kv_transfer.peer_prefix import PeerPrefix
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import EmbeddingOutput, EngineCoreOutput, RequestOutput
from engine.request import RequestStatus
from engine.runner.executor import ExecutorFactory, in_process_executor
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.text.input_processor import PromptInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.model_config import ModelConfig

log = logging.getLogger(__name__)
_DONE = object()


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, children: list[str]):
        self.loop, self.queue = loop, asyncio.Queue()
        self.open_children = set(children)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """`executor_factory`: see LLMEngine (the caller picks the executor; Ray's for tp>1)."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        engine: LLMEngine | None = None,
        executor_factory: ExecutorFactory = in_process_executor,
    ) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[InboxMessage] = []  # engine/inbox.py
        # Decode side of disaggregated serving: called on the step thread with the remote
        # prefills the scheduler asked for (set by the serving layer, which performs them).
        self.on_kv_loads: Callable[[list[KVLoadRequest]], None] | None = None
        self._streams: dict[str, _Stream] = {}  # parent request id -> stream
        self._token_parent: dict[str, str] = {}  # child id -> parent, token-mode requests
        self._dead: BaseException | None = None
        self._stopping = False
        self.step_count = 0
        self._step_started: float | None = None  # monotonic start of the step in flight
        # The step thread builds the engine itself, so model loading, warm-up and every step run
        # their parallel regions on one thread. Loading on the caller's thread and stepping on
        # this one gave the process two OpenMP thread teams, and a one-row step took ~35% longer
        # (bf16, 2 cores: 38-40 ms against 28 ms).
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._build_and_run,
            args=(engine, args or EngineArgs(), executor_factory),
            name="orbital-engine-loop",
            daemon=True,
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    # --- public API -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`lora_request`: the LoRA adapter (a LoRARequest, or the name of one known here)."""
        self._check_alive()
        rid = request_id or self.engine.next_request_id()
        lora = self.engine.resolve_lora(lora_request, register=False)
        text, ids = self.engine.inputs.tokenize_for(prompt, params)
        reqs = await self._make_requests(rid, ids, params, priority, lora_request=lora)
        children = [r.request_id for r in reqs]
        stream = self._open(rid, children)
        self._submit(AddText(rid, text, ids, params, reqs))
        async for item in self._drain(rid, stream, children):
            yield item

    async def embed(
        self, prompt: PromptInput, pooling: str | None = None, request_id: str | None = None, priority: int = 0
    ) -> EmbeddingOutput:
        """One prompt's embedding (`LLM.embed`'s, as a prefill-only request in the running
        batches). The serving path sends the same request through `generate_tokens` with
        `SamplingParams.pooling` set, and reads `EngineCoreOutput.embedding`."""
        params = SamplingParams(max_tokens=1, pooling=pooling or self.engine.args.pooling_type)
        async for out in self.generate(prompt, params, request_id, priority):
            if out.finished:
                if out.embedding is None:
                    raise (InvalidRequestError if out.error_kind == "invalid" else EngineStepError)(
                        out.error or "no embedding"
                    )
                return EmbeddingOutput(out.request_id, out.prompt_token_ids, out.embedding, out.num_cached_tokens)
        raise EngineDeadError("the engine ended the request without its embedding")

    async def generate_tokens(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: dict[str, list[int]] | None = None,
        kv_export_first_block: int | None = None,
        lora_request: LoRARequest | None = None,
        peer_prefix: PeerPrefix | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """`resume`: see `InputProcessor.make_requests` (a request moved from another replica).
        `kv_export_first_block` (a prefill engine): the finishing output carries the request's KV
        from that block on (`EngineCoreOutput.kv_blocks`). `peer_prefix`: another engine holds
        that much of the prompt (the KV loads handed to `on_kv_loads` then name its source)."""
        self._check_alive()
        ids = self.engine.inputs.check_token_ids(prompt_token_ids)
        lora = self.engine.resolve_lora(lora_request, register=False)
        reqs = await self._make_requests(request_id, ids, params, priority, arrival_time, resume, lora_request=lora)
        for r in reqs:
            r.kv_export_first_block = kv_export_first_block
            r.peer_prefix = peer_prefix
        children = [r.request_id for r in reqs]
        stream = self._open(request_id, children)
        with self._lock:
            for c in children:
                self._token_parent[c] = request_id
        self._submit(AddTokens(reqs))
        async for item in self._drain(request_id, stream, children):
            yield item

    async def _make_requests(self, request_id: str, ids: list[int], params: SamplingParams, *rest, **kw) -> list:
        """`inputs.make_requests`; off the event loop for a structured output, whose first use
        builds the grammar tokenizer (~0.5 s) and whose grammar may take long to build."""
        make = self.engine.inputs.make_requests
        if params.structured_output is None:
            return make(request_id, ids, params, *rest, **kw)
        return await asyncio.to_thread(make, request_id, ids, params, *rest, **kw)

    @property
    def kv_events(self) -> KVEventLog:
        """The prefix-cache hashes this engine holds, as events (cache-aware routing's feed)."""
        return self.engine.core.kv_events

    @property
    def kv_layout(self) -> KVLayout:
        """The KV cache's layout over all ranks (what a KV hand-off must match)."""
        return self.engine.core.kv_layout

    def load_kv(self, child_id: str, blocks: KVBlocks) -> None:
        """A remote prefill's KV for a sequence waiting for it (decode side)."""
        self._submit(LoadKV(child_id, blocks))

    def kv_load_failed(self, child_id: str, error: str | None = None) -> None:
        """A remote prefill failed: recompute it here (`error` None) or fail the sequence."""
        self._submit(KVFailed(child_id, error))

    async def export_cached_kv(
        self,
        prompt_token_ids: list[int],
        first_block: int,
        num_blocks: int,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> KVBlocks | None:
        """A peer's fetch: these blocks of the prompt's prefix from the prefix cache (None: not
        all cached here). Read on the step thread between two steps, ahead of queued requests."""
        self._check_alive()
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(ExportCached(list(prompt_token_ids), first_block, num_blocks, lora_request, cache_salt, reply))
        return await asyncio.wrap_future(reply)

    def finish(self, child_ids: list[str]) -> None:
        """The text side matched a stop string: end these sequences and free their KV."""
        self._submit(Finish(list(child_ids)))

    def abort(self, request_id: str) -> None:
        # Token-mode children are looked up now: the stream's cleanup forgets them right after.
        with self._lock:
            token_children = [c for c, p in self._token_parent.items() if p == request_id]
        self._submit(Abort(request_id, token_children))

    def stats(self) -> dict:
        """The latest snapshot as a dict, plus the loop's own figures."""
        s = self.snapshot.as_dict()
        s["num_steps_loop"] = self.step_count
        s["dead"] = self._dead is not None
        return s

    def step_handed_over(self) -> None:
        """Returns once the step thread is not handing a step's outputs to the streams (it hands
        a whole step over under one lock): a caller that then drains its streams sees every
        output of the last step at once. Blocks for microseconds at most."""
        with self._lock:
            pass

    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def rank_pids(self) -> list[int]:
        """The engine's rank processes, rank 0 (this one) first."""
        return self.engine.core.executor.rank_pids()

    def check_health(self, stuck_after_s: float) -> None:
        """Raise EngineDeadError when the loop died, a step has not returned for `stuck_after_s`
        (a hung collective or device), or a worker of the executor is gone. Blocks for up to the
        executor's ping deadline: call it off the event loop."""
        if not self.is_alive():
            raise EngineDeadError(f"the engine loop is not running: {self._dead}")
        started = self._step_started
        if started is not None and (age := time.monotonic() - started) > stuck_after_s:
            raise EngineDeadError(f"the engine step in flight has not returned for {age:.0f} s")
        self.engine.core.executor.check_health()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # --- plumbing ---------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        if self._stopping:
            raise EngineDeadError("engine is shutting down")

    def _open(self, rid: str, children: list[str]) -> _Stream:
        stream = _Stream(asyncio.get_running_loop(), children)
        with self._lock:
            if rid in self._streams:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            self._streams[rid] = stream
        return stream

    def _submit(self, msg: InboxMessage) -> None:
        with self._lock:
            self._inbox.append(msg)
            self._wake.notify()

    async def _drain(self, rid: str, stream: _Stream, children: list[str]):
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:  # consumer went away (disconnect, cancel): abort now
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)
                for c in children:
                    self._token_parent.pop(c, None)

    def _build_and_run(self, engine: LLMEngine | None, args: EngineArgs, executor_factory: ExecutorFactory) -> None:
        try:
            self.engine = engine or LLMEngine(args, executor_factory)
            # Replaced (never mutated) by the step thread after every step: any thread may read it.
            self.snapshot: EngineStats = self.engine.core.snapshot()
            self._build_grammar_tokenizer()
        except BaseException as e:  # noqa: BLE001 - the constructor re-raises it on the caller's thread
            self._build_error = e
            return
        finally:
            self._built.set()
        self._run()

    def _build_grammar_tokenizer(self) -> None:
        """Structured outputs' view of the tokenizer, built before serving: built by the first
        constrained request it held the GIL ~0.5 s (SmolLM2) while other requests waited."""
        try:
            self.engine.inputs.grammar_tokenizer.get()
        except InvalidRequestError as e:  # constrained requests get this error; the rest serve
            log.warning("structured outputs unavailable: %s", e)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._inbox and not self._stopping and not self._has_work():
                        self._wake.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                for msg in inbox:
                    self._handle(msg)
                if self._has_work():
                    self._step()
                    self._hand_out_kv_loads()
                elif inbox:  # an abort or finish with no step after it: publish the freed KV
                    self.engine.core.publish_kv_events()
                    self.snapshot = self.engine.core.snapshot()
        except BaseException as e:  # noqa: BLE001 - every stream must learn the engine died
            log.exception("engine loop died")
            self._dead = e
            msg = f"engine step failed: {type(e).__name__}: {e}"
            suspects = self.engine.core.fatal_suspects
            with self._lock:
                for s in self._streams.values():
                    s.put(EngineStepError(msg, suspect=bool(s.open_children & suspects)))
        finally:
            with self._lock:
                for s in list(self._streams.values()):
                    s.put(EngineDeadError("engine shut down") if self._stopping else _DONE)
                for m in self._inbox:  # peers' fetches nobody will read out
                    if isinstance(m, ExportCached) and m.reply.set_running_or_notify_cancel():
                        m.reply.set_exception(EngineDeadError("engine shut down"))

    def _has_work(self) -> bool:
        return self.engine.core.has_work() or self.engine.step_in_flight

    def _handle(self, msg: InboxMessage) -> None:
        eng = self.engine
        match msg:
            case AddText():
                eng.add_prepared(msg.request_id, msg.prompt_text, msg.prompt_ids, msg.params, msg.requests)
            case AddTokens():
                for r in msg.requests:
                    eng.core.add_request(r)
            case Finish():
                eng.core.finish_requests(msg.child_ids, RequestStatus.FINISHED_STOPPED)
            case LoadKV():
                try:
                    eng.core.load_kv(msg.child_id, msg.blocks)
                except InvalidRequestError as e:  # the payload does not fit: recompute here
                    log.warning("remote KV for %s refused (%s): recomputing it here", msg.child_id, e)
                    eng.core.kv_load_failed(msg.child_id)
            case KVFailed():
                eng.core.kv_load_failed(msg.child_id, msg.error)
            case ExportCached():
                if not msg.reply.set_running_or_notify_cancel():
                    return  # the caller gave up
                try:
                    msg.reply.set_result(
                        eng.core.export_cached_kv(
                            msg.prompt_token_ids, msg.first_block, msg.num_blocks, msg.lora_request, msg.cache_salt
                        )
                    )
                except Exception as e:  # noqa: BLE001 - the peer recomputes; this engine goes on
                    msg.reply.set_exception(e)
            case Abort():
                if msg.token_children:
                    eng.core.abort_requests(msg.token_children)
                else:
                    eng.abort_request(msg.request_id)
            case _:
                raise TypeError(f"unknown inbox message {msg!r}")

    def _hand_out_kv_loads(self) -> None:
        loads = self.engine.core.take_kv_loads()
        if not loads:
            return
        if self.on_kv_loads is None:  # nobody moves KV here: prefill locally
            for load in loads:
                self.engine.core.kv_load_failed(load.request_id)
            return
        self.on_kv_loads(loads)

    def _step(self) -> None:
        eng = self.engine
        self._step_started = time.monotonic()
        try:
            # Overlapped (CUDA): the next step is launched before this one's text is made below.
            core_outputs = eng.core_step()
        finally:
            self._step_started = None
        self.step_count += 1
        self.snapshot = eng.core.snapshot()
        text_side, now = [], time.monotonic()
        with self._lock:
            for co in core_outputs:
                parent = self._token_parent.get(co.request_id)
                if parent is None:
                    text_side.append(co)
                    continue
                stream = self._streams.get(parent)
                if stream is None:
                    continue
                stream.put(co)
                if co.finished:
                    stream.open_children.discard(co.request_id)
                    if not stream.open_children:
                        stream.put(_DONE)
        if not text_side:
            return
        request_outputs = eng.process_core_outputs(text_side)
        with self._lock:
            for out in request_outputs:
                out.metrics.setdefault("step_time", now)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        stream.put(_DONE)
