#!/usr/bin/env bash
# The compiled read batch (storage/codec/_block_batch.c with block_checks.h, zstd_planes.h,
# nibble_kernel.h; and _nibble.c) built under AddressSanitizer and UBSan in a scratch copy of the
# tree, then tests/storage/test_batch_fuzz.py's forged blocks run through it: a read past a buffer or
# undefined behaviour stops the run with its stack; a verdict that differs from the Python path's
# fails a test. The batch's own tests (raw, nibble, zstd) run under the sanitizers too. The installed build is not touched.
#
#   bash tools/fuzz_batch_asan.sh [SEEDS] [CASES]     # defaults: 1..20, 400 cases each (~3 min here)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
seeds=${1:-$(seq -s, 1 20)}
cases=${2:-400}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/storage" "$root/tests" "$work/"
[ -f "$root/pyproject.toml" ] && cp "$root/pyproject.toml" "$work/"
inc=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
flags=(-shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -pthread -I"$inc")
gcc "${flags[@]}" "$work/storage/codec/_block_batch.c" -o "$work/storage/codec/_block_batch$suffix" -ldl
gcc "${flags[@]}" "$work/storage/codec/_nibble.c" -o "$work/storage/codec/_nibble$suffix"
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
cd "$work"
LD_PRELOAD="$asan $ubsan" ASAN_OPTIONS=detect_leaks=0 "$py" -c "
import sys; sys.path.insert(0, '.')
from storage.codec import _block_batch, _nibble
assert _block_batch.__file__.startswith('$work') and _nibble.__file__.startswith('$work'), 'not the sanitized build'"
echo "fuzz: seeds $seeds, $cases cases each, under ASan + UBSan ($work)"
LD_PRELOAD="$asan $ubsan" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 FUZZ_SEEDS="$seeds" FUZZ_CASES="$cases" \
  "$py" -m pytest -q -p no:cacheprovider tests/storage/test_batch_fuzz.py tests/storage/test_raw_batch.py \
    tests/storage/test_nibble_batch.py tests/storage/test_zstd_batch.py tests/storage/test_nibble.py
