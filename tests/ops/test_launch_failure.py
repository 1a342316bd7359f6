"""The launcher's failure message when a child dies on a full disk: the child's last output lines from the
launcher's memory (its log there is cut short) and the full filesystem named. A real child process, a real
full filesystem (a 512 KiB tmpfs mounted for the test)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.launch_child import Child
from ops.launch_failure import disk_notes, failure_notes
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]

# A child that logs, then dies writing a checkpoint to the full disk (a traceback on stderr).
CHILD = """
import sys
print("step 7 done", flush=True)
sys.stderr.write("saving checkpoint\\n"); sys.stderr.flush()
with open(sys.argv[1], "wb") as f:
    f.write(b"x" * (4 << 20))
"""


@contextlib.contextmanager
def full_tmpfs(where: Path) -> Iterator[Path]:
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("needs the right to mount a tmpfs (root)")
    try:
        (where / "logs").mkdir()
        with contextlib.suppress(OSError), open(where / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_child_dying_on_a_full_disk_is_explained_from_memory(tmp_path: Path) -> None:
    with full_tmpfs(tmp_path / "full") as mnt:
        log = mnt / "logs" / "learner.log"
        c = Child("learner", [sys.executable, "-c", CHILD, str(mnt / "ckpt.bin")], log)
        c.start()
        wait_for(lambda: c.returncode is not None, 30, "the child to fail")
        tail = c.tail()
        notes = failure_notes(mnt, mnt / "buffer")
        log_text = log.read_text(errors="replace") if log.exists() else ""
    assert c.returncode == 1
    assert "step 7 done" in tail and "saving checkpoint" in tail
    assert "OSError: [Errno 28] No space left on device" in tail  # the log on that disk cannot hold it
    assert "No space left on device" not in log_text
    assert "is incomplete" in tail
    assert len(notes) == 1 and f"the filesystem at {mnt} (tmpfs, tmpfs" in notes[0], notes


def test_no_note_for_filesystems_with_room(tmp_path: Path) -> None:
    assert disk_notes([tmp_path], full_below=1) == []
    assert disk_notes([tmp_path / "not" / "yet"], full_below=1) == []  # a path still to be created: its parent's


def test_a_child_with_room_keeps_its_whole_log(tmp_path: Path) -> None:
    c = Child("actor-0", [sys.executable, "-c", "import sys; [print(i) for i in range(50)]; sys.exit(3)"],
              tmp_path / "logs" / "actor-0.log")
    c.start()
    wait_for(lambda: c.returncode is not None, 30, "the child to exit")
    assert c.tail(3).split() == ["47", "48", "49"]
    wait_for(lambda: "49" in (tmp_path / "logs" / "actor-0.log").read_text(), 10, "the log written")
    assert (tmp_path / "logs" / "actor-0.log").read_text().splitlines()[-50:] == [str(i) for i in range(50)]
