"""Why a launched child failed, told even when its log cannot be: the launcher's side of a child's output.

``OutputTail`` reads a child's combined stdout and stderr from a pipe, appends it to the child's log file and
keeps the last lines in memory, so the launcher can print them when the child dies even if the log is on
a full (or gone) filesystem: a log written there ends mid-line, without the "No space left on device"
that killed the child. ``disk_notes`` names each filesystem of the run that is (nearly) full, with its
mount point, so the failure message says which one to clean.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import IO

# Free space under which a filesystem counts as full: what one checkpoint shard or log burst needs.
FULL_BELOW_BYTES = 64 << 20
_READ = 1 << 16


class OutputTail:
    """One child's output pipe: to its log file (best effort) and to the last ``keep`` lines in memory."""

    def __init__(self, pipe: IO[bytes], log_path: Path, keep: int = 40) -> None:
        self.log_path = log_path
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.write_error: OSError | None = None  # the first failed write to the log, if any
        self._partial = b""
        self._lock = threading.Lock()
        self._pipe = pipe
        self._thread = threading.Thread(target=self._run, name=f"tail-{log_path.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fd = self._pipe.fileno()
        log: IO[bytes] | None = None
        try:
            log = open(self.log_path, "ab", buffering=0)  # closed below
        except OSError as e:
            self.write_error = e
        try:
            while chunk := os.read(fd, _READ):
                self._keep(chunk)
                if log is not None:
                    try:
                        log.write(chunk)
                    except OSError as e:  # a full disk: keep reading, the child must not block on its pipe
                        self.write_error = self.write_error or e
        except OSError:
            pass
        finally:
            self._keep(b"", flush=True)
            if log is not None:
                try:
                    log.close()
                except OSError:
                    pass
            self._pipe.close()

    def _keep(self, chunk: bytes, flush: bool = False) -> None:
        with self._lock:
            data = self._partial + chunk
            *complete, self._partial = data.split(b"\n")
            if flush and self._partial:
                complete.append(self._partial)
                self._partial = b""
            for line in complete:
                self.lines.append(line.decode("utf-8", errors="replace").rstrip("\r"))

    def wait(self, timeout_s: float = 5.0) -> None:
        """Let the reader take what the (exited) child left in the pipe."""
        self._thread.join(timeout_s)

    def tail(self, n: int = 15) -> list[str]:
        with self._lock:
            lines = list(self.lines)
            if self._partial:
                lines.append(self._partial.decode("utf-8", errors="replace"))
        out = lines[-n:]
        if self.write_error is not None:
            out.append(f"(its log {self.log_path} is incomplete: {self.write_error.strerror or self.write_error})")
        return out


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, device, type) of the filesystem holding ``path``."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    best = ("/", "?", "?")
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in mounts:
        dev, mnt, fstype = (line.split() + ["?", "?", "?"])[:3]
        mnt = mnt.replace("\\040", " ")
        if (p == Path(mnt) or Path(mnt) in p.parents) and len(mnt) >= len(best[0]):
            best = (mnt, dev, fstype)
    return best


def disk_notes(paths: list[Path], full_below: int = FULL_BELOW_BYTES) -> list[str]:
    """One line per distinct filesystem among ``paths`` with less than ``full_below`` bytes (or no inode)
    free for us, naming its mount point."""
    notes: list[str] = []
    seen: set[int] = set()
    for path in paths:
        p = path
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            st = os.statvfs(p)
            dev = os.stat(p).st_dev
        except OSError:
            continue
        if dev in seen:
            continue
        seen.add(dev)
        free = st.f_bavail * st.f_frsize
        if free >= full_below and (st.f_files == 0 or st.f_favail > 0):
            continue
        mnt, device, fstype = _mount_of(p)
        what = "no inodes left" if st.f_files and st.f_favail == 0 else f"{free / 2**20:.1f} MiB free"
        notes.append(f"No space left on device: the filesystem at {mnt} ({device}, {fstype}, holding {path}) has "
                     f"{what} of {st.f_blocks * st.f_frsize / 2**20:.1f} MiB; free space there, then --resume")
    return notes


def failure_notes(run_dir: Path, buffer_dir: Path) -> list[str]:
    """What the launcher adds to a FAILED line: the run's full filesystems (run dir, buffer, temp dir)."""
    return disk_notes([run_dir, run_dir / "logs", buffer_dir, Path(os.environ.get("TMPDIR", "/tmp"))])
