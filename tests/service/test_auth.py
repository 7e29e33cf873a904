"""API keys: 401 without a valid key, 403 for admin routes, the tenant always from the key."""
from __future__ import annotations

import openai
import pytest

from service.auth import ApiKeys
from service.server import check_bind, serve
from service.settings import ServiceSettings
from tests.service.conftest import ServerThread, write_keys
from tests.service.tiny_engine import build_engine

ADMIN, ACME, BETA, ROOT = "sk-admin-0001", "sk-acme-0001", "sk-beta-0001", "sk-root-0001"
KEYS = {ADMIN: {"tenant": "ops", "role": "admin"}, ACME: {"tenant": "acme", "role": "user"},
        BETA: {"tenant": "beta"}, ROOT: {"tenant": "root", "role": "user"}}
PROMPT = "Every tenant's cache is salted with its own name, so no tenant can read another's blocks"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("auth")
    settings = ServiceSettings(api_keys_file=write_keys(tmp / "keys.json", KEYS), admin_tenants=("root",))
    with ServerThread(build_engine(tmp, tokenizer), settings) as s:
        yield s


def as_(server, key):
    return server.client(headers={"Authorization": f"Bearer {key}"})


def gen(c, engine, prompt=PROMPT, **kw):
    return c.post("/v1/completions", json={"model": engine.model_name, "prompt": prompt, "max_tokens": 2,
                                           "temperature": 0, **kw})


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/cache/status"),
                                         ("POST", "/v1/cache/lookup"), ("GET", "/v1/cache/billing"),
                                         ("POST", "/v1/cache/flush")])
@pytest.mark.parametrize("header", [None, "Bearer sk-wrong-0000", "Basic c2stYWNtZS0wMDAx", "Bearer"])
def test_401_without_a_valid_key(keyed, method, path, header):
    with keyed.client(headers={"Authorization": header} if header else {}) as c:
        r = c.request(method, path, content=b"{not json")      # auth is checked before the body
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_health_and_metrics_need_no_key(keyed):
    with keyed.client() as c:
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_admin_routes_need_the_admin_role(keyed):
    with as_(keyed, ACME) as c:
        r = c.post("/v1/cache/flush", json={})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    with as_(keyed, ADMIN) as c:
        assert c.post("/v1/cache/flush", json={}).status_code == 200
    with as_(keyed, ROOT) as c:       # role user, but listed in admin_tenants
        assert c.post("/v1/cache/flush", json={"tier": "host"}).status_code == 200


def test_tenant_comes_from_the_key_not_the_user_field(keyed):
    engine = keyed.engine
    with as_(keyed, ACME) as c:
        r = gen(c, engine, user="beta")
        assert r.status_code == 200
        bill = c.get("/v1/cache/billing").json()
        assert bill["tenant"] == "acme" and bill["requests"] == 1
        assert c.get("/v1/cache/billing", params={"tenant": "acme"}).json()["requests"] == 1
        r = c.get("/v1/cache/billing", params={"tenant": "beta"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        # acme's blocks are acme's: acme hits them, beta (same prompt) does not.
        assert c.post("/v1/cache/lookup", json={"prompt": PROMPT, "user": "beta"}).json()["hit_tokens"] > 0
    with as_(keyed, BETA) as c:
        got = c.post("/v1/cache/lookup", json={"prompt": PROMPT}).json()
        assert got["tenant"] == "beta" and got["hit_tokens"] == 0
        assert gen(c, engine).json()["usage"]["prompt_cache_hit_tokens"] == 0
        assert c.get("/v1/cache/billing").json()["requests"] == 1
    with as_(keyed, ADMIN) as c:
        everyone = c.get("/v1/cache/billing").json()
        assert {t: b["requests"] for t, b in everyone["tenants"].items()} == {"acme": 1, "beta": 1}
        assert c.get("/v1/cache/billing", params={"tenant": "beta"}).json()["requests"] == 1


def test_openai_client_with_keys(keyed):
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=ACME, max_retries=0) as c:
        assert [m.id for m in c.models.list()] == [keyed.engine.model_name]
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-nobody-000", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=keyed.engine.model_name, prompt="hi", max_tokens=1)


@pytest.mark.parametrize("data,match", [
    ({}, "non-empty object"),
    ([], "non-empty object"),
    ({"sk-short": "acme"}, "expected {"),
    ({"sk-1": {"tenant": "a"}}, "8\\+ characters"),
    ({"sk-aaaaaaaa": {"role": "admin"}}, "tenant"),
    ({"sk-aaaaaaaa": {"tenant": "a", "role": "root"}}, "role: expected one of"),
    ({"sk-aaaaaaaa": {"tenant": "a", "rol": "admin"}}, "unknown field 'rol'"),
    ({"sk-aaaaaaaa": {"tenant": ""}}, "tenant"),
])
def test_keys_file_validation(tmp_path, data, match):
    with pytest.raises(ValueError, match=match):
        ApiKeys.from_dict(data)
    path = write_keys(tmp_path / "k.json", data)
    with pytest.raises(ValueError, match="api_keys_file"):
        ApiKeys.from_file(path)


def test_keys_file_that_is_not_json(tmp_path):
    (tmp_path / "k.json").write_text("sk-abc: acme")
    with pytest.raises(ValueError, match="not valid JSON"):
        ApiKeys.from_file(tmp_path / "k.json")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com", "127.evil.com"])
def test_serve_refuses_public_hosts_without_keys(host):
    with pytest.raises(ValueError, match="^host: refusing"):
        check_bind(host, ServiceSettings())
    with pytest.raises(ValueError, match="^host: refusing"):
        serve(None, ServiceSettings(), host=host, port=0)      # refused before anything is built
    check_bind(host, ServiceSettings(api_keys_file="keys.json"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_need_no_keys(host):
    check_bind(host, ServiceSettings())


@pytest.mark.parametrize("kwargs,field", [({"max_queue": 0}, "max_queue"), ({"request_timeout_s": 0}, "request_timeout_s"),
                                          ({"shutdown_timeout_s": -1}, "shutdown_timeout_s"), ({"port": 70000}, "port"),
                                          ({"admin_tenants": "root"}, "admin_tenants"),
                                          ({"default_chat_max_tokens": 0}, "default_chat_max_tokens"),
                                          ({"header_timeout_s": 0}, "header_timeout_s"),
                                          ({"body_timeout_s": float("inf")}, "body_timeout_s")])
def test_settings_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ServiceSettings(**kwargs)


def test_status_shows_a_user_key_only_its_own_tenant(keyed):
    # Issue 7, item 11: tier-wide hit counts describe every tenant's traffic.
    engine = keyed.engine
    with as_(keyed, ACME) as c:
        assert gen(c, engine, prompt=PROMPT + " (status)").status_code == 200
        mine = c.get("/v1/cache/status").json()
        assert set(mine) == {"tenant", "usage", "note"} and mine["tenant"] == "acme"
        assert mine["usage"]["tenant"] == "acme" and mine["usage"]["requests"] >= 1
    with as_(keyed, ADMIN) as c:
        full = c.get("/v1/cache/status").json()
        assert {"device", "host", "disk"} <= set(full["tiers"])


def test_metrics_can_require_an_admin_key(tmp_path, tokenizer):
    settings = ServiceSettings(api_keys_file=write_keys(tmp_path / "keys.json", KEYS), protect_metrics=True)
    with ServerThread(build_engine(tmp_path, tokenizer), settings) as s:
        with s.client() as c:
            assert c.get("/metrics").status_code == 401 and c.get("/health").status_code == 200
        with as_(s, ACME) as c:
            assert c.get("/metrics").status_code == 403
        with as_(s, ADMIN) as c:
            r = c.get("/metrics")
            assert r.status_code == 200 and "tieredkv" in r.text
