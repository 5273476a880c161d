"""The messages between an ingress replica and an engine replica (one module per boundary).

ingress -> replica (unary calls pinned to the replica, see replica_choice/):
  * `SubmitRequest`: start a request (token ids in; the ingress validated it already);
  * `FinishSequences`: the ingress matched a stop string: end these sequences now;
  * `AbortRequest`: the client went away: end the request before the next engine step.
  A `SubmitRequest` with `resume` continues a request another replica was running (it died or
  was drained): same prompt and parameters, the outputs so far restored in the engine.
replica -> ingress (the output channel, one streaming call per (ingress, replica)):
  * `StepOutputs`: every output of one engine step (or several, for non-streamed requests) for
    that ingress's requests, plus the requests that failed, plus the replica's KV event
    batches of those steps (ahead of the outputs: the cache-aware router knows a request's
    blocks by the time its output arrives), as one pickled bytes object.
  * `ChannelSocket` (ingress -> replica, with the call): the ingress's local socket and this
    call's token; a replica on the same node writes its `StepOutputs` there instead, and the call
    yields only a `ChannelSocketEnd` with the count written (router/channel_socket.py).
replica -> ingress (the KV event feed, `kv_events`, one short-lived streaming call at a time):
  * `KVEventsUpdate`: a snapshot of the replica's cached block hashes (first contact, a gap,
    a restarted engine) and/or the batches since the last one the ingress saw.
decode replica -> prefill replica (disaggregated serving, router/replica/prefill_client.py):
  * `PrefillKV`: compute these tokens and hand over their KV from block `first_block` on;
    answered with `PrefillKVDone` (a router.replica.kv_transport.KVHandle and the compute time).
replica -> replica of the same pool (a fetch from a peer, router/replica/peer_fetch.py):
  * `ExportCachedKV`: read these blocks of a prompt's prefix out of your prefix cache; answered
    with a router.replica.kv_transport.KVHandle, or None when they are not all cached there.
replica -> ingress (once, when the model path does not exist where the ingress runs):
  * `TextSideFiles`: the model directory's tokenizer, config and chat template, no weights.
`decode` checks the type once, where the bytes come in.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.kv_events import KVEventBatch, KVSnapshot
from engine.kv_transfer.peer_prefix import PeerPrefix
from engine.lora.request import LoRARequest
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: the router replicas that pass layouts on never load torch
    from engine.kv_transfer.blocks import KVLayout


@dataclass(frozen=True, slots=True)
class TextSideFiles:
    files: dict[str, bytes]  # file name -> contents (see engine/model/text_side.py)


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ingress_id: str  # whose output channel carries the outputs
    arrival_wall: float  # time.time() at the ingress (TTFT and e2e latency count from it)
    priority: int = 0
    # > 0 (non-streamed requests): after the first output, hand outputs to the channel at most
    # this often: fewer ingress wake-ups, same results.
    batch_interval_s: float = 0.0
    # A request moved here from another replica (router/ingress/failover.py): child sequence id ->
    # the output tokens it generated so far; finished children are left out. None: a new request.
    resume: dict[str, list[int]] | None = None
    # Replicas the replica choice must not pick (the ones this request already left).
    avoid_replicas: tuple[str, ...] = ()
    # The LoRA adapter it runs with (None: the base model); a moved request keeps it.
    lora_request: LoRARequest | None = None
    # W3C trace context of the router's span of this request (router/tracing.py); None: not traced.
    traceparent: str | None = None
    # Set by the replica choice when it sent the request away from the replica holding more of
    # its prefix (PeerPrefix.source: that replica's id): the replica fetches those blocks from
    # it when it holds fewer itself (router/replica/peer_fetch.py). None: no fetch.
    peer_prefix: PeerPrefix | None = None


@dataclass(frozen=True, slots=True)
class ExportCachedKV:
    request_id: str  # the fetching replica's sequence id (logs)
    prompt_token_ids: list[int]  # the prompt's leading tokens, whole blocks
    first_block: int  # the fetching replica holds the blocks before it
    num_blocks: int
    layout: KVLayout  # the fetching replica's: a holder with another one refuses
    lora_request: LoRARequest | None = None  # the blocks' chain is the adapter's
    cache_salt: str | None = None  # and the salt's


@dataclass(frozen=True, slots=True)
class PrefillKV:
    request_id: str  # the decode replica's sequence id (logs, and the prefill request's id)
    prompt_token_ids: list[int]  # the prompt minus its last token
    first_block: int  # the decode replica holds the blocks before it
    layout: KVLayout  # the decode replica's: a prefill replica with another one refuses
    lora_request: LoRARequest | None = None  # the sequence's adapter: its KV is the adapter's
    traceparent: str | None = None  # W3C trace context of the decode replica's remote prefill span


@dataclass(frozen=True, slots=True)
class PrefillKVDone:
    handle: object  # router.replica.kv_transport.KVHandle
    replica_id: str
    compute_s: float  # arrival at the prefill replica to its KV read out


@dataclass(frozen=True, slots=True)
class FinishSequences:
    sequence_ids: list[str]  # child ids (engine.request.child_request_ids)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class RequestFailed:
    request_id: str
    error: BaseException  # raised to the request's caller at the ingress


@dataclass(slots=True)
class StepOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    failures: list[RequestFailed] = field(default_factory=list)
    kv_events: list[KVEventBatch] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.failures or self.kv_events)


@dataclass(frozen=True, slots=True)
class ChannelSocket:
    node_id: str  # the ingress's Ray node: only a replica on it can reach the socket
    address: str  # an abstract-namespace Unix socket name
    token: str  # this call's: the first frame of its connection


@dataclass(frozen=True, slots=True)
class ChannelSocketEnd:
    frames: int  # StepOutputs written to the socket by this call


@dataclass(frozen=True, slots=True)
class KVEventsUpdate:
    snapshot: KVSnapshot | None  # the state to start from (then `batches` follow it)
    batches: list[KVEventBatch]


def encode(msg: StepOutputs | ChannelSocketEnd | KVEventsUpdate) -> bytes:
    # C pickle of small dataclasses costs a few microseconds each; Ray then ships one bytes object.
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(
    payload: bytes, kind: type | tuple[type, ...] = StepOutputs
) -> StepOutputs | ChannelSocketEnd | KVEventsUpdate:
    msg = pickle.loads(payload)  # only from our own replicas
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(msg) not in kinds:
        raise TypeError(f"message is a {type(msg).__name__}, not {' or '.join(k.__name__ for k in kinds)}")
    return msg
