"""glibc keeps block-sized memory once the tiers are built: allocations of a block's size come from
its heap (reused), not from fresh mappings -- read off glibc's own counters (mallinfo2), in a fresh
process each time, since the setting is per process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from storage.malloc_tuning import _glibc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Allocates 32 buffers of a bf16 block's size and prints how many of them glibc mapped on their own
# (mallinfo2.hblks, its count of mmap'd chunks in use), after whatever `setup` does.
CHILD = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
{setup}
before = libc.mallinfo2().hblks
bufs = [bytearray(368_640) for _ in range(32)]
print(libc.mallinfo2().hblks - before, tuned)
"""


def run_child(setup: str, **env: str) -> tuple[int, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "TIEREDKV_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", CHILD.format(setup=setup)], cwd=ROOT, env={**e, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mapped, tuned = out.stdout.split()
    return int(mapped), tuned


needs_glibc = pytest.mark.skipif(_glibc() is None, reason="not glibc: malloc_tuning leaves other allocators alone")


@needs_glibc
def test_building_a_tier_makes_block_sized_allocations_come_from_the_heap(tmp_path) -> None:
    untuned = "tuned = None"
    assert run_child(untuned) == (32, "None")                 # glibc's default: a mapping each
    build = ("from storage.disk.tier import DiskTier\n"
             f"d = DiskTier({str(tmp_path / 'd')!r}, 1 << 26)\n"
             "from storage.malloc_tuning import keep_freed_memory\n"
             "tuned = keep_freed_memory()")
    assert run_child(build) == (0, "True")                    # after a tier was built: none


@needs_glibc
def test_the_users_own_settings_and_the_opt_out_are_left_alone() -> None:
    call = "from storage.malloc_tuning import keep_freed_memory\ntuned = keep_freed_memory()"
    assert run_child(call, TIEREDKV_MALLOC_TUNING="0") == (32, "False")
    # Their own threshold (1 GiB here) stands: glibc maps nothing either, but by their setting.
    assert run_child(call, MALLOC_MMAP_THRESHOLD_=str(1 << 30)) == (0, "False")
