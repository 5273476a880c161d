"""What the asyncio side hands the engine's step thread (`AsyncEngine`'s inbox): one dataclass per
kind of message, applied between steps in arrival order."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_transfer.blocks import KVBlocks
    from engine.lora.request import LoRARequest
    from engine.request import Request
    from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddText:
    """A text-side request (the engine detokenizes): validated and expanded to its children."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    requests: list[Request]


@dataclass(frozen=True)
class AddTokens:
    """Token-side requests (the caller detokenizes)."""

    requests: list[Request]


@dataclass(frozen=True)
class Finish:
    """Children that a stop string ended on the caller's text side: free their KV."""

    child_ids: list[str]


@dataclass(frozen=True)
class LoadKV:
    """A remote prefill's KV for a child waiting on it."""

    child_id: str
    blocks: KVBlocks


@dataclass(frozen=True)
class KVFailed:
    """A remote prefill failed: recompute it here (`error` None) or fail the child."""

    child_id: str
    error: str | None


@dataclass(frozen=True)
class ExportCached:
    """A peer's fetch: read these blocks of a prompt's prefix out of the prefix cache and answer
    through `reply` (KVBlocks, or None when not all are cached)."""

    prompt_token_ids: list[int]
    first_block: int
    num_blocks: int
    lora_request: LoRARequest | None
    cache_salt: str | None
    reply: Future


@dataclass(frozen=True)
class Abort:
    """The client went away: a text-side request by id, or token-side children."""

    request_id: str
    token_children: list[str] | None


InboxMessage = AddText | AddTokens | Finish | LoadKV | KVFailed | ExportCached | Abort
