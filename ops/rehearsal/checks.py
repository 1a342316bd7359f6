"""The rehearsal's stages on a running cluster; each returns figures for the JSON line.

Times are scaled down: the process-group timeout is ``DIST_TIMEOUT_S`` (paper scale: 30 min) and rank 0
waits longer than that for the buffer while the engine hosts are frozen for ``FREEZE_S``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from actors.rollout_server.process import ADMIN_KEY_ENV
from buffer.directory import inspect
from ops.rehearsal import elastic, sglang
from ops.rehearsal.cluster import ENGINE_TMP_PREFIX, Cluster, proc_environ
from ops.rehearsal.push import DigestPoller, param_digest_of, sync_figures
from ops.rehearsal.runs import CONFIG, ROOT, Run, describe, finish, launch, leftovers

DIST_TIMEOUT_S = 4.0  # learner.dist_timeout_s of the rehearsal's runs
FREEZE_S = 3 * DIST_TIMEOUT_S  # engines stopped until the learner has been silent this long
# The push run checks no process-group timeout; the learner's rendezvous waits only that long for every rank
# (learner.dist), and over pdsh on 2 cores busy with engines starting one rank can come ~5 s after the other.
PUSH_DIST_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 420.0  # one rehearsal run, launcher start to exit
# The JSON line's figures of a run's shape (``_shape``), taken from the first stage that reports them.
SHAPE_KEYS = ("learner_ranks_per_host", "engines_per_host", "actors_per_host", "steps", "base_accuracy",
              "final_accuracy")
# A killed learner host: rank 0's next collective fails within the process-group timeout (or pdsh reports
# the lost ssh at once), then the launcher's stop grace (6 s) and the remote guards' SIGTERM→SIGKILL.
STOP_BOUND_S = 60.0


def _wait(what: str, ok: Any, run: Run, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not ok():
        if run.proc.poll() is not None:
            raise RuntimeError(f"{what}: the launcher exited ({run.proc.returncode}) first:\n{run.tail()}")
        if time.time() > deadline:
            raise RuntimeError(f"{what}: not reached within {timeout_s:.0f} s:\n{run.tail()}")
        time.sleep(0.5)  # polling the run's metrics with a deadline


def roles_per_host(c: Cluster) -> dict[str, dict[str, int]]:
    """What each host runs now: learner rank processes, engines (distinct ports), actors (distinct ids);
    guards, ssh and launcher wrappers not counted."""
    out: dict[str, dict[str, int]] = {}
    for h in c.hosts:
        seen: dict[str, set[str]] = {"learner": set(), "engine": set(), "actor": set()}
        for i, cmd in enumerate(describe(c, h)):
            argv = cmd.split()
            if not argv or Path(argv[0]).name not in ("python", "python3") or "common.remote" in cmd:
                continue
            if ("actors.rollout_server" in cmd and "--port" in argv) or sglang.is_engine(argv):
                seen["engine"].add(argv[argv.index("--port") + 1])
            elif " -m actors " in f" {cmd} " and "--actor-id" in argv:
                seen["actor"].add(argv[argv.index("--actor-id") + 1])
            elif " -m learner " in f" {cmd} ":
                seen["learner"].add(str(i))
        out[h] = {role: len(v) for role, v in seen.items() if v}
    return out


def engines_now(c: Cluster, engine: str = "rollout_server") -> list[tuple[str, int, str]]:
    """(host, port, admin key) of each engine of kind ``engine`` running now. An actor starts its
    rollout_server with a fresh admin key in the engine's environment only; the rehearsal, root on this
    machine, reads it there to ask the engine for its ``/weights_digest`` (a control endpoint). SGLang
    engines take the rehearsal's own key (``rehearsal.sglang.ADMIN_KEY``)."""
    out = []
    for h in c.hosts:
        for p in c.run_pids(h):
            try:
                argv = Path(f"/proc/{p}/cmdline").read_bytes().decode().split("\0")
                if engine == "sglang":
                    if sglang.is_engine(argv):
                        out.append((h, int(argv[argv.index("--port") + 1]), sglang.admin_key(ROOT)))
                    continue
                if "actors.rollout_server" not in argv or "--port" not in argv:
                    continue
                env = proc_environ(p)
            except OSError:
                continue
            out.append((h, int(argv[argv.index("--port") + 1]), env.get(ADMIN_KEY_ENV, "")))
    return out


def engine_tmpdirs(c: Cluster) -> dict[str, list[str]]:
    """Per host, the ``TMPDIR`` each SGLang engine process runs with (``""``: the host's own)."""
    out: dict[str, list[str]] = {}
    for h in c.hosts:
        for p in c.run_pids(h):
            try:
                argv = Path(f"/proc/{p}/cmdline").read_bytes().decode().split("\0")
                if not sglang.is_engine(argv):
                    continue
                env = proc_environ(p)
            except OSError:
                continue
            out.setdefault(h, []).append(env.get("TMPDIR", ""))
    return out


def digest_poller(c: Cluster, engine: str) -> DigestPoller:
    """Polls the engines' weights while a run goes on: rollout_server's ``/weights_digest``, SGLang's
    ``/weights_checker`` checksum (``rehearsal.sglang``)."""
    if engine == "sglang":
        return DigestPoller(c, lambda: engines_now(c, engine), query=sglang.QUERY)
    return DigestPoller(c, lambda: engines_now(c, engine))


def disk_digest(engine: str) -> Callable[[Path], str]:
    """What an engine of kind ``engine`` holding a disk version answers as its digest."""
    return sglang.expected_digest if engine == "sglang" else param_digest_of


def admin_api(c: Cluster, engine: str, from_host: str = "h0") -> dict[str, Any]:
    """SGLang engines bound to the bridge: from another host, a control request without the admin key is
    refused (401) and with it answered (200); ``{}`` for rollout_server (its own tests cover it)."""
    if engine != "sglang":
        return {}
    codes = {}
    for host, port, key in engines_now(c, engine):
        probe = json.dumps([f"http://{host}:{port}", key])
        r = c.run(from_host, ["python3", "-c", sglang.AUTH_PROBE], timeout=90, env=c.env(VAPO_AUTH_PROBE=probe))
        codes[f"{host}:{port}"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else [None, None]
    return {"from": from_host, "codes": codes, "ok": bool(codes) and all(v == [401, 200] for v in codes.values())}


def freeze(c: Cluster, hosts: list[str], sig: int) -> int:
    """``sig`` (SIGSTOP/SIGCONT) to the engines on ``hosts`` (every process of an SGLang engine): generation
    stops, everything else (actors, their ssh lifelines, the guards) keeps running, so the buffer simply
    receives nothing."""
    n = 0
    for h in hosts:
        for p in c.run_pids(h):
            try:
                cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
                if b"rollout_server" not in cmdline and not sglang.is_engine_part(cmdline):
                    continue
            except OSError:
                continue
            try:
                os.kill(p, sig)
                n += 1
            except ProcessLookupError:
                pass
    return n


def rank0_stall(c: Cluster, run: Run, engine_hosts: list[str]) -> float:
    """Freeze the engines until the learner has written nothing for ``FREEZE_S`` (rank 0 waits for a batch
    or an evaluation, the other ranks in a collective), then thaw them; returns the seconds between the
    last record before and the first after (the rank-0 wait the other ranks outlived)."""
    freeze(c, engine_hosts, signal.SIGSTOP)
    try:
        n, t_last = len(run.records()), time.time()
        deadline = time.time() + 120
        while time.time() - t_last < FREEZE_S and time.time() < deadline and run.proc.poll() is None:
            if len(run.records()) != n:
                n, t_last = len(run.records()), time.time()
            time.sleep(0.2)  # polling the run's metrics for its progress
    finally:
        freeze(c, engine_hosts, signal.SIGCONT)
    while len(run.records()) == n and run.proc.poll() is None and time.time() < deadline + 120:
        time.sleep(0.2)  # polling for the first record after the thaw
    return round(time.time() - t_last, 1)


def _stop_if_running(run: Run) -> None:
    """A stage that failed part-way stops its launcher (SIGTERM: its children in order) before the next."""
    if run.proc.poll() is None:
        finish(run, 0)


def _shape(run: Run, placed: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The JSON line's top-level figures of one run: what each host ran, steps, accuracy before and after."""
    evals = run.evals()
    return {
        "learner_ranks_per_host": {h: r.get("learner", 0) for h, r in placed.items() if r.get("learner")},
        "engines_per_host": {h: r.get("engine", 0) for h, r in placed.items() if r.get("engine")},
        "actors_per_host": {h: r.get("actor", 0) for h, r in placed.items() if r.get("actor")},
        "steps": run.steps(),
        "base_accuracy": evals[0] if evals else None,
        "final_accuracy": evals[-1] if len(evals) > 1 else None,
    }


def ssh_route(c: Cluster, stamp: str, logs: Path, extra: list[str], digests: bool = False,
              engine: str = "rollout_server") -> dict[str, Any]:
    """paper.yaml's topology over ssh/pdsh, with check 1: a rank-0 wait past the process-group timeout, and
    check 7 (``rehearsal.elastic``): engine host h3 killed mid-run and brought back, the run going on without
    it. With ``digests``, also the disk transport's weight-sync figures, the engines' digests polled meanwhile."""
    over = [f"learner.dist_timeout_s={DIST_TIMEOUT_S:g}", *elastic.overrides(engine),
            *([f"learner.keep_weights={elastic.TOTAL_STEPS[engine] + 1}"] if digests else []), *extra]
    run = launch(c, f"rehearsal-{stamp}", over, logs)
    poller = digest_poller(c, engine) if digests else None
    host_down: dict[str, Any] = {}
    try:
        with poller or contextlib.nullcontext():
            _wait("first RL step", lambda: run.steps() >= 1, run, RUN_TIMEOUT_S)
            placed = roles_per_host(c)
            engine_hosts = [h for h, r in placed.items() if r.get("engine")]
            stall = rank0_stall(c, run, engine_hosts)
            try:  # check 7: an engine host lost and back; the run goes on without it
                host_down = elastic.engine_host_down(c, run, lambda what, ok, t: _wait(what, ok, run, t), engine)
            except RuntimeError as e:
                host_down = {"error": str(e)[-1500:], "buffer_dir": str(run.buffer_path())}
            finish(run, RUN_TIMEOUT_S)
    finally:
        _stop_if_running(run)
    sync = {"weight_sync_disk": sync_figures(run.dir, "disk", poller.seen, disk_digest(engine))} if poller else {}
    left = leftovers(c)
    return {
        "ssh_route": {"rc": run.rc, "seconds": run.seconds, "steps": run.steps(), "total_steps": _total_steps(run),
                      "run": run.name},
        **_shape(run, placed),
        "check_pg_timeout": {"ok": run.rc == 0 and run.steps() >= _total_steps(run) and stall > DIST_TIMEOUT_S, "dist_timeout_s": DIST_TIMEOUT_S,
                             "rank0_wait_s": stall},
        "check_engine_host_lost": elastic.verdict(host_down, run, _total_steps(run)),
        "procs_left": left,
        **sync,
    }


def push_route(c: Cluster, stamp: str, logs: Path, extra: list[str], engine: str = "rollout_server") -> dict[str, Any]:
    """Check 6 (``--push``; always with SGLang engines): the same training with
    ``learner.weight_transport=distributed``: rank 0 on h0 broadcasts each version to the engines on h2 and
    h3 over gloo (across the shaped link with ``--link``); every step done, every actor's pushes ok, the
    engines bitwise equal to the disk version. SGLang's also refuse a control request from h0 without the
    admin key (they bind the bridge), and their start is timed from their logs."""
    # Addresses as the rehearsal's config names the others: h0's, which /etc/hosts maps to the bridge. The
    # weight group's store off loopback takes a fixed port (as paper.yaml's), beside the learner's 29500.
    over = [f"learner.dist_timeout_s={PUSH_DIST_TIMEOUT_S:g}", "learner.weight_transport=distributed",
            "learner.push_addr=tcp://h0:5559", "learner.push_master_address=h0", "learner.push_master_port=29501",
            "learner.keep_weights=100", *extra]
    run = launch(c, f"rehearsal-push-{stamp}", over, logs)
    try:
        with digest_poller(c, engine) as poller:
            # Once a step is done every engine and actor runs: what each host runs, and the engines' admin API.
            _wait("first RL step", lambda: run.steps() >= 1, run, RUN_TIMEOUT_S)
            placed, admin, tmpdirs = roles_per_host(c), admin_api(c, engine), engine_tmpdirs(c)
            finish(run, RUN_TIMEOUT_S)
    finally:
        _stop_if_running(run)
    figures = sync_figures(run.dir, "distributed", poller.seen, disk_digest(engine))
    total = _total_steps(run)
    actors = figures["actors"]
    pushes_ok = bool(actors) and all(
        not a["fatal"] and not a["weight_sync_failures"] and (a["weight_pushes"] or 0) >= 1 and a["weight_version"] == total
        for a in actors)
    ok = run.rc == 0 and run.steps() >= total and pushes_ok and figures["bitwise"]["ok"] and admin.get("ok", True)
    check = {"ok": ok, "engine": engine, "rc": run.rc, "seconds": run.seconds, "steps": run.steps(), "total_steps": total,
             "pushes_ok": pushes_ok, "pushes": sum(a["weight_pushes"] or 0 for a in actors),
             "push_failures": sum(a["weight_sync_failures"] or 0 for a in actors),
             "bitwise_equal": figures["bitwise"]["ok"], "run": run.name}
    if engine == "sglang":
        # SGLang never removes its ipc socket files: each engine must run in a TMPDIR of its own on its host.
        private = bool(tmpdirs) and all(Path(t).name.startswith(ENGINE_TMP_PREFIX) for ts in tmpdirs.values() for t in ts)
        check.update(engine_start_s=sglang.engine_start_seconds(run.dir), admin_api=admin, engine_tmpdirs=tmpdirs,
                     engine_tmpdirs_private=private, ok=ok and private)
    return {"check_push_shaped": check, "weight_sync_distributed": figures, **_shape(run, placed),
            "procs_left": leftovers(c)}


def plan_checks(c: Cluster, stamp: str, logs: Path, extra: list[str]) -> dict[str, Any]:
    """Check 2: a missing key file named by --dry-run. Check 3: no pdsh refused at plan time, nothing started."""
    key = "buffer.curve.client_secret_key"
    r = c.run("h0", ["ops/launch.sh", CONFIG, f"{key}=runs/_rehearsal/keys/client.key_secret", *extra, "--dry-run"],
              cwd=ROOT, timeout=120)
    said = (r.stdout + r.stderr).strip().splitlines()
    missing_key = {"ok": r.returncode != 0 and any(key in ln for ln in said), "rc": r.returncode,
                   "said": next((ln for ln in said if key in ln), said[-1] if said else "")[:300]}
    # pdsh hidden for this one launch on h0 (a private mount), as on a head node without it.
    name = f"rehearsal-nopdsh-{stamp}"
    hide = 'mount --bind /dev/null "$(command -v pdsh)" && exec "$@"'
    t0 = time.time()
    r = c.run("h0", ["unshare", "--mount", "sh", "-c", hide, "sh", "ops/launch.sh", CONFIG, f"run.name={name}", *extra],
              cwd=ROOT, timeout=180)  # a mount namespace of its own: pdsh stays on h0 for the other stages
    said = (r.stdout + r.stderr).strip().splitlines()
    started = (ROOT / "runs" / name / "logs").exists()
    no_pdsh = {"ok": r.returncode != 0 and not started and any("pdsh" in ln for ln in said), "rc": r.returncode,
               "seconds": round(time.time() - t0, 1), "anything_started": started,
               "said": next((ln for ln in said if "pdsh" in ln), said[-1] if said else "")[:300]}
    return {"check_missing_key_dry_run": missing_key, "check_no_pdsh_plan_time": no_pdsh,
            "procs_left": leftovers(c, 5)}


def slurm_route(c: Cluster, stamp: str, logs: Path, extra: list[str]) -> dict[str, Any]:
    """Check 4: sbatch ops/slurm/vapo.sbatch runs the same training, remote processes through srun."""
    name = f"rehearsal-slurm-{stamp}"
    out = logs / f"{name}.out"
    logs.mkdir(parents=True, exist_ok=True)
    # The script asks for 8 GPUs a node; the rehearsal's nodes have none, and one slot each.
    argv = ["sbatch", "--wait", f"--nodes={len(c.hosts)}", "--gpus-per-node=0", f"--output={out}",
            "ops/slurm/vapo.sbatch", CONFIG, f"run.name={name}", "placement.gpus_per_host=1",
            f"learner.dist_timeout_s={DIST_TIMEOUT_S:g}", *extra]
    t0 = time.time()
    p = c.popen("h0", argv, cwd=ROOT, env=c.env(VAPO_REMOTE="srun"), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
    run = finish(Run(name, p, out, t0), RUN_TIMEOUT_S)
    evals = run.evals()
    ok = run.rc == 0 and run.steps() >= _total_steps(run)
    return {"check_slurm_route": {"ok": ok, "rc": run.rc, "seconds": run.seconds, "steps": run.steps(),
                                  "final_accuracy": evals[-1] if evals else None, "run": name},
            "procs_left": leftovers(c)}


def _total_steps(run: Run) -> int:
    cfg = yaml.safe_load((run.dir / "config.yaml").read_text()) if (run.dir / "config.yaml").exists() else {}
    return int(cfg.get("learner", {}).get("total_steps", 1 << 30))


def kill_host(c: Cluster, stamp: str, logs: Path, extra: list[str], victim: str = "h1") -> dict[str, Any]:
    """Check 5: every process of a learner host killed mid-run; the run stops in order within
    STOP_BOUND_S, no acknowledged group is lost, and --resume on the host, back up, runs to the end."""
    name = f"rehearsal-kill-{stamp}"
    over = [f"learner.dist_timeout_s={DIST_TIMEOUT_S:g}", "learner.total_steps=6", "learner.checkpoint_every=2",
            "learner.eval_every=0", *extra]
    run = launch(c, name, over, logs)
    _wait("a checkpoint and a step after it", lambda: run.steps() >= 3 and any((run.dir / "checkpoints").glob("*")),
          run, RUN_TIMEOUT_S)
    before = inspect(run.buffer_path())["counters"]
    t_kill = time.time()
    c.kill_host(victim)
    finish(run, time.time() - run.t0 + STOP_BOUND_S)
    stop_s = round(time.time() - t_kill, 1)
    left = leftovers(c)
    after = inspect(run.buffer_path())["counters"]
    c.restart_host(victim)
    resumed = finish(launch(c, name, over, logs, resume=True), RUN_TIMEOUT_S)
    total = _total_steps(resumed)
    # The resumed learner's last checkpoint: it ends at total_steps as a version, which may come from
    # republishing the checkpoint's weights past versions the killed run had published (not as a step).
    final = max((int(p.name[1:]) for p in (run.dir / "checkpoints").glob("v[0-9]*") if p.name[1:].isdigit()),
                default=0)  # not v<N>.tmp, v<N>.damaged
    lost = before["accepted_groups"] - after["accepted_groups"]
    return {"check_kill_host": {
        "ok": run.rc not in (0, None) and stop_s <= STOP_BOUND_S and not any(left.values()) and lost <= 0
        and resumed.rc == 0 and final >= total,
        "host": victim, "stopped_after_s": stop_s, "bound_s": STOP_BOUND_S, "launcher_rc": run.rc,
        "procs_left_after_stop": sum(len(v) for v in left.values()), "left_after_stop": left, "acked_groups_at_kill": before["accepted_groups"],
        "stored_groups_after_stop": after["accepted_groups"], "resume_rc": resumed.rc, "resume_final_version": final,
        "total_steps": total, "run": name},
        "procs_left": leftovers(c)}


def auto_resume(c: Cluster, stamp: str, logs: Path, extra: list[str], victim: str = "h1") -> dict[str, Any]:
    """Check 6: the learner host of check 5 killed under ``run.max_resumes=1``: the launcher stops the run,
    probes the host until it is back, resumes by itself and ends with exit 0, one resume in its summary."""
    name = f"rehearsal-resume-{stamp}"
    over = [f"learner.dist_timeout_s={DIST_TIMEOUT_S:g}", "learner.total_steps=6", "learner.checkpoint_every=2",
            "learner.eval_every=0", "run.max_resumes=1", f"run.resume_wait_s={RUN_TIMEOUT_S:g}", *extra]
    run = launch(c, name, over, logs)
    back = False
    try:
        _wait("a checkpoint and a step after it", lambda: run.steps() >= 3 and any((run.dir / "checkpoints").glob("*")),
              run, RUN_TIMEOUT_S)
        t_kill = time.time()
        c.kill_host(victim)
        _wait(f"the launcher probing {victim}", lambda: f"auto-resume: waiting for host(s) {victim}" in run.tail(400),
              run, STOP_BOUND_S)
        waited_s = round(time.time() - t_kill, 1)
        c.restart_host(victim)
        back, t_back = True, time.time()
        finish(run, time.time() - run.t0 + RUN_TIMEOUT_S)
    finally:
        if run.proc.poll() is None:  # a failed wait: the launcher stopped in order, the host back for what follows
            finish(run, 0)
        if not back:
            c.restart_host(victim)
    summary = json.loads((run.dir / "summary.json").read_text()) if (run.dir / "summary.json").exists() else {}
    events = summary.get("auto_resume_events", [])
    said = [ln for ln in run.tail(400).splitlines() if "AUTO-RESUME" in ln or "answers again" in ln]
    return {"check_auto_resume": {
        "ok": run.rc == 0 and summary.get("auto_resumes") == 1 and run.steps() >= _total_steps(run)
        and bool(events) and events[0].get("down_s") is not None,
        "host": victim, "rc": run.rc, "probing_after_s": waited_s, "finished_after_return_s": round(time.time() - t_back, 1),
        "auto_resumes": summary.get("auto_resumes"), "lost_s": summary.get("resume_lost_seconds"),
        "resume": events[0] if events else None, "said": [ln[:240] for ln in said], "run": name},
        "procs_left": leftovers(c)}


def kill_and_resume(c: Cluster, stamp: str, logs: Path, extra: list[str]) -> dict[str, Any]:
    """Checks 5 and 6, the "kill" stage: a learner host killed, resumed by hand, then resumed by the launcher."""
    out = kill_host(c, stamp, logs, extra)
    left = out.pop("procs_left")
    try:
        out.update(auto_resume(c, stamp, logs, extra))
    except Exception as e:  # reported as this check's failure; check 5's figures stay
        out.update({"check_auto_resume": {"ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]},
                    "procs_left": leftovers(c)})
    out["procs_left"] = {k: left.get(k, []) + out["procs_left"].get(k, []) for k in {*left, *out["procs_left"]}}
    return out


def run_all(c: Cluster, stamp: str, logs: Path, skip: set[str], extra: list[str], push: bool = False,
            engine: str = "rollout_server") -> dict[str, Any]:
    """The stages not in ``skip``; with ``push`` also the distributed push's run and both transports' figures
    (``weight_sync``: disk from the ssh route's run, distributed from the push run). ``engine``: the kind the
    runs' ``extra`` overrides start (their engines are counted, frozen and polled as that kind). The
    top-level figures of the runs' shape come from the ssh route, else from the push run."""
    out: dict[str, Any] = {}
    left = 0
    stages: dict[str, Callable[[Cluster, str, Path, list[str]], dict[str, Any]]] = {
        "ssh": functools.partial(ssh_route, digests=push, engine=engine), "plan": plan_checks,
        "slurm": slurm_route, "kill": kill_and_resume, **({"push": functools.partial(push_route, engine=engine)} if push else {})}
    for stage, fn in stages.items():
        if stage in skip:
            continue
        t0 = time.time()
        try:
            r = fn(c, stamp, logs, extra)
        except Exception as e:  # one failed stage is reported; the others still run
            r = {f"check_{stage}_stage": {"ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]},
                 "procs_left": leftovers(c)}
        stage_left = r.pop("procs_left")
        left += sum(len(v) for v in stage_left.values())
        if stage_left:
            r[f"{stage}_left_behind"] = stage_left
        r[f"{stage}_stage_s"] = round(time.time() - t0, 1)
        for transport in ("disk", "distributed"):
            if f"weight_sync_{transport}" in r:
                out.setdefault("weight_sync", {})[transport] = r.pop(f"weight_sync_{transport}")
        for key in SHAPE_KEYS:
            if key in out:
                r.pop(key, None)
        out.update(r)
    out["procs_left_after_runs"] = left
    out["ok_checks"] = all(v.get("ok") for k, v in out.items() if k.startswith("check_"))
    return out
