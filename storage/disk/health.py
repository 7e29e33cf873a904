"""How the disk tier's status reads outside the cache (storage/tier_health.py's rows): "writes
off", "recovered" or "unavailable" in /ready, its own series (tieredkv_disk_*: compression,
the writer's queue, damage found, a store moved aside, writes off, the free space's bound), and
its lines under `tieredkv status`.

Knows: the fields DiskTier's status carries (storage/disk/stats.py, and the wiring's `unavailable`
for a configured disk that could not open) and what each means to an operator.
Doesn't know: the store (nothing here opens LMDB), HTTP, Prometheus or rich.
"""
from __future__ import annotations

from typing import Iterable

from storage.tier_health import MetricRow, Span, StatusLine, TierHealth, line, number, size

_GAUGES = (("compression_ratio", "Raw bytes / compressed bytes of the disk tier"),
           ("pending_writes", "Blocks waiting in the disk writer's queue"))
_COUNTERS = (("corrupt", "Disk blocks that failed verification when read (a miss; deleted)"),
             ("read_errors", "Disk reads that failed with an LMDB or OS error (a miss)"),
             ("write_errors", "Disk blocks the writer could not commit (lost from the tier)"))


class DiskHealth(TierHealth):
    ready_fields = ("unavailable", "writes_off", "recovered", "moved_aside", "free_bytes", "space_bound_bytes")

    def ready(self, disk: dict) -> str:
        if not disk.get("enabled", True) and not disk.get("unavailable"):
            return "off"
        if disk.get("unavailable"):
            return "unavailable"
        if disk.get("writes_off"):
            return "writes off"         # its directory takes no writes: it serves what it holds
        if disk.get("moved_aside"):
            return "recovered"          # a damaged store was moved aside; a fresh one serves
        return "ok"

    def metrics(self, disk: dict) -> Iterable[MetricRow]:
        for key, help_text in _GAUGES:
            if number(disk.get(key)):
                yield MetricRow(key, help_text, disk[key])
        for key, help_text in _COUNTERS:
            if number(disk.get(key)):
                yield MetricRow(key, help_text, disk[key], counter=True)
        if number(disk.get("moved_aside")):
            yield MetricRow("moved_aside", "Damaged disk stores moved aside and replaced with a fresh one by this "
                            "process (at open or while serving)", disk["moved_aside"], counter=True)
        if disk.get("enabled") is not None and "writes_off" in disk:
            yield MetricRow("writes_off", "1 while the disk tier writes nothing because its directory takes no "
                            "writes (read-only, EIO, gone); it still serves", 1.0 if disk.get("writes_off") else 0.0)
            yield MetricRow("writes_off_drops", "Blocks not written to the disk tier because its writes were off",
                            disk.get("writes_off_drops") or 0, counter=True)
        if disk.get("enabled") is not None:
            yield MetricRow("unavailable", "1 while the configured disk tier has no store (a full filesystem at "
                            "open, or no fresh store could be made)", 1 if disk.get("unavailable") else 0)
        if number(disk.get("space_bound_bytes")):
            yield MetricRow("space_bound_bytes", "The data file's bound set by the filesystem's free space minus "
                            "the reserve (present only while it binds)", disk["space_bound_bytes"])

    def lines(self, disk: dict) -> Iterable[StatusLine]:
        if disk.get("enabled", True) and "compression_ratio" in disk:
            ratio = f"{disk['compression_ratio']:.2f}x" if disk.get("used_bytes") else "n/a (empty)"
            yield line(f"disk: compression ratio {ratio}, pending writes {disk.get('pending_writes', 0)}, "
                       f"corrupt blocks found {disk.get('corrupt', 0)}")
        if disk.get("moved_aside"):
            yield line(Span(f"disk: damaged store moved aside {disk['moved_aside']}x", "warn"),
                       f" (a fresh one serves): {disk.get('recovered')}")
        if disk.get("unavailable"):
            yield line(Span("disk: unavailable", "alert"), f" ({disk['unavailable']}); serving without it")
        space = space_line(disk)
        if space is not None:
            yield space
        if disk.get("writes_off"):
            yield line(Span("disk: writes off", "warn"), f": its directory takes no writes ({disk['writes_off']}); "
                       f"it serves what it holds, {disk.get('writes_off_drops', 0)} blocks not written; back on "
                       "once it can be written")


def space_line(disk: dict) -> StatusLine | None:
    """The disk's capacity, the free space's bound on it and its use, in one line that does not
    contradict itself: "bounded" only when the free space holds the store below its capacity."""
    bound, capacity = disk.get("space_bound_bytes"), disk.get("capacity_bytes")
    if not bound or not capacity:
        return None
    used, free = size(disk.get("used_bytes") or 0), size(disk.get("free_bytes") or 0)
    if bound < capacity:
        return line(Span("disk: bounded by free space", "warn"), ": ", used, " used; the capacity is ",
                    size(capacity), " but ", free, " free holds the store file at ", size(bound))
    return line("disk: ", used, " used of its ", size(capacity), " capacity (", free,
                " free on its filesystem: room for all of it)")
