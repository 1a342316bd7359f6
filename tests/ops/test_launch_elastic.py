"""The launcher's elastic-engine decisions (``ops/launch_elastic.py``): pure functions and bookkeeping, no
processes except one probe of a command that fails and one that answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops import launch_elastic as el
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("role", "rc", "via", "restarts", "want"), [
    ("actor", None, "ssh", 0, el.CONTINUE),
    ("actor", 1, "", 0, el.RESTART),
    ("actor", 1, "", 2, el.GIVE_UP),  # past engine.max_restarts: given up, not the run
    ("engine", -9, "ssh", 2, el.GIVE_UP),
    ("actor", 255, "ssh", 0, el.HOST_LOST),  # ssh lost its engine host
    ("engine", 255, "ssh", 2, el.HOST_LOST),  # a lost host is not the process's fault: no restart counted
    ("actor", 255, "", 0, el.RESTART),  # a local process's own 255 is an ordinary exit
    ("buffer", 1, "", 0, el.RESTART),
    ("buffer", 1, "", 2, el.STOP),  # the buffer past its restarts stops the run, as before
    ("buffer", 255, "ssh", 0, el.STOP),  # a lost buffer (or any non-engine) host stops the run
])
def test_decide(role: str, rc: int | None, via: str, restarts: int, want: str) -> None:
    assert el.decide(role, rc, via, restarts, max_restarts=2) == want


def test_minimum_holds_waits_for_a_returning_host_then_stops() -> None:
    # Enough engines: nothing to wait for.
    assert el.minimum(1, 1, 1, None, 100.0, 60.0) == (el.CONTINUE, None)
    # Below the minimum with a host that may come back: wait out the grace, from when it began.
    assert el.minimum(0, 1, 1, None, 100.0, 60.0) == (el.CONTINUE, 100.0)
    assert el.minimum(0, 1, 1, 100.0, 160.0, 60.0) == (el.CONTINUE, 100.0)
    assert el.minimum(0, 1, 1, 100.0, 160.5, 60.0) == (el.STOP, 100.0)
    # Back above it: the clock resets.
    assert el.minimum(1, 0, 1, 100.0, 170.0, 60.0) == (el.CONTINUE, None)
    # Nothing can come back (every missing engine given up): stop at once.
    assert el.minimum(1, 0, 2, None, 100.0, 60.0) == (el.STOP, 100.0)


def test_units_count_given_up_and_lost_hosts() -> None:
    from common.placement import Proc

    procs = [Proc("buffer", "buffer", "h0", [], {}), Proc("learner", "learner", "h0", [], {}),
             Proc("engine-0", "engine", "h2", [], {}), Proc("actor-0", "actor", "h2", [], {}),
             Proc("engine-1", "engine", "h3", [], {}), Proc("actor-1", "actor", "h3", [], {}),
             Proc("actor-2", "actor", "h3", [], {})]
    u = el.Units.of(procs)
    assert u.members == {0: ["engine-0", "actor-0"], 1: ["engine-1", "actor-1"], 2: ["actor-2"]}
    assert u.counts(set()) == (3, 0)
    assert u.counts({"h3"}) == (1, 2)
    u.given_up.add("engine-1")  # given up: neither alive nor returning
    assert u.counts({"h3"}) == (1, 1)
    assert u.counts(set()) == (2, 0)


def test_released_credit_counts_releases_around_a_loss_only() -> None:
    r = el.ReleasedCredit(window_s=20.0)
    assert r.sample(0.0, 5.0, losing=False) == 0  # baseline
    assert r.sample(2.0, 7.0, losing=False) == 0  # released before anyone knew: kept for the window
    assert r.host_lost(10.0) == 2  # the loss seen 8 s later: those were its actors'
    assert r.sample(12.0, 10.0, losing=True) == 3  # while the host is lost
    r.host_back(50.0)
    assert r.sample(60.0, 11.0, losing=False) == 1  # within SETTLE_S of its return (a vanished host's reconnect)
    assert r.sample(50.0 + el.SETTLE_S + 1, 14.0, losing=False) == 0  # an ordinary crash later, kept aside
    assert r.host_lost(50.0 + el.SETTLE_S + 100) == 0  # ... and forgotten past the window
    assert r.sample(200.0, 3.0, losing=True) == 0  # a restarted buffer's counter: a new baseline


def test_host_watch_backs_off_until_the_host_answers(tmp_path: Path) -> None:
    flag = tmp_path / "up"
    probe = ["sh", "-c", f"test -e '{flag}' || exit 255"]
    w = el.HostWatch("h3", lost_at=0.0, argv=probe)
    assert not w.answered(1.0) and w.probe is None  # the first probe is due after PROBE_FIRST_S
    t = el.PROBE_FIRST_S
    delays = []
    for _ in range(6):
        assert not w.answered(t)  # starts a probe
        wait_for(lambda: w.probe.poll() is not None, 30, "the probe to exit")
        assert not w.answered(t)  # unanswered: the next one is scheduled later each time
        delays.append(w.next_probe_at - t)
        t = w.next_probe_at
    assert delays == [min(el.PROBE_FIRST_S * 2 ** i, el.PROBE_MAX_S) for i in range(6)]
    assert w.probes == 6
    flag.touch()
    assert not w.answered(t)
    wait_for(lambda: w.probe.poll() is not None, 30, "the probe to exit")
    assert w.answered(t)


def test_probe_is_ssh_with_the_runs_options() -> None:
    from common.config import load_config

    cfg = load_config(ROOT / "ops/configs/rehearsal.yaml", ["placement.ssh_connect_timeout_s=7"])
    argv = el.probe_argv(cfg, "h3")
    assert argv[0] == "ssh" and argv[-2:] == ["h3", "true"] and "ConnectTimeout=7" in argv


def test_resume_hint_names_the_checkpoint_and_the_steps_to_redo(tmp_path: Path) -> None:
    for v in (2, 4):
        (tmp_path / "checkpoints" / f"v{v}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"v{v}" / "COMPLETE").write_text("{}")
    (tmp_path / "checkpoints" / "v6").mkdir()  # cut short: no COMPLETE, never resumed
    (tmp_path / "checkpoints" / "v5.damaged").mkdir()
    steps = [{"kind": "learner_step", "weight_version": v, "time": 100.0 + 10 * v} for v in range(1, 7)]
    hint = el.resume_hint(tmp_path, [{"kind": "header"}, *steps])
    assert hint == "--resume continues it from its checkpoint v4: 2 step(s) to redo, ~20 s at this run's 10.0 s/step, plus the start"
    assert "from the start (no checkpoint yet): 0 step(s)" in el.resume_hint(tmp_path / "none", [])
