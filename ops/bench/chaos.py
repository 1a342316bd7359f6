"""Chaos run: the default workload under a seeded nemesis of random faults, then invariants on its history.

    .venv/bin/python -m ops.bench.chaos [--minutes 60] [--seed 0] [--short] [--cluster] [--config FILE]
        [--steps N] [--interval-s S] [--faults KIND,...] [--baseline run|alongside|base] [--reference-accuracy A] [--tolerance T]
        [--out FILE] [--keep] [key=value ...]

With ``--cluster`` the run is the default workload on the rehearsal's ssh route, on its four hosts
(``ops.chaos.cluster``: network namespaces, root, the rehearsal's packages; ``--config`` defaults to
ops/configs/rehearsal.yaml, with the default config's learning settings laid over it), and the nemesis adds ``host_down`` and ``partition`` (and leaves out ``slow_metrics``). Otherwise:

Runs ``python -m ops.launch`` (the launcher ``ops/launch.sh`` execs, with its environment, without
``ops/setup.sh``) on ``--config`` under a temporary ``run.root``, with fresh ports, ``buffer.record_served=true``
(the history of every take), ``engine.max_restarts=1000`` (an engine or actor is killed many times) and
``learner.total_steps`` scaled to outlast ``--minutes`` (``--steps``, else minutes × 60 / ``--step-s``).
Meanwhile the nemesis (``ops.chaos.nemesis``; ``--faults`` narrows the kinds: SIGKILL of the buffer, an
actor, an engine, the learner; SIGSTOP/SIGCONT of an engine; slow /metrics clients; the buffer's file size limit as a full disk) picks a
fault every ``--interval-s`` (± half) for ``--minutes`` or until 5 versions (10 with ``--cluster``) before the last (the final
heal: faults in force are undone, so every engine can converge on the final version); weight pushes, checkpoints (every 5 steps) and
evaluations go on. A stopped run (a learner kill) is resumed with ``--resume`` (at most ``--max-resumes``).
Then ``ops.chaos.history`` checks the history: no acknowledged group lost or served twice, every served group
within the staleness bound, published versions strictly increasing, every engine on the final version, the
run at ``learner.total_steps``, held-out accuracy at least the reference minus ``--tolerance``, nothing left
behind (no process naming the run directory, every port free, the temporary root removed).

With ``--config ops/configs/sglang-cpu.yaml`` (or ``engine.kind=sglang``) the engine is a live SGLang server, the
launcher's child: ``kill_engine`` and ``stop_engine`` hit its HTTP server process (its scheduler and detokenizer
die with it), the launcher restarts it and the actor waits for it and re-syncs its weights; ``--steps`` is sized
at 12 s a step; without SGLang in the venv (``ops/setup.sh --sglang``) it prints a ``skipped`` line and exits 3.

The reference accuracy: ``--baseline run`` (the default without ``--short``) runs the same config and seed
without faults first; ``--baseline alongside`` runs it at the same time, sharing the machine (about half the
wall time); ``--baseline base`` (the default with ``--short``) uses the run's own base accuracy
(no collapse: a looser check); ``--reference-accuracy`` gives a known fault-free figure. ``--short`` is the
≤ 5 minute mode of the slow test: 4 minutes of faults every 15 s on 24 steps of the default config.

Prints one JSON line (``kind: chaos``): faults by kind, every invariant's pass/fail, accuracy, the time lost
to faults (learner step gaps beyond the median gap, summed) and the resumes; ``--out`` writes the full
record (every fault with its time, every invariant's counts). Exit 0 when every invariant passes, 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from common import lifeline
from common.config import ConfigError, load_config_args
from common.ports import as_overrides, fresh_ports
from ops.chaos.cluster import CONFIG as CLUSTER_CONFIG
from ops.chaos.cluster import KINDS as CLUSTER_KINDS
from ops.chaos.cluster import OVERRIDES as CLUSTER_OVERRIDES
from ops.chaos.cluster import ClusterView, workload_overrides
from ops.chaos.history import check, read_history
from ops.chaos.nemesis import HOST_FAULTS, KINDS, Nemesis, Target
from ops.chaos.procs import mentioning, port_free
from ops.launch_engines import missing_modules
from ops.rehearsal.cluster import Cluster, missing_prerequisites
from ops.rehearsal.main import prepare
from ops.report import load_records

ROOT = Path(__file__).resolve().parents[2]
NAME = "chaos"
GONE_WAIT_S = 20.0
ALL_KINDS = (*KINDS, *HOST_FAULTS)
CLUSTER_STEP_S = 8.0  # the default workload on the cluster: ZeRO-3 over two ranks, two engines, 2 shared cores
# The default workload under faults: 3.3-3.9 s a step here with a fault-free run beside it, ~1 s of each lost
# to the faults; 4 s sized 800 steps for 60 minutes, and that run would have ended before its window.
DEFAULT_STEP_S = 3.0
SGLANG_MIN_INTERVAL_S = 30.0
SGLANG_STEP_S = 12.0  # the default workload on a live SGLang engine (ops/configs/sglang-cpu.yaml), 2 shared cores
HEAL_STEPS = 5  # no fault in the last versions (~20-50 s: an actor restart fits): the final heal
# On the cluster a host brought back must first be found by the launcher's probe (backoff up to ~30 s), then
# start its engine and load the newest weights: 5 versions (~30 s there) ended a run before it served again.
CLUSTER_HEAL_STEPS = 10
STOP_GRACE_S = 30.0  # a launcher's orderly stop takes its 6 s grace and the report; then SIGKILL


class Launch:
    """One launcher process (here, or on a cluster's head host); its output goes to a file, kept for the record."""

    def __init__(self, args: list[str], log: Path, cluster: ClusterView | None = None) -> None:
        # ops/launch.sh's environment, as it would export it.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                   TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                       str(Path.home() / ".cache/vapo/torch_extensions")))
        if cluster is not None:
            self.proc = cluster.start(args, log, lifeline.popen_kwargs(cluster.cluster.env(**env)))
        else:
            with log.open("ab") as out:
                self.proc = subprocess.Popen([sys.executable, "-m", "ops.launch", *args], cwd=ROOT, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             **lifeline.popen_kwargs(env))
        with _LIVE_LOCK:
            LIVE.add(self)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """The launcher's orderly stop (SIGTERM: its children in order, then every process group), SIGKILL
        after ``STOP_GRACE_S``. A SIGKILL alone, or the lifeline's, would leave what its children cannot clean up
        themselves: an SGLang engine starting has spawned processes that do not yet die with it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with _LIVE_LOCK:
            LIVE.discard(self)


LIVE: set[Launch] = set()  # the launchers running now (the chaos run's, and a baseline's alongside)
_LIVE_LOCK = threading.Lock()


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def port_args() -> tuple[list[str], list[int], list[int]]:
    """Overrides giving every socket its own free port; all ports; the /metrics ports (one actor each)."""
    ports = fresh_ports()
    metrics = [ports[k] for k in ("buffer.metrics_port", "learner.metrics_port", "actors.metrics_base_port",
                                  "metrics.launcher_port")]
    return as_overrides(ports), list(ports.values()), metrics


def run_once(args: list[str], run_dir: Path, deadline: float, nemesis: Nemesis | None,
             metrics_ports: list[int], max_resumes: int, cluster: ClusterView | None = None) -> tuple[int, int]:
    """Launch, and resume after every stop, until the run finishes, resumes run out or the deadline.

    Returns (last exit code, resumes). The nemesis, if any, is pointed at each launcher while it runs.
    """
    resumes, rc = 0, 1
    while True:
        launch = Launch((["--resume"] if resumes else []) + args, run_dir.parent / f"{run_dir.name}-launcher.log",
                        cluster)
        if nemesis is not None:
            nemesis.target = Target(launch.proc.pid, run_dir, metrics_ports, cluster=cluster)
        try:
            rc = launch.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            if nemesis is not None:
                nemesis.target = None
            launch.stop()
        if rc == 0 or rc == 124 or resumes >= max_resumes or not (run_dir / "config.yaml").is_file():
            return rc, resumes
        resumes += 1
        if nemesis is not None:
            nemesis.record("resume", after_rc=rc)


def step_gaps_lost(run_dir: Path) -> float:
    """Seconds of learner step gaps beyond the median gap: what the faults cost the learner."""
    times = sorted(float(r["time"]) for r in load_records(run_dir) if r.get("kind") == "learner_step")
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if len(gaps) < 2:
        return 0.0
    median = statistics.median(gaps)
    return round(sum(g - median for g in gaps if g > median * 2), 1)


def leftovers(run_dir: Path, ports: list[int]) -> list[str]:
    """Processes naming the run directory and ports still bound, after a bounded wait for them to go."""
    deadline = time.time() + GONE_WAIT_S
    while True:
        procs = mentioning(str(run_dir))
        busy = [p for p in ports if not port_free(p)]
        if (not procs and not busy) or time.time() > deadline:
            return [f"process {p}" for p in procs] + [f"port {p} bound" for p in busy]
        time.sleep(0.5)


def baseline_accuracy(common_args: list[str], root: Path, deadline: float,
                      cluster: ClusterView | None = None) -> float | None:
    """The same config and seed without faults: its final held-out accuracy."""
    overrides = port_args()[0] if cluster is None else []
    run_dir = root / "baseline"
    rc, _ = run_once([*common_args, f"run.name={run_dir.name}", *overrides], run_dir, deadline, None, [], 0, cluster)
    summary = run_dir / "summary.json"
    if rc != 0 or not summary.is_file():
        return None
    return json.loads(summary.read_text()).get("final_accuracy")


def start_reference(a: argparse.Namespace, common_args: list[str], root: Path, deadline: float,
                    cluster: ClusterView | None) -> Callable[[], float | None] | None:
    """Start finding the reference accuracy; the returned call gives it (waiting for a baseline alongside).
    None with ``--baseline base``: the history's own base accuracy is the reference."""
    if a.reference_accuracy is not None:
        return lambda: a.reference_accuracy
    if a.baseline == "base":
        return None
    if a.baseline == "run":
        accuracy = baseline_accuracy(common_args, root, deadline, cluster)
        return lambda: accuracy
    # Alongside: the same config and seed, fault-free, sharing the machine with the chaos run: about half the
    # wall time of "run", and both runs see the same load but for the faults.
    found: list[float | None] = []
    thread = threading.Thread(daemon=True, target=lambda: found.append(
        baseline_accuracy(common_args, root, deadline, cluster)))
    thread.start()

    def wait() -> float | None:
        thread.join(max(1.0, deadline - time.time()))
        return found[0] if found else None
    return wait


def settings(a: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --short and --cluster."""
    a.config = a.config or (CLUSTER_CONFIG if a.cluster else "ops/configs/default.yaml")
    a.engine_kind = engine_kind(a)
    sglang = not a.cluster and a.engine_kind == "sglang"
    a.step_s = a.step_s or (CLUSTER_STEP_S if a.cluster else SGLANG_STEP_S if sglang else DEFAULT_STEP_S)
    if a.short:
        a.minutes = 4.0 if a.minutes is None else a.minutes
        a.steps = a.steps or (int(a.minutes * 60 / a.step_s) if a.cluster else 24)
        a.interval_s = a.interval_s or 15.0
        a.baseline = a.baseline or "base"
    a.minutes = 60.0 if a.minutes is None else a.minutes
    a.steps = a.steps or max(10, int(a.minutes * 60 / a.step_s))
    # ~50 faults in the window; on live SGLang at least 30 s apart: a killed actor's or engine's return there
    # takes 20-70 s, and faults every 10 s (an 8-minute window) let a run make 3 steps in 6 minutes.
    a.interval_s = a.interval_s or max(SGLANG_MIN_INTERVAL_S if sglang else 5.0, a.minutes * 60 / 50)
    a.baseline = a.baseline or "run"
    return a


def engine_kind(a: argparse.Namespace) -> str:
    """engine.kind of the run's config with its overrides (sglang: live SGLang engines, the launcher's children)."""
    return load_config_args([str(ROOT / a.config), *a.overrides]).engine.kind


def chaos(a: argparse.Namespace, cluster: ClusterView | None = None) -> dict[str, Any]:
    """The whole chaos run (on ``cluster``'s hosts when given); returns its full record (the JSON line's
    fields and the details)."""
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="vapo-chaos-"))
    a.root = str(root)  # an interrupted run's line names it (main)
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / NAME
    common_args = [a.config, f"run.root={root}", f"run.seed={a.seed}", f"learner.total_steps={a.steps}",
                   "buffer.record_served=true", "engine.max_restarts=1000", "learner.checkpoint_every=5",
                   *([*CLUSTER_OVERRIDES, *workload_overrides(), f"buffer.local_root={root / 'local'}"] if cluster else []),
                   *a.overrides]
    # Across several hosts the buffer lives under buffer.local_root (host 0's disk), not in the run directory.
    buffer_dir = root / "local" / NAME / "buffer" if cluster else run_dir / "buffer"
    t0 = time.time()
    hard_deadline = t0 + a.minutes * 60 * 4 + 900  # a wedged run ends as a failure, not a hang
    reference = start_reference(a, common_args, root, hard_deadline, cluster)
    t_chaos = time.time()
    # A cluster run's addresses are the rehearsal config's, inside its hosts' namespaces.
    overrides, ports, metrics_ports = port_args() if cluster is None else ([], [], [])
    nemesis = Nemesis(seed=a.seed, interval_s=a.interval_s, t0=t_chaos, until=t_chaos + a.minutes * 60,
                      kinds=kinds_of(a), heal_at=a.steps - (CLUSTER_HEAL_STEPS if cluster else HEAL_STEPS))
    thread = threading.Thread(target=nemesis.run, daemon=True)
    thread.start()
    try:
        rc, resumes = run_once([*common_args, f"run.name={NAME}", *overrides], run_dir, hard_deadline, nemesis,
                               metrics_ports, a.max_resumes, cluster)
    finally:
        nemesis.stop.set()
        thread.join(30)
        nemesis.wait_undone(90.0 if cluster is not None else 30.0)  # a host back up waits for its sshd and Slurm
    wall = time.time() - t_chaos
    left = leftovers(run_dir, ports) + (cluster.leftovers() if cluster is not None else [])
    if not (buffer_dir / "data.mdb").is_file():  # the launch failed before the run began
        log = (root / f"{NAME}-launcher.log").read_text(errors="replace")[-3000:]
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"the chaos run never started (launcher exit {rc}):\n{log}")
    history = read_history(run_dir, buffer_dir, max_staleness=_staleness(run_dir), total_steps=a.steps)
    if reference is not None:
        history.reference_accuracy = reference()  # None when the baseline run failed: the check fails
    history.tolerance = a.tolerance
    lost = step_gaps_lost(run_dir)
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
        if root.exists():
            left.append(f"temporary root {root} not removed")
    history.leftovers = left
    verdicts = check(history)
    faults = Counter(f["kind"] for f in nemesis.faults if f["kind"] in ALL_KINDS)
    takes = history.takes
    return {
        "kind": "chaos", "seed": a.seed, "minutes": a.minutes, "config": a.config, "total_steps": a.steps,
        "hosts": len(cluster.cluster.hosts) if cluster is not None else 1,
        "rc": rc, "wall_s": round(wall, 1), "faults_total": sum(faults.values()), "faults": dict(sorted(faults.items())),
        "resumes": resumes, "pass": all(v["pass"] for v in verdicts.values()),
        "invariants": {k: v["pass"] for k, v in verdicts.items()},
        "accuracy": history.accuracy, "reference_accuracy": history.reference_accuracy,
        "reference": ("given" if a.reference_accuracy is not None else "fault-free run" if a.baseline == "run"
                      else "fault-free run alongside" if a.baseline == "alongside" else "base"),
        "tolerance": a.tolerance, "lost_s": lost,
        "groups": {"acked_stored": len(history.stored), "served": sum(len(t["served"]) for t in takes),
                   "dropped_stale": sum(len(t["dropped"]) for t in takes), "waiting": len(history.waiting)},
        "published": len(history.published), "run_dir": str(run_dir) if a.keep else None,
        "details": {"invariants": verdicts, "fault_log": nemesis.faults},
    }


def kinds_of(a: argparse.Namespace) -> tuple[str, ...]:
    """The fault kinds the nemesis picks from: ``--faults``, else all that the mode can take."""
    return tuple(a.faults.split(",")) if a.faults else CLUSTER_KINDS if a.cluster else KINDS


def _staleness(run_dir: Path) -> int:
    """buffer.max_staleness of the run, from its resolved config.yaml."""
    return int(yaml.safe_load((run_dir / "config.yaml").read_text())["buffer"]["max_staleness"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="how long faults are injected (default 60; 4 with --short)")
    ap.add_argument("--seed", type=int, default=0, help="the nemesis's and the run's seed")
    ap.add_argument("--short", action="store_true", help="the slow test's mode: ≤ 5 minutes")
    ap.add_argument("--config", default="", help=f"default ops/configs/default.yaml; {CLUSTER_CONFIG} with --cluster")
    ap.add_argument("--cluster", action="store_true",
                    help="on the rehearsal's four hosts (network namespaces; root and its Debian packages), "
                         "with host faults: " + ",".join(HOST_FAULTS))
    ap.add_argument("--steps", type=int, default=0, help="learner.total_steps (default: minutes × 60 / --step-s)")
    ap.add_argument("--step-s", type=float, default=0.0,
                    help=f"expected seconds per learner step, to size --steps (default {DEFAULT_STEP_S:g}; "
                         f"{CLUSTER_STEP_S:g} with --cluster, {SGLANG_STEP_S:g} on live SGLang)")
    ap.add_argument("--interval-s", type=float, default=0.0, help="mean seconds between faults (default: ~50 in the window)")
    ap.add_argument("--faults", default="", help="comma-separated fault kinds to pick from (default all that the mode "
                    f"can take: {','.join(KINDS)}; with --cluster {','.join(CLUSTER_KINDS)})")
    ap.add_argument("--baseline", choices=("run", "alongside", "base"), default=None,
                    help="the reference accuracy's source: a fault-free run of the same seed first (run), at the "
                         "same time on the same machine (alongside), or the run's own base accuracy (base)")
    ap.add_argument("--reference-accuracy", type=float, default=None, help="a known fault-free final accuracy")
    ap.add_argument("--tolerance", type=float, default=0.05, help="accuracy may be this far below the reference")
    ap.add_argument("--max-resumes", type=int, default=20)
    ap.add_argument("--root", default="", help="run root (default: a temporary directory, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the run root (then reported, not removed)")
    ap.add_argument("--out", default="", help="write the full record (every fault, every invariant's counts) here")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value for both runs")
    try:
        a = settings(ap.parse_args(argv))
    except ConfigError as e:
        ap.error(str(e))
    if a.cluster and a.baseline == "alongside":
        ap.error("--baseline alongside needs a second cluster; on --cluster use run, base or --reference-accuracy")
    allowed = CLUSTER_KINDS if a.cluster else KINDS
    if unknown := sorted({f for f in a.faults.split(",") if f} - set(allowed)):
        ap.error(f"unknown fault kind(s) {unknown} {'on a cluster' if a.cluster else 'here'}; choose from {list(allowed)}")
    if a.cluster and a.engine_kind == "sglang":
        ap.error("--cluster runs rollout_server engines (ops/rehearse.sh --engine sglang runs live SGLang engines "
                 "on the hosts one fault at a time); live SGLang under the nemesis: --config ops/configs/sglang-cpu.yaml")
    if a.engine_kind == "sglang" and (missing := missing_modules(sys.executable)):
        print(json.dumps({"kind": "chaos", "pass": False,
                          "skipped": f"engine.kind=sglang: {sys.executable} has no {', '.join(missing)} "
                                     "(ops/setup.sh --sglang)"}), flush=True)
        return 3
    # Ctrl-C or SIGTERM (also when SIGINT arrived ignored, as a script's `cmd &` has it): every launcher
    # stops in order, as ops/launch.sh's own stop does, instead of dying with this process.
    before = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(a)
    except KeyboardInterrupt:
        for launch in list(LIVE):
            launch.stop()
        # An interrupted run's logs and history are what its user reads next: kept, and named.
        print(json.dumps({"kind": "chaos", "pass": False, "interrupted": True, "root": a.root or None,
                          "kept": "the run root, with its logs and history; remove it when read"}), flush=True)
        return 130
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run(a: argparse.Namespace) -> int:
    """The run of ``main``'s arguments: one JSON line, the record to ``--out``; the exit code."""
    if not a.cluster:
        record = chaos(a)
    elif why := missing_prerequisites():
        print(json.dumps({"kind": "chaos", "pass": False, "skipped": why}), flush=True)
        return 3
    else:
        with Cluster(keep=ROOT / "runs/_rehearsal/logs" / f"chaos-daemons-{time.strftime('%Y%m%d-%H%M%S')}") as c:
            prepare("rollout_server")  # the rehearsal config's keys, with the machine's rehearsal lock held
            record = chaos(a, ClusterView(c))
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    line = {k: v for k, v in record.items() if k != "details"}
    print(json.dumps(line), flush=True)
    return 0 if record["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
