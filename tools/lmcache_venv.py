"""The peer of tools/bench_peers.py: LMCache's storage layer in its own virtual environment (built
or reused: lmcache pinned, installed --no-deps beside the few packages its CPU storage layer
imports, reusing this interpreter's torch), and tools/lmcache_peer.py driven in a child process in
that venv (one JSON command per line in, one RESULT line out), told how many consecutive blocks
make one of LMCache's chunks. Knows nothing of our tiers, the rounds or the targets.
"""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import stop_peer  # noqa: E402  (sibling scripts)
from storage.layout import dtype_name  # noqa: E402

LMCACHE_VERSION = "0.5.6"
# What LMCache 0.5.6's storage layer imports on a CPU, found by importing it in a bare venv. Its
# full requirement list also pulls CUDA (cupy-cuda13x, cuda-python, nvtx), cloud and telemetry
# SDKs (google-cloud-bigtable, awscrt, grpcio, opentelemetry) that this layer never imports, so
# lmcache goes in with --no-deps and these beside it. numpy<=2.2.6 is lmcache's own pin (numba
# needs it too); valkey-glide-sync is the client of its valkey:// connector.
LMCACHE_DEPS = ("cachetools", "numba", "numpy<=2.2.6", "aiohttp", "aiofile", "msgspec", "pyzmq", "valkey-glide-sync")


def ensure_lmcache(venv: str) -> tuple[str | None, str]:
    """(python of a venv holding lmcache==LMCACHE_VERSION, how) or (None, why not). Builds the
    venv when missing: --system-site-packages, plus a .pth naming this interpreter's own
    site-packages (where a project venv keeps torch: --system-site-packages alone reaches only the
    base interpreter's), so LMCache reuses this torch instead of downloading one."""
    py = os.path.join(venv, "bin", "python")
    check = [py, "-c", f"import importlib.metadata as m; assert m.version('lmcache') == '{LMCACHE_VERSION}'; "
             "import torch, lmcache.v1.storage_backend.local_disk_backend, glide_sync"]
    if os.path.exists(py) and subprocess.run(check, capture_output=True, timeout=300).returncode == 0:
        return py, f"reused {venv}"
    try:
        if not os.path.exists(py):
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True,
                           capture_output=True, timeout=300)
            purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True, timeout=60).stdout.strip()
            ours = [p for p in site.getsitepackages() if os.path.isdir(p)]
            with open(os.path.join(purelib, "zz_tieredkv_parent.pth"), "w") as f:
                f.write("\n".join(ours) + "\n")
        pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        for cmd in (pip + ["--no-deps", f"lmcache=={LMCACHE_VERSION}"], pip + list(LMCACHE_DEPS)):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                return None, f"`{' '.join(cmd[2:])}` failed: {(out.stderr or out.stdout).strip()[-600:]}"
        out = subprocess.run(check, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return None, f"lmcache installed but its storage layer does not import: {out.stderr.strip()[-600:]}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build {venv}: {e}"
    return py, f"installed into {venv}"


class PeerProcess:
    """tools/lmcache_peer.py in LMCache's venv: one JSON command per line in, one RESULT line out."""

    def __init__(self, python: str, blocks: torch.Tensor, workdir: str, url: str | None,
                 chunk_blocks: int = 1) -> None:
        """chunk_blocks: consecutive blocks LMCache stores as one chunk (one key, one file)."""
        self.workdir = workdir
        path = os.path.join(workdir, "blocks.bin")
        blocks.contiguous().view(torch.uint8).numpy().tofile(path)
        self.log_path = os.path.join(workdir, "lmcache_peer.log")
        driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lmcache_peer.py")
        cmd = [python, driver, "--blocks-file", path, "--shape", ",".join(map(str, blocks.shape[1:])),
               "--dtype", dtype_name(blocks.dtype), "--workdir", workdir, "--chunk-blocks", str(chunk_blocks)]
        cmd += ["--url", url] if url else []
        env = dict(os.environ, LMCACHE_LOG_LEVEL="WARNING", PYTHONPATH="")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env, cwd=workdir)
        try:
            self.hello = self._read()
        except Exception:
            self.close()
            raise

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                if "error" in res:
                    raise RuntimeError(f"LMCache driver: {res['error']} (log: {self.log_path})")
                return res
        raise RuntimeError(f"LMCache driver exited (rc {self.proc.wait()}); log: {self.tail()}")

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def tail(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-1500:]
        except OSError:
            return ""

    def close(self) -> None:
        stop_peer(self.proc)
        self._log.close()

