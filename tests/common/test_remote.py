"""Processes on other hosts (``common.remote``): the guard that ties a remote process to its ssh link, the
ssh/pdsh options of the plan, and pdsh's report of a lost host. Real subprocesses; the ssh link is a pipe
here (the rehearsal, ``ops/rehearse.sh``, runs the same guard behind a real sshd)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import remote
from common.config import ConfigError, load_config
from common.placement import build_plan
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
MULTI = ["placement.hosts=[h0,h1,h2,h3]", "placement.gpus_per_host=2", "placement.store_protection=private_network",
         "buffer.ingest_addr=tcp://10.9.0.1:5555", "learner.publish_addr=tcp://10.9.0.1:5557",
         "learner.query_addr=tcp://10.9.0.1:5558", "placement.learner_gpus=0,2-3", "placement.engine_gpus=1,4,7",
         "actors.num_actors=3"]


def _guarded(tmp_path: Path, timeout: float, child: str) -> tuple[subprocess.Popen, Path]:
    """``python -m common.remote`` running a child that writes its pid to a file and then ``child``."""
    pid_file = tmp_path / "child.pid"
    code = f"import os, time, sys; open({str(pid_file)!r}, 'w').write(str(os.getpid())); {child}"
    g = subprocess.Popen([sys.executable, "-m", "common.remote", "--timeout", str(timeout), "--grace", "2", "--",
                          sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE)
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), 20, "the guarded child to start")
    return g, pid_file


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_guard_stops_its_process_when_the_link_closes(tmp_path: Path) -> None:
    g, pid_file = _guarded(tmp_path, 30, "time.sleep(600)")
    pid = int(pid_file.read_text())
    t0 = time.time()
    assert g.stdin is not None
    g.stdin.close()  # what ssh does to the remote side when the launcher (or its ssh client) goes away
    g.wait(timeout=10)
    assert not _alive(pid) and time.time() - t0 < 5
    assert g.returncode == 128 + 15  # SIGTERM was enough


def test_guard_stops_its_process_without_heartbeats_and_keeps_it_with_them(tmp_path: Path) -> None:
    g, pid_file = _guarded(tmp_path, 1.5, "time.sleep(600)")
    pid = int(pid_file.read_text())
    assert g.stdin is not None
    deadline = time.time() + 4  # > 2 timeouts: heartbeats keep it alive
    while time.time() < deadline:
        g.stdin.write(b"\n")
        g.stdin.flush()
        assert g.poll() is None
        time.sleep(0.3)  # the heartbeat period under test, not synchronisation
    t0 = time.time()  # now a silent link (a partition: no end of file, no bytes)
    g.wait(timeout=10)
    assert 1.0 < time.time() - t0 < 5 and not _alive(pid)
    g.stdin.close()


def test_guard_passes_the_exit_code_through_and_kills_a_stubborn_child(tmp_path: Path) -> None:
    g, _ = _guarded(tmp_path, 30, "sys.exit(7)")
    assert g.wait(timeout=10) == 7
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    (tmp_path / "child.pid").unlink()
    g, pid_file = _guarded(tmp_path, 30, stubborn)
    assert g.stdin is not None
    g.stdin.close()
    assert g.wait(timeout=10) == 128 + 9 and not _alive(int(pid_file.read_text()))


def test_pdsh_reports_a_lost_host_in_the_format_the_launcher_reads() -> None:
    assert remote.pdsh_failures("h1: hello\npdsh@h0: h2: ssh exited with exit code 255\n"
                                "pdsh@h0: h3: ssh exited with exit code 1\n") == {"h2": 255, "h3": 1}
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed (the format above is pdsh 2.34's)")
    env = {**os.environ, "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-o ConnectTimeout=2 -o BatchMode=yes"}
    p = subprocess.run(["pdsh", "-S", "-w", "nohost-vapo.invalid", "true"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert remote.pdsh_failures(p.stdout + p.stderr) == {"nohost-vapo": 255}


def _plan(tmp_path: Path, environ: dict[str, str], *overrides: str):
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [*MULTI, *overrides])
    return cfg, build_plan(cfg, tmp_path / "config.yaml", "/venv/bin/python", ROOT, tmp_path, environ=environ)


def _bin_with_pdsh(tmp_path: Path) -> str:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / "pdsh").write_text("#!/bin/sh\nexit 0\n")
    (d / "pdsh").chmod(0o755)
    return str(d)


def test_remote_processes_get_ssh_options_forwarded_variables_and_the_guard(tmp_path: Path) -> None:
    environ = {"PATH": _bin_with_pdsh(tmp_path), "VAPO_SSH_ARGS": "-F /tmp/cluster_ssh_config",
               "GLOO_SOCKET_IFNAME": "veth0", "NCCL_SOCKET_IFNAME": "ib0", "TP_SOCKET_IFNAME": "veth0", "HOME": "/x"}
    cfg, plan = _plan(tmp_path, environ, "placement.ssh_args=-p 2222", "placement.ssh_alive_interval_s=4",
                      "placement.ssh_alive_count_max=2", "placement.master_addr=10.9.0.1")
    actor = plan.proc("actor-1")
    assert actor.via == "ssh" and actor.argv[0] == "ssh"
    # The user's options first (ssh keeps an option's first value), then the keep-alive that bounds detection.
    assert actor.argv[1:5] == ["-p", "2222", "-F", "/tmp/cluster_ssh_config"]
    for opt in ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=4", "ServerAliveCountMax=2"):
        assert opt in actor.argv
    remote_cmd = shlex.split(actor.argv[-1])
    assert remote_cmd[remote_cmd.index("common.remote") + 1:][:2] == ["--timeout", "8"]  # 4 s x 2
    for var in ("GLOO_SOCKET_IFNAME=veth0", "NCCL_SOCKET_IFNAME=ib0", "TP_SOCKET_IFNAME=veth0"):
        assert var in remote_cmd and var in plan.files["deepspeed_env"].splitlines()
    assert "HOME=/x" not in remote_cmd
    learner = plan.proc("learner")
    assert learner.via == "pdsh" and "--no_ssh_check" in learner.argv
    assert learner.argv[learner.argv.index("--master_addr") + 1] == "10.9.0.1"
    append = learner.env["PDSH_SSH_ARGS_APPEND"].split()
    assert append[:4] == ["-p", "2222", "-F", "/tmp/cluster_ssh_config"] and "-tt" in append
    assert "ServerAliveInterval=4" in append


def test_a_learner_across_hosts_over_ssh_needs_pdsh_at_plan_time(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="^placement.remote: .*pdsh is not on PATH"):
        _plan(tmp_path, {"PATH": str(empty)})
    # One learner host needs no pdsh; srun needs none either.
    _plan(tmp_path, {"PATH": str(empty)}, "placement.learner_gpus=0", "placement.engine_gpus=1,4,7")
    _plan(tmp_path, {"PATH": str(empty)}, "placement.remote=srun", "placement.learner_gpus=0,2",
          "placement.engine_gpus=1,4,7")
