"""Where the remote tier lives: a Valkey/Redis URL parsed into a typed, validated value.

Knows: the URL forms we accept and what each part means --

    valkey://[user:password@]host[:port][/db][?option=value&...]     (redis:// is the same)
    valkeys://... or rediss://...                                    TLS
    valkey://host1:port1,host2:port2,host3:port3                     a cluster (its seed nodes)
    valkey://host:port?cluster=1                                     a cluster from one seed node

TLS options in the query: ssl_ca_certs=PATH, ssl_certfile=PATH, ssl_keyfile=PATH,
ssl_cert_reqs=required|optional|none, ssl_check_hostname=0|1. The default port is 6379; a
cluster has no database number (db must be 0).
Doesn't know: clients, sockets or timeouts (storage/remote/tier.py builds the client from this).

The password never appears in repr() or `redacted` (status pages and logs show those): only
`connection_kwargs()` hands it to the client.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}   # scheme -> TLS
DEFAULT_PORT = 6379
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
_CERT_REQS = ("required", "optional", "none")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class RemoteURL:
    scheme: str
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    tls: bool = False
    cluster: bool = False
    tls_options: tuple[tuple[str, str], ...] = ()

    @property
    def redacted(self) -> str:
        """The URL as given, with the password replaced by '***' (safe to show and log)."""
        auth = ""
        if self.username or self.password:
            auth = (self.username or "") + (":***" if self.password else "") + "@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        query = [f"{k}={v}" for k, v in self.tls_options]
        if self.cluster and len(self.nodes) == 1:
            query.insert(0, "cluster=1")
        return f"{self.scheme}://{auth}{hosts}{'/' + str(self.db) if self.db else ''}" + \
            (f"?{'&'.join(query)}" if query else "")

    def __repr__(self) -> str:
        return f"RemoteURL({self.redacted!r})"

    def connection_kwargs(self) -> dict:
        """What every connection needs (redis-py's keyword names), password and TLS included."""
        kw: dict = {}
        if self.username:
            kw["username"] = self.username
        if self.password:
            kw["password"] = self.password
        if self.tls:
            kw["ssl"] = True
            for k, v in self.tls_options:
                kw[k] = v.lower() in _TRUE if k == "ssl_check_hostname" else v
        if not self.cluster and self.db:
            kw["db"] = self.db
        return kw


def parse_remote_url(url: str, field_name: str = "remote_url") -> RemoteURL:
    """A RemoteURL from a string; ValueError naming the field (and never the password)."""
    def bad(why: str) -> ValueError:
        shown = url
        try:
            shown = _redact_raw(url)
        except Exception:
            shown = "<unparseable>"
        return ValueError(f"{field_name}: {why} (got {shown!r}; expected e.g. 'valkey://host:6379', "
                          f"'rediss://:password@host:6380', 'valkey://h1:7000,h2:7001,h3:7002' or "
                          f"'valkey://host:7000?cluster=1')")
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{field_name}: expected a valkey://, redis:// or rediss:// URL, got {url!r}")
    scheme, sep, rest = url.strip().partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise bad(f"scheme must be one of {sorted(SCHEMES)}")
    # urlsplit cannot read a comma list of host:port pairs, so the URL is split by hand (a
    # password with '/', '?' or '@' in it must be percent-encoded, as in any URL).
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None   # "user@host" (no colon): a username, as redis-py reads it
    nodes = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise bad("empty host")
        try:
            s = urlsplit(f"//{part}")
            host, port = s.hostname, s.port or DEFAULT_PORT
        except ValueError as e:
            raise bad(f"bad host:port {part!r}: {e}") from None
        if not host:
            raise bad(f"bad host:port {part!r}")
        nodes.append((host, port))
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    cluster_opt = params.pop("cluster", None)
    if cluster_opt is not None and cluster_opt.lower() not in _TRUE + _FALSE:
        raise bad(f"cluster: expected 1 or 0, got {cluster_opt!r}")
    cluster = len(nodes) > 1 or (cluster_opt or "0").lower() in _TRUE
    if len(nodes) > 1 and cluster_opt is not None and cluster_opt.lower() in _FALSE:
        raise bad("several nodes are a cluster; cluster=0 contradicts them")
    tls_options = []
    for k in list(params):
        if k in _TLS_OPTIONS:
            v = params.pop(k)
            if k == "ssl_cert_reqs" and v.lower() not in _CERT_REQS:
                raise bad(f"ssl_cert_reqs: expected one of {_CERT_REQS}, got {v!r}")
            if k == "ssl_check_hostname" and v.lower() not in _TRUE + _FALSE:
                raise bad(f"ssl_check_hostname: expected 1 or 0, got {v!r}")
            tls_options.append((k, v))
    if params:
        raise bad(f"unknown option {sorted(params)[0]!r} (known: cluster, {', '.join(_TLS_OPTIONS)})")
    tls = SCHEMES[scheme]
    if tls_options and not tls:
        raise bad("TLS options need a TLS scheme (rediss:// or valkeys://)")
    db = 0
    if path.strip("/"):
        if not path.strip("/").isdigit():
            raise bad(f"database must be a number, got {path!r}")
        db = int(path.strip("/"))
    if cluster and db:
        raise bad("a cluster has only database 0")
    return RemoteURL(scheme, tuple(nodes), username, password, db, tls, cluster, tuple(tls_options))


def _redact_raw(url: str) -> str:
    """An unparsed URL with any password hidden, for error messages."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = auth.partition(":")
    return f"{scheme}{sep}{user + ':***' if colon else user}@{hosts}{slash}{tail}"
