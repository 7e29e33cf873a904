"""Errors the engine raises beyond ValueError (bad input)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine was closed; it admits no new requests (HTTP 503)."""
