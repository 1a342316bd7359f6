"""The launcher's supervision (``ops/launch_supervise.py``) on stand-in children: a lost engine host is
waited for and its actor restarted when a probe answers, an actor past its restarts is given up, and the run
stops only below ``placement.min_engines``; which stops are marked lost (resumable). Real processes (``sh``), no run: ~2 s of calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops import launch_supervise
from ops.launch_progress import Progress
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _launcher(tmp_path: Path, *overrides: str):

    from common.config import load_config, save_config
    from ops import launch as mod
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml",
                      [f"run.root={tmp_path}", "run.name=elastic", "actors.num_actors=2", *overrides])
    return mod, mod.Launcher(cfg, save_config(cfg).resolve(), False)


def _value(launcher, name: str, **labels: str) -> float:
    return launcher.metrics.registry.get_sample_value(f"vapo_launcher_{name}", labels) or 0.0


def test_a_lost_engine_host_is_waited_for_and_its_actor_restarted_on_return(tmp_path: Path, monkeypatch) -> None:
    up = tmp_path / "h3-up"
    monkeypatch.setattr(launch_supervise, "probe_argv", lambda cfg, host: ["sh", "-c", f"test -e '{up}' || exit 255"])
    mod, launcher = _launcher(tmp_path, "placement.min_engines=1")
    launcher.units.host[1] = "h3"  # actor-1 as if placed on engine host h3, behind ssh
    a0 = mod.Child("actor-0", ["sleep", "600"], tmp_path / "a0.log", 2)
    a1 = mod.Child("actor-1", ["sh", "-c", "exit 255"], tmp_path / "a1.log", 2, via="ssh", host="h3")
    launcher.children = {"actor-0": a0, "actor-1": a1}
    try:
        a0.start()
        a1.start()
        wait_for(lambda: not a1.alive(), 10, "the ssh stand-in to exit 255")
        launcher.check_links()  # an engine host's loss is no longer a reason to stop the run
        launcher.tend_children(now=100.0)
        assert set(launcher.lost) == {"h3"} and not a1.alive()
        assert _value(launcher, "hosts_lost_total", host="h3") == 1 and _value(launcher, "engines_alive") == 1
        launcher.tend_children(now=101.0)  # lost: not restarted (nor counted as a restart)
        assert not a1.alive() and a1.restarts == 0
        # The host comes back; what ssh starts there now runs (until its link closes, as a guarded process).
        a1.cmd = ["sh", "-c", "cat >/dev/null"]
        up.touch()
        t = [110.0]

        def rejoined() -> bool:
            t[0] += 1
            launcher.tend_children(now=t[0])
            return a1.alive()

        wait_for(rejoined, 30, "the probe to answer and actor-1 to be restarted")
        assert launcher.lost == {} and a1.restarts == 0 and a0.alive()
        assert _value(launcher, "hosts_rejoined_total", host="h3") == 1 and _value(launcher, "engines_alive") == 2
    finally:
        launcher.stop_all()


def test_an_actor_past_its_restarts_is_given_up_and_the_run_stops_only_below_the_minimum(tmp_path: Path) -> None:
    mod, launcher = _launcher(tmp_path, "placement.min_engines=1")
    a0 = mod.Child("actor-0", ["sh", "-c", "exit 3"], tmp_path / "a0.log", 1)
    a1 = mod.Child("actor-1", ["sleep", "600"], tmp_path / "a1.log", 1)
    launcher.children = {"actor-0": a0, "actor-1": a1}
    try:
        a0.start()
        a1.start()
        wait_for(lambda: not a0.alive(), 10, "actor-0 to exit")
        launcher.tend_children(now=1.0)  # restart 1/1
        assert a0.restarts == 1
        wait_for(lambda: not a0.alive(), 10, "actor-0 to exit again")
        launcher.tend_children(now=2.0)  # past its restarts: given up, the run goes on on actor-1
        assert launcher.units.given_up == {"actor-0"}
        assert _value(launcher, "components_given_up_total", component="actor-0") == 1
        assert _value(launcher, "engines_alive") == 1
        launcher.tend_children(now=3.0)
        assert not a0.alive() and a0.restarts == 1  # left down
        # The last engine goes too: below placement.min_engines with nothing to come back: the run stops.
        a1.max_restarts = 0
        a1.signal(9)
        wait_for(lambda: not a1.alive(), 10, "actor-1 to die")
        with pytest.raises(mod.LaunchError, match=r"0 of 2 engine\(s\) alive, below placement.min_engines=1.*"
                           r"--resume continues it from the start"):
            launcher.tend_children(now=4.0)
    finally:
        launcher.stop_all()


def test_a_lost_buffer_host_still_stops_the_run(tmp_path: Path) -> None:
    mod, launcher = _launcher(tmp_path)
    lost = mod.Child("buffer", ["sh", "-c", "exit 255"], tmp_path / "buffer.log", 3, via="ssh", host="h9")
    launcher.children = {"buffer": lost}
    lost.start()
    wait_for(lambda: not lost.alive(), 10, "the ssh stand-in to exit")
    with pytest.raises(mod.LaunchError, match="lost host h9: ssh exited with code 255.*--resume continues it"):
        launcher.check_links()


def test_which_stops_are_marked_lost_for_a_resume(tmp_path: Path) -> None:
    """A lost host or a learner killed by a signal is marked ``lost`` (resumable), naming the host to wait
    for; a learner's own error is not; a pdsh runner that exits 1 (rank 0's collective failing) after
    pdsh reported the lost host is told as that host, even before a supervision tick read the report."""
    mod, launcher = _launcher(tmp_path)
    launcher.progress = Progress(tmp_path / "metrics.jsonl", 3)
    buffer = mod.Child("buffer", ["sh", "-c", "exit 255"], tmp_path / "buffer.log", 3, via="ssh", host="h9")
    launcher.children = {"buffer": buffer}
    buffer.start()
    wait_for(lambda: not buffer.alive(), 10, "the ssh stand-in to exit")
    with pytest.raises(mod.LaunchError) as lost_host:
        launcher.check_links()
    assert lost_host.value.lost and lost_host.value.hosts == ("h9",)

    def learner_exits(cmd: str, via: str = "") -> mod.LaunchError:
        c = mod.Child("learner", ["sh", "-c", cmd], tmp_path / f"learner-{len(cmd)}.log", 0, via=via, host="h0")
        launcher.children = {"learner": c}
        c.start()
        wait_for(lambda: not c.alive(), 10, "the learner stand-in to exit")
        with pytest.raises(mod.LaunchError) as e:
            launcher._learner_done()
        return e.value

    killed = learner_exits("kill -9 $$")
    assert killed.lost and "killed by a signal" in str(killed) and "--resume continues it" in str(killed)
    assert not learner_exits("exit 1").lost  # its own error: a resume would repeat it
    launcher._pdsh_offset = 0
    pdsh = learner_exits("echo 'pdsh@h0: h1: ssh exited with exit code 255'; exit 1", via="pdsh")
    assert pdsh.lost and pdsh.hosts == ("h1",) and "learner ranks on h1 ended: host lost" in str(pdsh)
