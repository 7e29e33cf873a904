"""A real ext4 filesystem in a loop-mounted image, made by a test, that can fail under a live
process as a real disk does and come back (issue 41, item 4).

`abort()`: `mount -o remount,abort` -- what ext4 does itself on an I/O error: every write after
it (to files already open too) fails with EROFS, and it stays so. (A plain `remount,ro` is
refused while a process holds a file open for writing: EBUSY, so it cannot fail a live server.)
`recover()`: what an operator does then -- the dead mount detached (`umount -l`: the process's
open files keep the old, aborted filesystem) and the image mounted again at the same path on a
new loop device (the journal replayed): the path now holds the filesystem, writable, as it was
at its last commit; a process must open its files again to write (the ledger and the disk tier
notice the directory changed and do).
Needs root and loop devices: `Ext4Image.make` returns None with the reason otherwise, and the
fixture (tests/conftest.py: `ext4`) skips the test with it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


class Ext4Image:
    def __init__(self, image: Path, mnt: Path) -> None:
        self.image, self.path = image, mnt
        self.devices: list[str] = []

    @classmethod
    def make(cls, where: Path, size: str = "64M") -> "Ext4Image | str":
        """A fresh ext4 image under `where`, mounted at where/mnt; or why it cannot be (a str)."""
        if os.geteuid() != 0:
            return "loop-mounting an ext4 image needs root (CI and our machines run the suite as root)"
        for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        image, mnt = where / "ext4.img", where / "mnt"
        mnt.mkdir()
        r = _run("truncate", "-s", size, str(image))
        if r.returncode == 0:
            r = _run("mkfs.ext4", "-q", "-F", str(image))
        if r.returncode != 0:
            return f"making an ext4 image failed: {r.stderr.strip()}"
        fs = cls(image, mnt)
        why = fs._mount()
        return why if why is not None else fs

    def _mount(self) -> str | None:
        r = _run("losetup", "-f", "--show", str(self.image))     # a new loop device every time
        if r.returncode != 0:
            return f"no loop device (losetup: {r.stderr.strip()})"
        dev = r.stdout.strip()
        r = _run("mount", "-t", "ext4", dev, str(self.path))
        if r.returncode != 0:
            _run("losetup", "-d", dev)
            return f"mounting {dev} failed: {r.stderr.strip()}"
        self.devices.append(dev)
        return None

    def abort(self) -> None:
        r = _run("mount", "-o", "remount,abort", str(self.path))
        assert r.returncode == 0, f"aborting the ext4 at {self.path} failed: {r.stderr}"

    def recover(self) -> None:
        r = _run("umount", "-l", str(self.path))
        assert r.returncode == 0, f"detaching {self.path} failed: {r.stderr}"
        why = self._mount()
        assert why is None, why

    def cleanup(self) -> None:
        _run("umount", "-l", str(self.path))
        for dev in self.devices:
            _run("losetup", "-d", dev)     # detached now, or once the last open file on it closes
