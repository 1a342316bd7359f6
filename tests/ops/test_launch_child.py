"""ops/launch_child.py: a supervised child, with real processes: its log and environment, the orderly stop by
signal or by the end of its ssh link, the heartbeat down that link, and its whole process group stopped."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from ops.launch_child import Child, LaunchError
from tests.polling import wait_for

# Reads its stdin as the remote guard reads the ssh link: one line per heartbeat, then end of file.
LINK_READER = ("import sys\nn = 0\nfor _ in sys.stdin:\n    n += 1\n    print('beat', n, flush=True)\n"
               "print('eof after', n, 'beats', flush=True)\n")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_child_logs_its_command_and_output_with_its_own_environment(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A launcher that ran torch.distributed leaves rendezvous variables behind: the child must not see them.
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("SLURM_PROCID", "3")
    c = Child("buffer", ["sh", "-c", 'echo "port=${MASTER_PORT-unset} procid=${SLURM_PROCID-unset} mine=$MINE"'],
              tmp_path / "logs" / "buffer.log", env={"MINE": "x"})
    c.start()
    wait_for(lambda: c.returncode is not None, 10, "the child to exit")
    assert c.returncode == 0 and not c.alive()
    assert c.tail().splitlines() == ["    port=unset procid=unset mine=x"]
    wait_for(lambda: "port=unset" in (tmp_path / "logs" / "buffer.log").read_text(), 10, "the log to be written")
    log = (tmp_path / "logs" / "buffer.log").read_text().splitlines()
    assert log[1].endswith(" start: sh -c " + c.cmd[2]) and log[1].startswith("=== ")
    c.start()  # a restart appends to the same log
    wait_for(lambda: (tmp_path / "logs" / "buffer.log").read_text().count("port=unset") == 2, 10, "the second run")
    assert (tmp_path / "logs" / "buffer.log").read_text().count(" start: ") == 2


def test_the_orderly_stop_is_the_childs_stop_signal(tmp_path: Path) -> None:
    """An srun'd child is asked to stop with SIGUSR1 (srun passes it on), a local one with SIGTERM."""
    script = 'trap "echo stopped by USR1; exit 7" USR1; trap "echo stopped by TERM; exit 8" TERM; echo up; ' \
             'while :; do sleep 0.05; done'
    for sig, code in ((signal.SIGUSR1, 7), (signal.SIGTERM, 8)):
        c = Child("engine-0", ["sh", "-c", script], tmp_path / "engine-0.log", stop_signal=sig)
        c.start()
        wait_for(lambda c=c: "up" in c.tail(), 10, "the child to set its traps")
        c.ask_to_stop()
        wait_for(lambda c=c: c.returncode is not None, 10, "the child to stop")
        assert c.returncode == code and f"stopped by {sig.name[3:]}" in c.tail()


def test_a_kill_reaches_every_process_of_the_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    c = Child("engine-1", ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], tmp_path / "e.log")
    c.start()
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10, "the grandchild to start")
    c.signal(signal.SIGKILL)
    wait_for(lambda: c.returncode is not None, 10, "the child to die")
    assert c.returncode == -signal.SIGKILL
    wait_for(lambda: _gone(int(pidfile.read_text())), 10, "the grandchild to die")
    c.signal(signal.SIGKILL)  # an exited group: nothing to signal, no error


def test_a_restart_first_ends_what_the_dead_process_left_in_its_group(tmp_path: Path) -> None:
    """The leader dies alone (an SGLang server SIGKILLed during its start): its orphan, still in the group,
    goes when the child is restarted, and the new process is left alone."""
    pidfile = tmp_path / "orphan"
    c = Child("engine-0", ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], tmp_path / "e.log")
    c.start()
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10, "the orphan-to-be to start")
    orphan = int(pidfile.read_text())
    assert c.proc is not None
    os.kill(c.proc.pid, signal.SIGKILL)  # the leader only, not its group
    wait_for(lambda: c.returncode is not None, 10, "the leader to die")
    assert not _gone(orphan)  # what the launcher found before this fix: left running, forgotten at the restart
    pidfile.unlink()
    c.start()
    wait_for(lambda: _gone(orphan), 10, "the orphan to be killed")
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10, "the new process's own child")
    assert c.alive() and not _gone(int(pidfile.read_text()))
    c.signal(signal.SIGKILL)


def test_a_child_behind_ssh_gets_heartbeats_and_stops_at_the_end_of_its_link(tmp_path: Path) -> None:
    c = Child("actor-1", [sys.executable, "-c", LINK_READER], tmp_path / "actor-1.log", via="ssh", host="h1")
    c.start()
    c.beat()
    c.beat()
    wait_for(lambda: "beat 2" in c.tail(), 10, "two heartbeats to arrive")
    c.ask_to_stop()  # via ssh: the link closes, no signal
    wait_for(lambda: c.returncode is not None, 10, "the child to see the end of its link")
    assert c.returncode == 0 and c.tail().splitlines()[-1].strip() == "eof after 2 beats"
    c.beat()  # a closed link: nothing to write, no error
    c.hang_up()


def test_an_unstarted_child_is_not_alive_and_its_tail_comes_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    c = Child("learner", ["true"], log)
    assert not c.alive() and c.returncode is None and c.tail() == ""  # no log yet
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    assert c.tail(2) == "    line 18\n    line 19"
    c.signal(signal.SIGTERM)  # never started: nothing to signal
    assert os.path.exists(log)


def test_a_launch_error_names_its_component() -> None:
    e = LaunchError("engine-2", "exited with code 1")
    assert str(e) == "engine-2: exited with code 1" and e.component == "engine-2"
