"""Who is calling: an API key -> a tenant and a role, or, without keys, the `user` field.

Knows: the keys file (`{"sk-...": {"tenant": "acme", "role": "admin" | "user"}}`) and the
rules: with keys every request needs `Authorization: Bearer <key>` (401 without or unknown;
the Messages routes take Anthropic's `x-api-key: <key>` too)
and its tenant comes from the key, never from the body; without keys (a loopback-only
server) the tenant is the `user` field or "default" and every caller is an admin.
Doesn't know: cache salts -- the engine derives a tenant's salt from its name, so a client
can never choose whose cache it reads.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from service.errors import APIError, bad_request
from engine.billing import validate_tenant

DEFAULT_TENANT = "default"
ROLES = ("admin", "user")
_MAX_TENANT_BYTES = 128      # UTF-8; well inside the ledger's key limit


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    admin: bool


def check_tenant_name(name: object, field: str) -> str:
    """Tenant names become ledger keys: short, printable, non-empty. NOTE: checked here, before
    the engine runs the request, because the ledger refusing a name only at billing time
    would fail a request whose tokens were already computed."""
    if not isinstance(name, str) or not name or len(name.encode()) > _MAX_TENANT_BYTES or not name.isprintable():
        raise ValueError(f"{field}: expected a printable tenant name of 1..{_MAX_TENANT_BYTES} UTF-8 bytes, got {name!r}")
    return validate_tenant(name)


class ApiKeys:
    """The keys file, held as sha256(key) -> Caller so that no lookup compares secrets directly."""

    def __init__(self, entries: dict[str, Caller]) -> None:
        self._by_digest = {_digest(k): c for k, c in entries.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def from_file(cls, path: str | os.PathLike, admin_tenants: tuple[str, ...] = ()) -> "ApiKeys":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"api_keys_file: {path} is not valid JSON: {e}") from e
        return cls.from_dict(data, admin_tenants, source=path)

    @classmethod
    def from_dict(cls, data: object, admin_tenants: tuple[str, ...] = (), source: str = "api keys") -> "ApiKeys":
        if not isinstance(data, dict) or not data:
            raise ValueError(f"api_keys_file: {source}: expected a non-empty object {{\"sk-...\": {{\"tenant\": ..., \"role\": ...}}}}")
        entries = {}
        for key, spec in data.items():
            shown = f"{key[:6]}..." if isinstance(key, str) else repr(key)
            if not isinstance(key, str) or len(key) < 8 or not key.isprintable() or " " in key:
                raise ValueError(f"api_keys_file: key {shown}: expected a printable string of 8+ characters without spaces")
            if not isinstance(spec, dict):
                raise ValueError(f"api_keys_file: key {shown}: expected {{\"tenant\": ..., \"role\": ...}}, got {spec!r}")
            unknown = sorted(set(spec) - {"tenant", "role"})
            if unknown:
                raise ValueError(f"api_keys_file: key {shown}: unknown field {unknown[0]!r}")
            tenant = check_tenant_name(spec.get("tenant"), f"api_keys_file: key {shown}: tenant")
            role = spec.get("role", "user")
            if role not in ROLES:
                raise ValueError(f"api_keys_file: key {shown}: role: expected one of {ROLES}, got {role!r}")
            entries[key] = Caller(tenant, role == "admin" or tenant in admin_tenants)
        return cls(entries)

    @classmethod
    def of(cls, path: str | os.PathLike | None, inline: tuple[str, ...] = (),
           admin_tenants: tuple[str, ...] = ()) -> "ApiKeys | None":
        """The server's keys: a keys file's, and keys given one by one (vLLM's `--api-key`: each
        an admin of the default tenant, as a vLLM key may do anything); None when there are none."""
        if path is None and not inline:
            return None
        keys = cls.from_file(path, admin_tenants) if path is not None else cls({})
        if inline:
            # Any non-empty key, as vLLM's --api-key takes it (the keys file asks more of its keys);
            # a header's surrounding spaces never arrive, so they are not part of the key.
            if not all(isinstance(k, str) and k.strip() and k.isprintable() for k in inline):
                raise ValueError("--api-key: expected a non-empty key without control characters")
            given = cls({k.strip(): Caller(DEFAULT_TENANT, True) for k in inline})
            both = set(keys._by_digest) & set(given._by_digest)
            if both:
                raise ValueError("--api-key: a key given there is also in the keys file; give it once")
            keys._by_digest.update(given._by_digest)
        return keys

    def caller(self, authorization: str | None) -> Caller:
        """The caller behind an `Authorization` header; APIError 401 when there is none."""
        if not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key")
        found = self._by_digest.get(_digest(key.strip()))
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def resolve_caller(keys: ApiKeys | None, authorization: str | None, user: object = None,
                   user_field: str = "user") -> Caller:
    """The tenant and role of a request. `user` (the OpenAI body field; Anthropic's
    metadata.user_id, named by `user_field`) names the tenant only when the server has no keys;
    with keys it is just the client's end-user label."""
    if keys is not None:
        return keys.caller(authorization)
    if user is None:
        return Caller(DEFAULT_TENANT, admin=True)
    try:
        return Caller(check_tenant_name(user, user_field), admin=True)
    except ValueError as e:
        raise bad_request(str(e), param=user_field) from None


def authorization_of(authorization: str | None, x_api_key: str | None) -> str | None:
    """A request's credentials as an Authorization header's value: its own, or Anthropic's
    `x-api-key: <key>` read as `Bearer <key>` (the same keys, the same tenants); 401 when both
    are sent and name different keys."""
    if x_api_key is None:
        return authorization
    key = x_api_key.strip()
    if authorization is not None:
        scheme, _, other = authorization.partition(" ")
        if scheme.lower() != "bearer" or other.strip() != key:
            raise APIError(401, "x-api-key and Authorization name different keys; send one of them",
                           code="invalid_api_key")
    return f"Bearer {key}" if key else None


def require_admin(caller: Caller) -> None:
    if not caller.admin:
        raise APIError(403, f"this route needs an admin key; tenant {caller.tenant!r} has the user role",
                       code="admin_required")
