"""Copies between the device pool and host memory.

Knows: on CUDA, copies run non-blocking on a dedicated copy stream (host memory is pinned, so
they are truly asynchronous) and `fence()` makes the compute stream wait for them before any
page they filled is read. On CPU every copy is a plain synchronous memcpy and `fence()` is free.
Doesn't know: which blocks move or why.
"""
from __future__ import annotations

import torch


class Transfer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src. On CUDA: asynchronous on the copy stream, ordered after the compute
        stream's work so far (the source page may have just been written by attention)."""
        if not self.cuda:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self._pending = True

    def fence(self) -> None:
        """Compute-stream work issued after this sees every copy issued before it.
        NOTE invariant: called before a promoted page is read and before a page is reused."""
        if self.cuda and self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._pending = False

    def sync_host(self) -> None:
        """Host code (the disk writer) may read host buffers written by earlier copies."""
        if self.cuda and self._pending:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._pending = False
