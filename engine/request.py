"""A request as the scheduler sees it: token ids and progress counters, no phase flags."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv_transfer.peer_prefix import PeerPrefix
    from engine.lora.request import LoRARequest
    from engine.structured.matcher import GrammarMatcher


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The engine sequences of one user request: itself when n == 1, else `<id>#<i>`."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def parent_request_id(child_id: str) -> str:
    """The user request a sequence id (from `child_request_ids`) belongs to."""
    return child_id.split("#", 1)[0]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KV = 3  # blocks held, contents being computed by a prefill engine
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    """One sequence. `n>1` requests are expanded into n of these by the front end.

    Progress is `num_computed_tokens` against `all_token_ids`: prefill, chunked prefill,
    prefix hits, recompute after preemption and decode are all "compute the next N tokens".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value runs first under the "priority" policy
    # Extra key mixed into the first block hash: siblings of one n>1 request share it so they
    # share prompt blocks even when prefix caching is off; a cache salt isolates tenants.
    cache_salt: str | None = None
    max_tokens: int = 16  # resolved by the front end against max_model_len

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens at first schedule; -1 = not yet
    first_scheduled_time: float | None = None  # monotonic; arrival to this is the queue time
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)  # one per full block of all_token_ids
    # Disaggregated serving (engine/kv_transfer/), prefill side: read out blocks from this index
    # on at finish.
    kv_export_first_block: int | None = None
    # Decode side of a fetch from a peer engine: it holds this many leading prompt tokens
    # (engine/kv_transfer/peer_prefix.py); None: no hint.
    peer_prefix: PeerPrefix | None = None
    # Structured outputs (engine/structured/): where the output stands in its grammar.
    grammar: GrammarMatcher | None = None
    # Multi-LoRA (engine/lora/): the adapter this sequence runs with (None: the base model). It
    # roots the request's prefix-cache hash chain.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
