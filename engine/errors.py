"""Typed errors the engine raises; the serving layer maps them to HTTP status codes."""

from __future__ import annotations


class OrbitalError(Exception):
    """Base of every error Orbital raises on purpose."""


class InvalidRequestError(OrbitalError, ValueError):
    """The request itself is wrong (bad sampling value, empty prompt...). HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output does not fit in the model's context. HTTP 400."""


class EngineDeadError(OrbitalError, RuntimeError):
    """The engine (or one of its workers) died; requests in flight are failed. HTTP 503."""


class EngineStepError(EngineDeadError):
    """The engine loop died because a step raised: one of the requests in that step may be the
    cause, so a request that sees this twice is not moved to a third engine, and one that first
    ran in that step (`suspect`) is not moved at all."""

    def __init__(self, message: str, suspect: bool = False) -> None:
        super().__init__(message)
        self.suspect = suspect

    def __reduce__(self):  # crosses Ray pickled: keep `suspect`
        return type(self), (str(self), self.suspect)


class AdapterNotFoundError(InvalidRequestError):
    """A request names a LoRA adapter the engine does not know. HTTP 404."""
