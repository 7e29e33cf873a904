"""What every route of one app shares: the engine, settings, keys, dispatcher and metrics.

Knows: how a route gets at them (`ctx(request)`) and the per-request checks every route
repeats: who is calling, and whether the named model is the one served.
Doesn't know: any route's logic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from service.auth import ApiKeys, Caller, resolve_caller
from service.dispatch import Dispatcher
from service.errors import APIError
from service.metrics import ServiceMetrics
from service.settings import ServiceSettings


@dataclass
class AppContext:
    engine: Any                    # engine.engine.Engine (duck-typed: tests and tools may wrap it)
    settings: ServiceSettings
    keys: ApiKeys | None
    dispatcher: Dispatcher
    metrics: ServiceMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    engine_closed: bool = False

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def authenticate(self, request: Request) -> None:
        """With keys, a request without a valid one stops here (401), before its body is read."""
        if self.keys is not None:
            self.keys.caller(request.headers.get("authorization"))

    def caller(self, request: Request, user: object = None) -> Caller:
        return resolve_caller(self.keys, request.headers.get("authorization"), user)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model: {model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def ctx(request: Request) -> AppContext:
    return request.app.state.tieredkv
