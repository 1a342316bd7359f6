"""Processes on other hosts (``common.remote``): the guard that ties a remote process to its ssh link, the
ssh/pdsh options of the plan, and pdsh's report of a lost host. Real subprocesses; the ssh link is a pipe
here (the rehearsal, ``ops/rehearse.sh``, runs the same guard behind a real sshd)."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import shutil
import signal
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


def _guarded(tmp_path: Path, timeout: float, child: str, setup: str = "pass") -> tuple[subprocess.Popen, Path]:
    """``python -m common.remote`` running a child that runs ``setup``, writes its pid to a file (so the
    test starts only once ``setup`` is in force) and then ``child``."""
    pid_file = tmp_path / "child.pid"
    code = f"import os, signal, time, sys; {setup}; open({str(pid_file)!r}, 'w').write(str(os.getpid())); {child}"
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
    # The child ignores SIGTERM before it reports its pid: closing the link earlier would test nothing.
    (tmp_path / "child.pid").unlink()
    g, pid_file = _guarded(tmp_path, 30, "time.sleep(600)", setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    assert g.stdin is not None
    g.stdin.close()
    assert g.wait(timeout=10) == 128 + 9 and not _alive(int(pid_file.read_text()))


def test_guard_ends_what_its_child_leaves_in_its_process_group(tmp_path: Path) -> None:
    # A DeepSpeed runner killed outright leaves its pdsh, whose ssh sessions keep the remote learner ranks (and
    # their ports) alive: when the child ends however it ends, the rest of its group goes too.
    left = tmp_path / "left.pid"
    spawn = (f"p = __import__('subprocess').Popen([sys.executable, '-c', 'import signal, time; "
             f"signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
             f"open({str(left)!r}, 'w').write(str(p.pid))")
    g, _ = _guarded(tmp_path, 30, "os._exit(3)", setup=spawn)
    assert g.wait(timeout=20) == 3  # the child's code passes through
    assert not _alive(int(left.read_text()))  # the grandchild, deaf to SIGTERM, was killed
    (tmp_path / "child.pid").unlink()
    left.unlink()
    g, _ = _guarded(tmp_path, 30, "time.sleep(600)", setup=spawn)
    assert g.stdin is not None
    g.stdin.close()  # the link ends: the child stops at once, its grandchild ignores the SIGTERM
    assert g.wait(timeout=20) == 128 + 15 and not _alive(int(left.read_text()))


PROBE = ("import json, os, signal, sys, tempfile, time; d = tempfile.gettempdir(); open(os.path.join(d, 'sock'), 'w');"
         "open(sys.argv[1] + '.part', 'w').write(json.dumps({'tmp': d, 'inductor': os.environ.get("
         "'TORCHINDUCTOR_CACHE_DIR'), 'pid': os.getpid(), "
         "'usr1_ignored': signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN})); "
         "os.rename(sys.argv[1] + '.part', sys.argv[1]); ")


def _private_tmp_guard(tmp_path: Path, child: str, *flags: str, stdin: int | None = subprocess.PIPE,
                       setup: str = "") -> tuple[subprocess.Popen, dict, Path]:
    """The guard with ``--private-tmp`` on a host whose temporary directory is ``tmp_path/host``; its child
    runs ``setup``, (leaving a file in its temporary directory, as SGLang does) reports what it was given,
    then runs ``child``."""
    host_tmp, report = tmp_path / "host", tmp_path / "report.json"
    host_tmp.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(host_tmp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    g = subprocess.Popen([sys.executable, "-m", "common.remote", *flags, "--private-tmp", "vapo-engine-0-", "--",
                          sys.executable, "-c", setup + PROBE + child, str(report)], cwd=ROOT, stdin=stdin, env=env)
    wait_for(lambda: report.exists(), 20, "the guarded child to report")
    return g, json.loads(report.read_text()), host_tmp


def test_guard_gives_its_process_a_private_tmp_and_removes_it_however_it_stops(tmp_path: Path) -> None:
    """SGLang leaves its ipc socket files in TMPDIR: an engine on another host gets a directory of its own
    in that host's temporary directory, gone once the engine has stopped (link closed, or exited itself)."""
    g, seen, host_tmp = _private_tmp_guard(tmp_path / "a", "time.sleep(600)", "--timeout", "30")
    tmp = Path(seen["tmp"])
    assert tmp.parent == host_tmp and tmp.name.startswith("vapo-engine-0-") and (tmp / "sock").exists()
    # Torch's compile cache stays where the host's TMPDIR puts it (a private one would be cold every start).
    assert seen["inductor"] == str(host_tmp / f"torchinductor_{getpass.getuser()}")
    assert g.stdin is not None
    g.stdin.close()
    assert g.wait(timeout=10) == 128 + 15 and not _alive(seen["pid"])
    assert list(host_tmp.iterdir()) == []
    g, seen, host_tmp = _private_tmp_guard(tmp_path / "b", "sys.exit(3)", "--timeout", "30")
    assert g.wait(timeout=10) == 3 and list(host_tmp.iterdir()) == []


def test_guard_without_a_link_ignores_a_closed_stdin_and_stops_when_asked(tmp_path: Path) -> None:
    """srun hands the step the launcher's stdin, which may be /dev/null: with --no-link its end of file is not
    a lost link; Slurm's SIGTERM (the step ending) stops the engine, and its directory goes with it."""
    g, seen, host_tmp = _private_tmp_guard(tmp_path, "time.sleep(600)", "--no-link", stdin=subprocess.DEVNULL)
    t0 = time.time()
    wait_for(lambda: time.time() - t0 > 1.0, 5, "a second past end of stdin")  # the guard would have stopped by now
    assert g.poll() is None and _alive(seen["pid"])
    g.send_signal(15)
    assert g.wait(timeout=10) == 128 + 15 and not _alive(seen["pid"])
    assert list(host_tmp.iterdir()) == []


def test_srun_stop_reaches_the_command_as_sigterm_and_its_tmp_goes(tmp_path: Path) -> None:
    """srun turns a SIGTERM into SIGKILL for its step but passes SIGUSR1 on, to every process of the step: the
    guard's command starts deaf to it (not killed by its default action), the guard stops it with SIGTERM
    (its handler runs, as an SGLang server's or an actor's does), and its directory goes."""
    term = tmp_path / "got-sigterm"
    setup = (f"import signal, sys; signal.signal(signal.SIGTERM, lambda *_: (open({str(term)!r}, 'w').close(), "
             "sys.exit(0))); ")
    g, seen, host_tmp = _private_tmp_guard(tmp_path, "time.sleep(600)", "--no-link", stdin=subprocess.DEVNULL,
                                           setup=setup)
    assert seen["usr1_ignored"]
    for pid in (seen["pid"], g.pid):  # as Slurm signals a step: each of its processes, the command first
        os.kill(pid, remote.SRUN_STOP)
    assert g.wait(timeout=10) == 0 and term.exists() and not _alive(seen["pid"])
    assert list(host_tmp.iterdir()) == []


def test_remote_engines_and_only_they_get_a_private_tmp_over_ssh_and_srun(tmp_path: Path) -> None:
    environ = {"PATH": _bin_with_pdsh(tmp_path)}
    _, plan = _plan(tmp_path, environ, "engine.kind=sglang")
    for p in plan.procs:
        if p.via == "ssh":
            words = shlex.split(p.argv[-1])
            guard = words[words.index("common.remote"):words.index("--")]
            assert ("--private-tmp" in guard) == (p.role == "engine"), (p.name, guard)
            if p.role == "engine":
                assert guard[guard.index("--private-tmp") + 1] == f"vapo-{p.name}-"
    assert sum(p.role == "engine" and p.via == "ssh" for p in plan.procs) == 2
    _, plan = _plan(tmp_path, environ, "engine.kind=sglang", "placement.remote=srun", "placement.learner_gpus=0,2",
                    "placement.engine_gpus=1,4,7")
    engines = [p for p in plan.procs if p.role == "engine" and p.via == "srun"]
    assert len(engines) == 2
    for p in engines:
        i = p.argv.index("common.remote")
        assert p.argv[i + 1:i + 5] == ["--no-link", "--private-tmp", f"vapo-{p.name}-", "--"]
        assert p.argv[i - 2:i] == ["/venv/bin/python", "-m"] and p.argv[i + 6:i + 8] == ["-m", "sglang.launch_server"]
    # Every srun'd process but the learner's step runs under the guard (without a directory of its own), which
    # turns the launcher's SIGUSR1 into a SIGTERM; the learner's ranks are stopped as srun stops them.
    actors = [p for p in plan.procs if p.role == "actor" and p.via == "srun"]
    assert actors and all(p.argv[p.argv.index("common.remote") + 1:][:2] == ["--no-link", "--"] for p in actors)
    assert all(p.stop_signal == remote.SRUN_STOP for p in engines + actors)
    learner = plan.proc("learner")
    assert learner.via == "srun" and "common.remote" not in learner.argv and learner.stop_signal == signal.SIGTERM


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
    environ = {"PATH": _bin_with_pdsh(tmp_path), "VAPO_SSH_ARGS": "-F /tmp/cluster_ssh_config", "PDSH_SSH_ARGS_APPEND": "-q",
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
    assert append[:5] == ["-q", "-p", "2222", "-F", "/tmp/cluster_ssh_config"] and "-tt" in append  # the user's kept
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


# ------------------------------------------------------------------------- through a real sshd (loopback)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """An sshd of our own on 127.0.0.1 (own host and user keys, own config; ~/.ssh untouched) and the ssh
    config file that reaches it, passed as placement.ssh_args=-F FILE like a cluster's."""
    sshd_bin, keygen = shutil.which("sshd") or "/usr/sbin/sshd", shutil.which("ssh-keygen")
    if not (Path(sshd_bin).exists() and keygen and shutil.which("ssh")):
        pytest.skip("openssh-server/client not installed")
    from tests.ports import free_port

    d = tmp_path_factory.mktemp("sshd")
    for name in ("hostkey", "userkey"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "userkey.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/hostkey\nPidFile {d}/sshd.pid\n"
        f"AuthorizedKeysFile {d}/authorized_keys\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n")
    (d / "ssh_config").write_text(f"Host h0 h1 h2 h3\n  HostName 127.0.0.1\nHost *\n  Port {port}\n  IdentityFile {d}/userkey\n  StrictHostKeyChecking no\n"
                                  "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    Path("/run/sshd").mkdir(exist_ok=True) if os.geteuid() == 0 else None
    proc = subprocess.Popen([sshd_bin, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    probe = ["ssh", "-F", str(d / "ssh_config"), "-o", "BatchMode=yes", "127.0.0.1", "true"]
    try:
        wait_for(lambda: subprocess.run(probe, capture_output=True, timeout=10).returncode == 0 or proc.poll() is not None,
                 20, "sshd to accept our key")
        if proc.poll() is not None:
            pytest.skip(f"sshd would not start here: {(d / 'sshd.log').read_text()[-500:]}")
        yield {"config": d / "ssh_config", "proc": proc}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _remote_sleeper(sshd, tmp_path: Path, *overrides: str) -> tuple[list[str], Path]:
    """The plan's own ssh command for a process on host 127.0.0.1 that records its pid and sleeps."""
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [f"placement.ssh_args=-F {sshd['config']}", *overrides])
    marker = tmp_path / f"remote-{time.monotonic_ns()}.pid"
    argv = [sys.executable, "-c", f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)"]
    return remote.wrap_remote(cfg, "127.0.0.1", argv, {}, ROOT, sys.executable, {}), marker


def test_over_real_ssh_a_killed_launcher_takes_its_remote_process_along(sshd, tmp_path: Path) -> None:
    cmd, marker = _remote_sleeper(sshd, tmp_path)
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE)  # the launcher's side: it holds the link open
    wait_for(lambda: marker.exists() and marker.read_text(), 30, "the remote process to start")
    pid = int(marker.read_text())
    t0 = time.time()
    client.kill()  # the launcher (and with it its ssh client) dies by SIGKILL
    client.wait()
    wait_for(lambda: not _alive(pid), 10, "the remote process to stop")
    assert time.time() - t0 < 10


def test_over_real_ssh_a_lost_host_ends_ssh_with_255(sshd, tmp_path: Path) -> None:
    """The launcher's reading of a lost host: sshd (the host) gone, the ssh client exits 255, and the remote
    process stops itself (its link closed)."""
    cmd, marker = _remote_sleeper(sshd, tmp_path)
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE)
    wait_for(lambda: marker.exists() and marker.read_text(), 30, "the remote process to start")
    pid = int(marker.read_text())
    # This connection's sshd processes: children of the listening sshd. Killing them is the host going away.
    children = [int(p) for p in Path(f"/proc/{sshd['proc'].pid}/task/{sshd['proc'].pid}/children").read_text().split()]
    for child in children:
        os.kill(child, 9)
    assert client.wait(timeout=30) == remote.SSH_LOST
    wait_for(lambda: not _alive(pid), 30, "the remote process to stop without its link")


def test_over_real_ssh_an_engines_private_tmp_is_made_on_its_host_and_removed_with_it(sshd, tmp_path: Path) -> None:
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [f"placement.ssh_args=-F {sshd['config']}"])
    report = tmp_path / "report.json"
    argv = [sys.executable, "-c", PROBE + "time.sleep(600)", str(report)]
    cmd = remote.wrap_remote(cfg, "127.0.0.1", argv, {}, ROOT, sys.executable, {}, private_tmp="vapo-engine-9-")
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE)
    wait_for(lambda: report.exists(), 30, "the remote process to report")
    tmp = Path(json.loads(report.read_text())["tmp"])
    assert tmp.name.startswith("vapo-engine-9-") and (tmp / "sock").exists()
    assert client.stdin is not None
    client.stdin.close()  # the launcher's stop: end of file down the link
    client.wait(timeout=30)
    wait_for(lambda: not tmp.exists(), 10, "the remote guard to remove the directory")


def test_over_real_ssh_heartbeats_keep_the_process_and_the_launchers_stop_ends_it(sshd, tmp_path: Path) -> None:
    import threading

    from ops import launch as mod
    overrides = ["placement.ssh_alive_interval_s=1", "placement.ssh_alive_count_max=2"]  # guard timeout 2 s
    cmd, marker = _remote_sleeper(sshd, tmp_path, *overrides)
    from common.config import save_config

    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [f"run.root={tmp_path}", "run.name=ssh", *overrides])
    launcher = mod.Launcher(cfg, save_config(cfg).resolve(), False)
    c = mod.Child("actor-1", cmd, tmp_path / "actor-1.log", 0, via="ssh", host="127.0.0.1")
    launcher.children = {"actor-1": c}
    threading.Thread(target=launcher._heartbeat, daemon=True).start()
    c.start()
    wait_for(lambda: marker.exists() and marker.read_text(), 30, "the remote process to start")
    pid = int(marker.read_text())
    t_start = time.time()
    wait_for(lambda: time.time() - t_start > 5 or not _alive(pid), 10, "2.5 guard timeouts to pass")
    assert _alive(pid), c.tail()
    t0 = time.time()
    launcher.stop_all()
    wait_for(lambda: not _alive(pid), mod.STOP_GRACE_S, "the remote process to stop")
    assert not c.alive() and time.time() - t0 < mod.STOP_GRACE_S


def test_over_real_ssh_and_pdsh_learner_ranks_start_on_their_hosts_and_die_with_the_launcher(sshd, tmp_path: Path) -> None:
    """The plan's learner across hosts h0 and h1 (both this machine through the ssh config's HostName):
    DeepSpeed's runner, pdsh, ssh with placement.ssh_args, the env file. Each rank gets its rank and the
    forwarded variables; a launcher killed by SIGKILL takes every rank along (its guard stops pdsh)."""
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed")
    environ = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml",
                      [*MULTI, f"placement.ssh_args=-F {sshd['config']}", "placement.master_addr=127.0.0.1"])
    run = tmp_path / "run"
    run.mkdir()
    plan = build_plan(cfg, run / "config.yaml", sys.executable, ROOT, run, environ=environ)
    out = tmp_path / "out"
    out.mkdir()
    plan.files["deepspeed_env"] += f"PROBE_OUT={out}\n"  # where the stand-in ranks report
    for name, text in plan.files.items():
        (run / name).write_text(text)
    learner = plan.proc("learner")
    argv = [*learner.argv[:-2], "tests.common.rank_probe", str(run / "config.yaml")]
    launcher = ("import time; from ops.launch_child import Child; "
                "c = Child('learner', {argv!r}, __import__('pathlib').Path({log!r}), 0, env={env!r}, via='pdsh'); "
                "c.start(); print('started', flush=True); time.sleep(600)").format(
        argv=argv, log=str(tmp_path / "learner.log"), env=learner.env)
    fake_launcher = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                                     text=True)
    try:
        wait_for(lambda: len(list(out.glob("rank*.json"))) == 3, 90, "3 ranks to report")
    finally:
        records = {int(json.loads(f.read_text())["RANK"]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
        fake_launcher.kill()  # SIGKILL: no orderly stop
        fake_launcher.wait()
    # Rank 0 alone on h0, ranks 1-2 on h1. DeepSpeed numbers local ranks rank % ranks-on-the-host, so on an
    # uneven layout h1's two ranks hold local ranks 1 and 0: each host's local ranks are still 0..n-1.
    assert sorted(records) == [0, 1, 2] and {v["WORLD_SIZE"] for v in records.values()} == {"3"}
    assert records[0]["LOCAL_RANK"] == "0" and {records[1]["LOCAL_RANK"], records[2]["LOCAL_RANK"]} == {"0", "1"}
    for v in records.values():
        assert (v["MASTER_ADDR"], v["DS_ACCELERATOR"], v["GLOO_SOCKET_IFNAME"], v["VAPO_DS_SHM"]) == \
            ("127.0.0.1", "cpu", "lo", "0")
    wait_for(lambda: not any(_alive(v["pid"]) for v in records.values()), 30, "every rank to stop")


def test_remote_processes_get_what_launch_sh_exports() -> None:
    # Without them a remote actor would not be offline (HF) nor share the torch extensions cache.
    env = remote.forwarded_env({"HF_HUB_OFFLINE": "1", "TORCH_EXTENSIONS_DIR": "/c", "OMP_WAIT_POLICY": "PASSIVE",
                                "TOKENIZERS_PARALLELISM": "false", "HOME": "/root", "RANK": "3"})
    assert env == {"HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
                   "TORCH_EXTENSIONS_DIR": "/c"}
