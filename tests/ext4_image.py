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
`freeze()` / `thaw()` (issue 44): `fsfreeze -f` -- every write, and every store into a shared map of
a page the freeze wrote back, waits in the kernel until `fsfreeze -u`. A frozen filesystem left
frozen hangs whatever touches it, so freeze() first starts a guard process that thaws it after
`guard_s` whatever becomes of the test's process, and writes `thawed_by_guard` before it does (a
test can tell a thaw it did not make); thaw() and cleanup() thaw and stop the guard.
Needs root and loop devices: `Ext4Image.make` returns None with the reason otherwise, and the
fixture (tests/conftest.py: `ext4`) skips the test with it (and fsfreeze where it freezes).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True)


class Ext4Image:
    def __init__(self, image: Path, mnt: Path) -> None:
        self.image, self.path = image, mnt
        self.devices: list[str] = []
        self.thawed_by_guard = image.parent / "thawed-by-guard"
        self._guard: subprocess.Popen | None = None

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

    def freeze(self, guard_s: float = 120.0) -> None:
        assert self._guard is None, "frozen already"
        self._guard = subprocess.Popen(["sh", "-c", f'sleep {guard_s}; touch "{self.thawed_by_guard}"; '
                                        f'fsfreeze -u "{self.path}"'], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        r = _run("fsfreeze", "-f", str(self.path))
        if r.returncode != 0:
            self.thaw()
            raise AssertionError(f"fsfreeze -f {self.path} failed: {r.stderr}")

    def thaw(self) -> None:
        """Thaw (idempotent: a filesystem not frozen is left as it is) and stop the guard."""
        _run("fsfreeze", "-u", str(self.path))
        if self._guard is not None:
            try:
                os.killpg(self._guard.pid, signal.SIGKILL)     # the shell and its sleep
            except ProcessLookupError:
                pass
            self._guard.wait()
            self._guard = None

    def cleanup(self) -> None:
        self.thaw()
        _run("umount", "-l", str(self.path))
        for dev in self.devices:
            _run("losetup", "-d", dev)     # detached now, or once the last open file on it closes
