"""A tiny-engine server in its own process, for the crash and shutdown tests.

    python tests/service/server_main.py --cache-dir DIR --tokenizer-dir DIR [--api-keys FILE]

Binds 127.0.0.1 on a free port, prints `LISTENING <port>` once it is ready to accept, and
serves until SIGTERM/SIGINT (graceful: exit status 0) or SIGKILL.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from service.server import serve  # noqa: E402
from service.settings import ServiceSettings  # noqa: E402
from tests.service.tiny_engine import build_engine, load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--api-keys", default=None)
    ap.add_argument("--shutdown-timeout", type=float, default=30.0)
    args = ap.parse_args()
    engine = build_engine(args.cache_dir, load_tokenizer(args.tokenizer_dir))
    # IPPROTO_TCP: so asyncio turns Nagle off (a 40 ms wait per response otherwise; see
    # tests/service/conftest.py's ServerThread).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    # The socket already listens: connections made from now on wait in the backlog until
    # uvicorn accepts them, so the port can be announced before serve() starts.
    print(f"LISTENING {sock.getsockname()[1]}", flush=True)
    serve(engine, ServiceSettings(api_keys_file=args.api_keys, shutdown_timeout_s=args.shutdown_timeout),
          sock=sock, log_level="warning")
    print("EXITED CLEANLY", flush=True)


if __name__ == "__main__":
    main()
