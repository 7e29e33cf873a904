"""One step's integer metadata, sent to the device in one asynchronous copy.

Knows: a persistent host buffer (pinned on CUDA) and a persistent device buffer, both grown to
the largest step seen. A step writes all its integers (token ids, positions, block tables,
write slots, ...) into the host buffer, and one non-blocking copy moves them; the views handed
back live in the device buffer.
NOTE invariant: the host buffer is rewritten only after the previous step's copy out of it has
completed (an event recorded after the copy, waited for before the next write -- normally long
done, since the engine reads every step's sampled tokens back). The device buffer is rewritten
by the next step's copy, which the compute stream orders after this step's kernels.
On CPU it is a plain tensor: the "device" views are the host values.
Doesn't know what the integers mean (engine/paged_attention.py lays them out).
"""
from __future__ import annotations

import numpy as np
import torch


class StepUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None
        self.copies = 0                               # uploads made (one per step; for tests)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """values (int64, 1-D) -> a device tensor holding them (valid until the next upload)."""
        n = values.shape[0]
        if not self.cuda:
            self.copies += 1
            return torch.from_numpy(values)
        if self._copied is not None:
            self._copied.synchronize()                # the last copy out of the host buffer is done
        if self._host.numel() < n:
            size = max(n, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._dev = torch.empty(size, dtype=torch.int64, device=self.device)
        self._host.numpy()[:n] = values
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.copies += 1
        return dev
