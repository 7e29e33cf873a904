"""Host memory of an exact size, page-locked for the GPU where that works.

Knows: `torch.empty(..., pin_memory=True)` goes through the caching host allocator, which rounds
every allocation up to a power of two (a 5 GiB host tier would lock 8 GiB of RAM) and has no
fallback when locking fails. So the slab is an anonymous mmap of exactly the bytes asked for,
registered with `cudaHostRegister` (portable: pinned for every device) in chunks (as vLLM and SGLang do: one huge registration is
slow and can fail where chunks succeed), and unregistered on close. When registration fails
(RLIMIT_MEMLOCK, a container's limits, no CUDA), the slab stays pageable, a warning says so,
and `pinned` is False (shown in cache status): copies still work, only slower and staged.
Doesn't know what the bytes are (storage/host_tier.py).
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

REGISTER_CHUNK = 1 << 30          # bytes per cudaHostRegister call
# cudaHostRegisterPortable: the memory counts as pinned in every CUDA context, not only the one
# current on the registering thread -- a loader thread's current device is 0 while the pool may
# be on cuda:N, and memory pinned for device 0 alone is pageable (staged copies) for cuda:N.
HOST_REGISTER_PORTABLE = 1


@dataclass
class HostBuffer:
    tensor: torch.Tensor            # uint8 [nbytes]
    pinned: bool
    pinned_bytes: int               # registered with CUDA (0 when pageable)
    _mm: mmap.mmap | None = None
    _chunks: list[int] = field(default_factory=list)    # registered base addresses

    def close(self) -> None:
        """Unregister and unmap. NOTE: the caller has stopped every copy into or out of it."""
        if self._chunks:
            cudart = torch.cuda.cudart()
            for ptr in self._chunks:
                cudart.cudaHostUnregister(ptr)
            self._chunks = []
        self.pinned, self.pinned_bytes = False, 0
        if self._mm is not None:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            try:
                self._mm.close()
            except BufferError:      # a view of it is still alive somewhere: the OS frees it at exit
                pass
            self._mm = None


def host_buffer(nbytes: int, pin: bool, device: torch.device | None = None) -> HostBuffer:
    """nbytes of host memory, page-locked if `pin` and CUDA lets us (else pageable + a warning).
    Registered portable (for every device), with `device` (the pool's, when CUDA) current."""
    if nbytes == 0 or not pin:
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8), False, 0)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mm, dtype=torch.uint8)
    buf = HostBuffer(tensor, False, 0, mm)
    try:
        cudart = torch.cuda.cudart()
        base = tensor.data_ptr()
        cuda_device = device if device is not None and device.type == "cuda" else None
        with torch.cuda.device(cuda_device):          # None: the current device (portable anyway)
            for off in range(0, nbytes, REGISTER_CHUNK):
                size = min(REGISTER_CHUNK, nbytes - off)
                err = cudart.cudaHostRegister(base + off, size, HOST_REGISTER_PORTABLE)
                if int(getattr(err, "value", err)) != 0:
                    raise RuntimeError(f"cudaHostRegister failed ({err}) at offset {off} of {nbytes} bytes")
                buf._chunks.append(base + off)
    except Exception as e:                     # no CUDA, a locked-memory limit, ...
        log.warning("host tier: %d bytes could not be pinned (%s); using pageable memory "
                    "(device <-> host copies are staged and slower; cache status shows pinned: false)", nbytes, e)
        buf.close()
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8), False, 0)
    buf.pinned, buf.pinned_bytes = True, nbytes
    return buf
