"""tools/valkey_servers.py's ValkeyServer (the real valkey-server the store tests run against): a
stopped server's port stays ours, so a restart comes back where its clients point -- never on
another port while they go on talking to whatever took the old one (an xdist neighbour's store)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from valkey_servers import ValkeyServer, _hold_port, _is_free, _ping  # noqa: E402  (tools/ is not a package)


def test_a_stopped_servers_port_refuses_connections_and_nobody_else_can_take_it():
    server = ValkeyServer()
    try:
        server.start()
        port = server.port
        server.stop()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert not _is_free(port)                    # held: free_port's check passes it by
        server.start()
        assert server.port == port and _ping(port)   # back where its clients point
    finally:
        server.cleanup()
    other = _hold_port(port)                              # cleanup let it go
    assert other is not None
    other.close()


def test_a_restart_whose_port_was_taken_fails_instead_of_moving():
    server = ValkeyServer()
    try:
        server.start()
        port = server.port
        server.stop()
        server._release()                            # as if the port were taken before stop could hold it
        thief = _hold_port(port)
        assert thief is not None
        thief.listen(1)
        try:
            with pytest.raises(RuntimeError, match="did not start"):
                server.start()
            assert server.port == port
        finally:
            thief.close()
    finally:
        server.cleanup()
