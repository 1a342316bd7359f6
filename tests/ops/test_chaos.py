"""Chaos: SIGKILL every component of a smoke run in turn; nothing is orphaned, nothing acked is lost.

One run on ops/configs/smoke.yaml (real launcher, buffer, learner, actor and engine processes) is hit, in
turn, with SIGKILL of the buffer, the engine, the actor (whose engine must die with it), the learner (the
launcher fails and stops the rest), then resumed, and its launcher is SIGKILLed: every process of the run
must be gone within a bounded wait and every port free. A second ``--resume`` must finish the run. At the
end the buffer's LMDB is audited group by group: every group it acknowledged is still stored or was
served (or dropped as stale, counted), and its durable counters agree with the data.

Minutes on two shared cores, so ``slow``; the figures go to stdout (``-s``). The launcher's SIGKILL alone
(no orphans, free ports) is also a default test of a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from common import lifeline
from ops.chaos.procs import alive, components, mentioning, port_free
from ops.report import load_records  # metrics.jsonl, a line being written skipped
from tests.polling import wait_for
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]

LAUNCH = ROOT / "ops" / "launch.sh"
STEP_WAIT_S = 600.0  # one learner step, or a component's restart, on two cores shared with other work
GONE_WAIT_S = 15.0  # the bound for every process of a run to be gone after its launcher was SIGKILLed
TOTAL_STEPS = 30  # run 1 must outlast three kills and their recoveries (steps queue up behind a stall)


def ports_of(overrides: list[str]) -> list[int]:
    out = []
    for o in overrides:
        value = o.split("=", 1)[1]
        out.append(int(value.rsplit(":", 1)[1]) if value.startswith("tcp://") else int(value))
    return out


# ------------------------------------------------------------------------------------------- launches


class Launch:
    """One ``ops/launch.sh`` process; its output is collected by a thread so that waits can read it."""

    def __init__(self, *args: str) -> None:
        # With a lifeline, so that an interrupted test run does not leave a launcher behind either.
        self.proc = subprocess.Popen([str(LAUNCH), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, **lifeline.popen_kwargs())
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def out(self, tail: int = 4000) -> str:
        return "".join(self.lines)[-tail:]

    def one(self, what: str) -> int:
        pids = wait_for(lambda: components(self.proc.pid).get(what), STEP_WAIT_S, f"the {what} process")
        assert len(pids) == 1, (what, pids)
        return pids[0]

    def finish(self, timeout_s: float = 900.0) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(10)
        return rc

    def kill_now(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def learner_steps(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in load_records(run_dir) if r.get("kind") == "learner_step"]


def wait_new_step(run_dir: Path, after: int, what: str, launch: Launch) -> int:
    """Wait until metrics.jsonl holds more than ``after`` learner steps: the pipeline works again."""
    def more() -> int:
        assert launch.proc.poll() is None, f"launcher exited with {launch.proc.returncode}\n{launch.out()}"
        return len(learner_steps(run_dir)) > after and len(learner_steps(run_dir))
    return wait_for(more, STEP_WAIT_S, f"a learner step after {what}", interval_s=0.2)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ the audit


def audit_buffer(path: Path) -> dict[str, int]:
    """Every group the buffer acknowledged, from its own LMDB: still stored, served, or dropped as stale.

    The buffer acknowledges a group only after the transaction that recorded it in ``gindex`` committed,
    so ``gindex`` is the set of acked groups; this counts their fates from the data itself and checks the
    durable counters against it.
    """
    import lmdb

    from buffer.directory import inspect
    from buffer.layout import FILTERED, STALE, STORED

    info = inspect(path)
    c = info["counters"]
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8, subdir=True)
    try:
        with env.begin() as txn:
            gindex, groups = env.open_db(b"gindex", txn=txn, create=False), env.open_db(b"groups", txn=txn, create=False)
            stored = in_buffer = stale = filtered = 0
            for _gid, v in txn.cursor(db=gindex):
                fate = v[:1]
                if fate == STORED:
                    stored += 1
                    in_buffer += txn.get(v[1:], db=groups) is not None
                elif fate == STALE:
                    stale += 1
                elif fate == FILTERED:
                    filtered += 1
    finally:
        env.close()
    gone = stored - in_buffer
    dropped_from_buffer = c["stale_dropped"] - stale
    assert stored == c["accepted_groups"], (stored, c)
    assert in_buffer == c["depth_groups"] == info["groups"], (in_buffer, c)
    assert filtered == c["filtered"], (filtered, c)
    # A stored group that left the buffer was served to the learner or dropped as too stale: no third way.
    assert gone == c["served_groups"] + dropped_from_buffer, (gone, c)
    return {"acked": stored + stale + filtered, "stored": stored, "served": c["served_groups"],
            "in_buffer": in_buffer, "dropped_stale_from_buffer": dropped_from_buffer,
            "refused_stale_on_arrival": stale, "filtered": filtered, "duplicate_acks": c["duplicates"]}


# ------------------------------------------------------------------------------------------------ test


def test_sigkilled_launcher_leaves_no_process_and_no_port_behind(tmp_path: Path) -> None:
    """The launcher's children, and the actor's engine below them, die with it; every port is free at once,
    so a relaunch on the same ports starts every component."""
    ports = port_overrides()
    args = ["ops/configs/smoke.yaml", f"run.root={tmp_path}", "run.name=kill-launcher", *ports, "learner.total_steps=1000"]
    launch = Launch(*args)
    relaunch: Launch | None = None
    tree: dict[str, list[int]] = {}
    try:
        wait_for(lambda: {"buffer", "learner", "actor", "engine"} <= set(components(launch.proc.pid)),
                 STEP_WAIT_S, "buffer, learner, actor and its engine")
        tree = components(launch.proc.pid)
        pids = [p for ps in tree.values() for p in ps]
        t0 = time.time()
        launch.kill_now()
        wait_for(lambda: not any(alive(p) for p in pids), GONE_WAIT_S, f"every process below the launcher to die: {tree}")
        wait_for(lambda: all(port_free(p) for p in ports_of(ports)), GONE_WAIT_S, "every port of the run to be free")
        assert time.time() - t0 < GONE_WAIT_S
        assert mentioning(str(tmp_path / "kill-launcher")) == []
        relaunch = Launch("--resume", *args)
        wait_for(lambda: {"buffer", "learner", "actor", "engine"} <= set(components(relaunch.proc.pid)),
                 STEP_WAIT_S, f"every component of the relaunch\n{relaunch.out()}")
        relaunch.proc.send_signal(signal.SIGINT)
        assert relaunch.finish(60) == 130, relaunch.out()
        assert not relaunch.saw("FAILED"), relaunch.out()
    finally:
        launch.kill_now()
        if relaunch is not None:
            relaunch.kill_now()
        for p in [p for ps in tree.values() for p in ps]:
            if alive(p):  # before the fix: orphans; do not leave them to the next test
                os.kill(p, signal.SIGKILL)


def resume_point(run_dir: Path) -> dict[str, int]:
    """What a resumed learner must do, from the run directory of a killed one."""
    from learner.checkpoint import complete_checkpoints
    from learner.weights import complete_versions

    published = max(complete_versions(run_dir / "weights"), default=-1)
    checkpoint = max((v for v, _ in complete_checkpoints(run_dir / "checkpoints")), default=0)
    # Weights published past the checkpoint came from lost updates: the checkpoint's weights are
    # republished under the next free number and the first update after that gets the one after it.
    first = published + 2 if published > checkpoint else checkpoint + 1
    return {"published": published, "checkpoint": checkpoint, "first_new_version": first}


class Chaos:
    """One chaos run: its directory and launch arguments, every launch (all killed at the end) and the figures."""

    def __init__(self, tmp_path: Path) -> None:
        name = "chaos"
        self.ports = port_overrides()
        self.base = ["ops/configs/smoke.yaml", f"run.root={tmp_path}", f"run.name={name}", *self.ports,
                     f"learner.total_steps={TOTAL_STEPS}", "learner.checkpoint_every=3"]
        self.run_dir = tmp_path / name
        self.figures: dict[str, Any] = {"kills": []}
        self.launches: list[Launch] = []

    def launch(self, *extra: str) -> Launch:
        launch = Launch(*extra, *self.base)
        self.launches.append(launch)
        return launch

    def survived(self, what: str, t0: float, **extra: Any) -> None:
        self.figures["kills"].append({"killed": what, "back_s": round(time.time() - t0, 1), **extra})
        print(f"CHAOS survived {self.figures['kills'][-1]}", flush=True)

    def recovered(self, launch: Launch, what: str) -> None:
        # Two more steps from now (the restart was seen): the first may have fetched its data before the
        # kill, the second fetched after the restart.
        now = len(learner_steps(self.run_dir))
        wait_new_step(self.run_dir, wait_new_step(self.run_dir, now, what, launch), what, launch)

    def stop_all(self) -> None:
        for launch in self.launches:
            launch.kill_now()


def _sigkill_buffer(chaos: Chaos, first: Launch) -> None:
    t0 = time.time()
    old = first.one("buffer")
    kill(old)
    wait_for(lambda: first.saw("buffer exited with code -9"), STEP_WAIT_S, "the launcher to see the buffer die")
    chaos.recovered(first, "the buffer's SIGKILL")
    assert first.one("buffer") != old
    chaos.survived("buffer", t0)


def _sigkill_engine(chaos: Chaos, first: Launch) -> None:
    t0 = time.time()
    old_engine = first.one("engine")
    kill(old_engine)
    wait_for(lambda: [p for p in components(first.proc.pid).get("engine", []) if p != old_engine],
             STEP_WAIT_S, "the actor to restart its engine")
    chaos.recovered(first, "the engine's SIGKILL")
    chaos.survived("engine", t0)


def _sigkill_actor(chaos: Chaos, first: Launch) -> None:
    t0 = time.time()
    actor, engine = first.one("actor"), first.one("engine")
    kill(actor)
    # Nothing else tells the engine that its actor died: only its lifeline stops it.
    wait_for(lambda: not alive(engine), GONE_WAIT_S, "the killed actor's engine to die with it")
    engine_gone_s = time.time() - t0
    wait_for(lambda: first.saw("actor-0 exited with code -9"), STEP_WAIT_S, "the launcher to restart the actor")
    chaos.recovered(first, "the actor's SIGKILL")
    chaos.survived("actor", t0, its_engine_gone_s=round(engine_gone_s, 2))


def _sigkill_learner_then_resume(chaos: Chaos, first: Launch) -> Launch:
    """The learner's SIGKILL fails run 1 and stops all of it; run 2 (--resume) continues where it must."""
    t0 = time.time()
    run1 = [p for ps in components(first.proc.pid).values() for p in ps]
    kill(first.one("learner"))
    assert first.finish(120) == 1, first.out()
    assert first.saw("FAILED — learner"), first.out()
    wait_for(lambda: not any(alive(p) for p in run1), GONE_WAIT_S, "run 1's processes to stop")
    resume1 = resume_point(chaos.run_dir)
    second = chaos.launch("--resume")
    before = len(learner_steps(chaos.run_dir))
    wait_new_step(chaos.run_dir, before, "the resume", second)
    first_resumed = learner_steps(chaos.run_dir)[before]["weight_version"]
    assert first_resumed == resume1["first_new_version"], (resume1, first_resumed)
    chaos.survived("learner", t0, **resume1)
    return second


def _sigkill_launcher(chaos: Chaos, second: Launch) -> dict[str, Any]:
    """Every process of the SIGKILLed launcher dies and every port is freed: the figures of that, and the
    resume point it left."""
    wait_for(lambda: {"buffer", "learner", "actor", "engine"} <= set(components(second.proc.pid)),
             STEP_WAIT_S, "every component of run 2")
    tree = components(second.proc.pid)
    pids = [p for ps in tree.values() for p in ps]
    t0 = time.time()
    second.kill_now()
    wait_for(lambda: not any(alive(p) for p in pids), GONE_WAIT_S,
             f"every process of the SIGKILLed launcher to die: {tree}")
    gone_s = time.time() - t0
    assert mentioning(str(chaos.run_dir)) == []
    wait_for(lambda: all(port_free(p) for p in ports_of(chaos.ports)), GONE_WAIT_S, "every port of the run to be free")
    ports_s = time.time() - t0
    return {"t0": t0, "processes": {k: len(v) for k, v in tree.items()}, "all_gone_s": round(gone_s, 2),
            "ports_free_s": round(ports_s, 2), "resume": resume_point(chaos.run_dir)}


def _resume_to_the_end(chaos: Chaos, launcher_kill: dict[str, Any]) -> None:
    """Run 3 (--resume on the same ports) finishes the run; versions only went up; nothing acked was lost."""
    third = chaos.launch("--resume")
    rc = third.finish()
    assert rc == 0, third.out()
    resume2 = launcher_kill["resume"]
    chaos.survived("launcher", launcher_kill["t0"], processes=launcher_kill["processes"],
                   all_gone_s=launcher_kill["all_gone_s"], ports_free_s=launcher_kill["ports_free_s"], **resume2)
    run_dir, figures = chaos.run_dir, chaos.figures
    assert mentioning(str(run_dir)) == []
    steps = learner_steps(run_dir)
    versions = [r["weight_version"] for r in steps]
    assert resume2["first_new_version"] in versions, (resume2, versions)
    assert versions[-1] == TOTAL_STEPS
    # Versions only go up, across both resumes: one published past a checkpoint is never reused.
    assert all(b > a for a, b in zip(versions, versions[1:], strict=False)), versions
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1
    figures["learner_versions"] = versions
    figures["buffer"] = audit_buffer(run_dir / "buffer")
    figures["groups_in_learner_steps"] = sum(r.get("samples", 0) for r in steps) // 4  # smoke group_size 4
    print("CHAOS " + json.dumps(figures), flush=True)
    assert figures["buffer"]["served"] >= figures["groups_in_learner_steps"]


@pytest.mark.slow
def test_sigkill_each_component_in_turn(tmp_path: Path) -> None:
    chaos = Chaos(tmp_path)
    try:
        first = chaos.launch()  # run 1: the buffer, the engine, the actor, then the learner
        wait_for(lambda: first.saw("actor(s) started"), STEP_WAIT_S, "the actors to start")
        wait_new_step(chaos.run_dir, 0, "start", first)
        _sigkill_buffer(chaos, first)
        _sigkill_engine(chaos, first)
        _sigkill_actor(chaos, first)
        second = _sigkill_learner_then_resume(chaos, first)  # run 2: --resume, then the launcher itself
        launcher_kill = _sigkill_launcher(chaos, second)
        _resume_to_the_end(chaos, launcher_kill)  # run 3: --resume on the same ports
    finally:
        chaos.stop_all()
