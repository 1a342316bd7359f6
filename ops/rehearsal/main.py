"""``ops/rehearse.sh``: the multi-host path rehearsed on one machine; prints one JSON line of figures.

    ops/rehearse.sh [--hosts 4] [--keep-logs DIR] [--skip slurm,kill,...] [--link RATE[,DELAY]] [--push]
                    [--engine rollout_server|sglang]

Stages (docs/MULTIHOST.md, "Rehearsing the multi-host path on one machine", describes each): cluster up (hosts h0..h3), the
base model and CurveZMQ keys (before the timed part), the ssh route (``ops/launch.sh`` on h0: buffer and
learner rank 0 there, a ZeRO-3 learner over h0+h1 via DeepSpeed's hostfile and pdsh, engines + actors on
h2 and h3 over ssh) with a process-group timeout of a few seconds and a longer rank-0 wait, then engine
host h3 killed and brought back in the same run (``rehearsal.elastic``: the run goes on without it, its
actor delivers again), the plan-time checks (a missing key file, no pdsh), the Slurm route (``sbatch
ops/slurm/vapo.sbatch``), a learner host killed during a run then ``--resume``, the same under
``run.max_resumes=1`` (the launcher waits for the host and resumes by itself), and cluster down. Every process of every host is counted at the end.
``--link`` shapes every host's link with tc before the stages; ``--push`` adds a run with the distributed
weight push and both transports' figures (``weight_sync`` in the JSON line; ``rehearsal.push``).
``--engine sglang`` runs every stage on live SGLang engines (``ops/setup.sh --sglang``) instead of
rollout_server, and always the push run (``rehearsal.sglang``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.config import load_config
from ops.launch_engines import missing_modules
from ops.rehearsal import checks, sglang
from ops.rehearsal.cluster import ENGINE_TMP_PREFIX, Cluster, engine_tmps_left, missing_prerequisites
from ops.rehearsal.link import Link, parse_link
from ops.rehearsal.runs import CONFIG, ROOT

KEYS = "runs/_rehearsal/keys"
STAGES = ("ssh", "plan", "slurm", "kill")
ENGINES = ("rollout_server", "sglang")


def prepare(engine: str) -> None:
    """The base model (once), the rehearsal runs' CurveZMQ keys by the documented command and, for SGLang
    engines, their admin key; called with the machine's rehearsal lock held."""
    py = str(ROOT / ".venv/bin/python")
    # learner.sft --if-missing's own test, here: its start (torch) takes 10-20 s on 2 busy cores for nothing
    # when the base is there, as the shipped one is.
    if not (ROOT / load_config(ROOT / CONFIG).model.path / "config.json").is_file():
        subprocess.run([py, "-m", "learner.sft", CONFIG, "--if-missing"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([py, "-m", "buffer.keys", KEYS, "--force"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    if engine == "sglang":
        sglang.write_admin_key(ROOT)


def engine_missing(engine: str) -> str | None:
    """Why the engines cannot run here (None: they can): SGLang must be in the venv every host runs."""
    if engine != "sglang":
        return None
    missing = missing_modules(str(ROOT / ".venv/bin/python"))
    return f"--engine sglang: .venv has no {', '.join(missing)} (run ops/setup.sh --sglang)" if missing else None


def _stop(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ops/rehearse.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4, help="hosts (network namespaces) to make; at least 4")
    ap.add_argument("--keep-logs", default="", help="copy the daemons' and launchers' logs here (default runs/_rehearsal/logs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run of the rehearsal (repeatable)")
    ap.add_argument("--skip", default="", help=f"comma-separated stages to leave out: {','.join(STAGES)}")
    ap.add_argument("--link", default="", metavar="RATE[,DELAY]",
                    help="shape every host's link with tc, e.g. 1gbit or 1gbit,2ms (a delay needs the netem qdisc)")
    ap.add_argument("--push", action="store_true",
                    help="also a run with learner.weight_transport=distributed, and both transports' figures")
    ap.add_argument("--engine", choices=ENGINES, default="rollout_server",
                    help="the engines every run starts on h2 and h3; sglang implies --push")
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if args.hosts < 4 or skip - set(STAGES):
        ap.error("--hosts must be >= 4 and --skip names stages among " + ",".join(STAGES))
    try:
        link: Link | None = parse_link(args.link) if args.link else None
    except ValueError as e:
        ap.error(str(e))
    why = missing_prerequisites() or engine_missing(args.engine)
    if not why and link is not None and shutil.which("tc") is None:
        why = "missing Debian packages: iproute2 (tc, for --link)"
    if why:
        print(json.dumps({"ok": False, "skipped": why}), flush=True)
        return 3
    signal.signal(signal.SIGTERM, _stop)  # Ctrl-C and SIGTERM both tear the cluster down
    signal.signal(signal.SIGHUP, _stop)
    logs = Path(args.keep_logs or ROOT / "runs/_rehearsal/logs").resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    t0 = time.time()
    out: dict[str, Any] = {"ok": False, "hosts": args.hosts, "engine": args.engine}
    cluster = Cluster(args.hosts, keep=logs / f"daemons-{stamp}")
    tmps_before = set(Path(tempfile.gettempdir()).glob(ENGINE_TMP_PREFIX + "*"))
    try:
        cluster.up()
        out["cluster_up_s"] = round(time.time() - t0, 1)
        # Only once the machine's rehearsal lock is ours: a second rehearsal started by mistake would
        # otherwise rewrite the keys of the one running, whose next runs could no longer reach its buffer.
        prepare(args.engine)
        if link is not None:
            out["link"] = {"spec": link.describe(), "qdiscs": cluster.shape(link)}
        extra = [*sglang.overrides(args.engine), *args.set]  # --set last: it overrides the engine's
        out.update(checks.run_all(cluster, stamp, logs, skip, extra, push=args.push or args.engine == "sglang",
                                  engine=args.engine))
        if "weight_sync" in out:
            out["weight_sync"]["link"] = link.describe() if link is not None else "unshaped"
    except KeyboardInterrupt:
        out["interrupted"] = True
    except Exception as e:  # reported in the JSON line, after the teardown below
        out["error"] = f"{type(e).__name__}: {e}"[-2000:]
    finally:
        owned = cluster.owned  # False when another rehearsal holds the machine: its namespaces are not ours
        left = cluster.down()
        out["procs_left_at_teardown"] = sum(left.values())
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        out["namespaces_left"] = sum(1 for h in cluster.hosts if owned and cluster.ns(h) in namespaces.split())
        # An engine's private TMPDIR (SGLang's ipc socket files) stays only when its guard is killed outright (a
        # host the rehearsal kills: kill_host removes those). Counted, then removed: they are this rehearsal's.
        out["engine_tmps_left"] = engine_tmps_left(tmps_before)
        for d in out["engine_tmps_left"]:
            shutil.rmtree(d, ignore_errors=True)
        out["seconds"] = round(time.time() - t0, 1)
    out["ok"] = bool(out.get("ok_checks")) and not out.get("interrupted") and out["namespaces_left"] == 0 \
        and out.get("procs_left_after_runs", 1) == 0 and not out["engine_tmps_left"]
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
