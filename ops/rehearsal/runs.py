"""One rehearsal run of ``ops/launch.sh`` (or ``sbatch``) inside the cluster, and what it left behind.

``launch()`` starts the launcher in h0 (the head node), ``finish()`` waits for it with a deadline and
reads the run's metrics.jsonl; ``leftovers()`` counts, per host, the processes that are not the host's
daemons once the launcher has exited (a run must leave none).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.rehearsal.cluster import Cluster
from ops.report import read_records

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "ops/configs/rehearsal.yaml"


@dataclass
class Run:
    name: str
    proc: subprocess.Popen
    log: Path
    t0: float = field(default_factory=time.time)
    rc: int | None = None
    seconds: float = 0.0

    @property
    def dir(self) -> Path:
        return ROOT / "runs" / self.name

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_records(self.dir / "metrics.jsonl", kind)

    def steps(self) -> int:
        return max((int(r.get("weight_version", r.get("step", 0))) for r in self.records("learner_step")), default=0)

    def evals(self) -> list[float]:
        out = []
        for r in self.records():
            ev = r if r.get("kind") == "eval" else r.get("eval")
            if isinstance(ev, dict) and isinstance(ev.get("avg_at_k"), int | float):
                out.append(float(ev["avg_at_k"]))
        return out

    def buffer_path(self) -> Path:
        """The LMDB directory the run's buffer opened (its BUFFER READY line; the default is host-local)."""
        for line in reversed((self.dir / "logs" / "buffer.log").read_text(errors="replace").splitlines()):
            if line.startswith("BUFFER READY "):
                p = Path(json.loads(line[len("BUFFER READY "):])["path"])
                return p if p.is_absolute() else ROOT / p
        raise RuntimeError(f"{self.name}: the buffer never said where it is")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def launch(c: Cluster, name: str, overrides: list[str], logs: Path, resume: bool = False,
           argv: list[str] | None = None) -> Run:
    """``ops/launch.sh CONFIG run.name=NAME OVERRIDES`` on h0 (or ``argv`` there instead)."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}{'-resume' if resume else ''}.out"
    cmd = argv or ["ops/launch.sh", CONFIG, f"run.name={name}", *overrides, *(["--resume"] if resume else [])]
    f = open(log, "ab")  # the launcher's output for its lifetime
    p = c.popen("h0", cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    f.close()
    return Run(name, p, log)


def finish(run: Run, timeout_s: float) -> Run:
    try:
        run.rc = run.proc.wait(timeout=max(timeout_s - (time.time() - run.t0), 1))
    except subprocess.TimeoutExpired:
        run.proc.terminate()  # SIGTERM: the launcher stops its children in order
        try:
            run.rc = run.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.rc = run.proc.wait()
        run.rc = run.rc if run.rc else -1
    run.seconds = round(time.time() - run.t0, 1)
    return run


def leftovers(c: Cluster, timeout_s: float = 20.0) -> dict[str, list[str]]:
    """Per host, the command lines of processes other than its daemons, polled until there are none or
    ``timeout_s`` has passed (a stopping process may take a moment to exit once its launcher is gone)."""
    deadline = time.time() + timeout_s
    while True:
        left = {h: describe(c, h) for h in c.hosts}
        if not any(left.values()) or time.time() > deadline:
            return {h: v for h, v in left.items() if v}
        time.sleep(0.2)  # polling for the run's processes to exit, with a deadline


def describe(c: Cluster, host: str) -> list[str]:
    """The left-over processes of ``host`` (for the report when a run left some)."""
    out = []
    for p in c.run_pids(host):
        try:
            out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
        except OSError:
            pass
    return out
