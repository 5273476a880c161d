"""One request's measured timeline, and the error kinds a request can end with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Error kinds (``RequestRecord.error_kind``); HTTP status errors are "http_<code>".
CONNECT = "connect"  # could not connect / connection refused
TIMEOUT = "timeout"  # connect, read or whole-request timeout
DROPPED = "stream_dropped"  # connection closed mid-body (incomplete chunked read, reset)
NO_DONE = "no_done"  # body ended cleanly but without "data: [DONE]"
STREAM_ERROR = "stream_error"  # an error event / {"error": ...} inside the stream
SHORT = "short_output"  # fewer tokens than forced with ignore_eos
EMPTY = "empty_output"  # no token at all
BAD_CHUNK = "bad_chunk"  # a data line that is not JSON
CANCELLED = "cancelled"  # still running when the run's duration bound cut it off
OTHER = "other"


@dataclass
class RequestRecord:
    """Times are seconds. ``start`` is from the run's start; the rest from the request's send."""

    id: str
    kind: str = "custom"
    start: float = 0.0
    success: bool = False
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    retry_after: str | None = None  # the Retry-After header of a refused (429/503) request
    ttft: float | None = None
    latency: float | None = None  # end-to-end
    itl: list[float] = field(default_factory=list)  # gaps between token chunks after the first
    chunk_tokens: list[int] = field(default_factory=list)  # tokens counted per chunk (1 each)
    output_tokens: int = 0  # usage.completion_tokens when the server gives it
    prompt_tokens: int = 0  # usage.prompt_tokens, else the workload's count
    expected_output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    usage_reported: bool = False
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (latency - ttft) / (output_tokens - 1)."""
        if not self.success or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float | None:
        return None if self.latency is None else self.start + self.latency

    def token_times(self) -> list[float]:
        """Absolute (run-relative) arrival time of each chunk, for throughput over time."""
        if self.ttft is None:
            return []
        t = self.start + self.ttft
        out = [t]
        for gap in self.itl:
            t += gap
            out.append(t)
        return out

    def fail(self, kind: str, message: str) -> "RequestRecord":
        self.success, self.error_kind, self.error = False, kind, message[:500]
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})
