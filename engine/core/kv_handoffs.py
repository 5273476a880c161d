"""The scheduler's side of KV that comes from elsewhere: the offload tier's loads, a prefill
engine's or a peer's KV (engine/kv_transfer/awaiting_kv.py), and the waiting requests that hold
blocks after such a load."""

from __future__ import annotations

from engine.core.scheduler_output import SchedulerOutput
from engine.kv_transfer.awaiting_kv import KVLoadRequest
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus


class KVHandoffs:
    """A part of `Scheduler` (engine/core/scheduler.py), which holds the state it works on."""

    # --- the offload tier (engine/kv_offload/) ---------------------------------------------

    def _offload_loads_done(self, so: SchedulerOutput, failed: set[int]) -> None:
        """The loads of the step of `so` ran (`failed`: indices of those that did not): their
        requests go back to the head of the queue holding their blocks."""
        entry = self._offload_in_flight.pop(id(so), None)  # the entry holds `so`: its id is not reused
        if entry is None:
            return
        _, owners = entry
        for req in reversed(self.offload.loads_done(self.kv_cache_manager, so.kv_loads, owners, failed)):
            self.waiting.appendleft(req)

    # --- disaggregated serving (engine/kv_transfer/) ---------------------------------------

    def _release_waiting_holders(self) -> int:
        """Nothing runs and the head of the queue cannot get its blocks: they are held by waiting
        requests that came back from a load (a remote prefill, a peer's prefix, the offload tier;
        its KV arrived, or a failed load is recomputed) and wait behind the head. Those let go of
        their blocks (what a load published stays in the prefix cache, where they may hit it
        again) and compute their prompts when their turn comes, so that no request holds
        capacity that nobody can use. Returns how many let go."""
        released = 0
        for req in list(self.waiting)[1:]:
            if self._holds_blocks(req):
                self.kv_cache_manager.free(req)
                req.num_computed_tokens = 0
                released += 1
        self.num_holders_released += released
        return released

    def _holds_blocks(self, req: Request) -> bool:
        """A waiting request holds blocks only when it came back from a load (a remote prefill, a
        peer's prefix: its KV arrived, or a failed load is recomputed here): preemption and
        `_release_waiting_holders` free a request's blocks and a failed allocation leaves none."""
        return req.request_id in self.kv_cache_manager.req_to_blocks

    def take_kv_loads(self) -> list[KVLoadRequest]:
        """Remote prefills asked for since the last call (the caller performs them)."""
        return self.remote.take_loads()

    def remote_kv_target(self, request_id: str) -> list[int] | None:
        """The block ids a load's contents go to; None when the request is gone (aborted)."""
        return self.remote.target(request_id)

    def remote_kv_done(self, request_id: str, loaded: bool, error: str | None = None) -> None:
        """A load ended. `loaded`: its contents are in the blocks; else they are recomputed here,
        or with `error` the request fails with it."""
        req = self.remote.finish(request_id, loaded)
        if req is None:
            return
        self.stalled = False
        if not loaded and error is not None:
            req.status = RequestStatus.FINISHED_ERROR
            self._free_request(req)
            self._pending_outputs.append(
                EngineCoreOutput(request_id, [], finish_reason="error", error=error, error_kind="unavailable")
            )
            return
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)  # scheduled first, with the blocks it holds
