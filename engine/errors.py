"""Errors the engine raises beyond ValueError (bad input)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine was closed; it admits no new requests (HTTP 503)."""


class BillingUnavailable(RuntimeError):
    """The ledger cannot take this request's bill now, and nothing can hold it (the memory bound
    is reached, or --on-billing-failure refuse): retry later (HTTP 503 with Retry-After)."""
