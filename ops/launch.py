"""Run a whole vapo pipeline: bootstrap → buffer → engines/actors → learner → summary and plots.

    ops/launch.sh [config.yaml] [key=value ...] [--resume] [--dry-run] [--no-actors]

(``ops/launch.sh`` runs ``ops/setup.sh`` and then this file with the project's venv.) With no arguments it
runs the embedded CPU default, ``ops/configs/default.yaml``. What runs where is the process plan of
``common.placement`` (``--dry-run`` prints it and starts nothing): on CPU one learner process and one actor
per engine; on GPUs the learner through DeepSpeed's launcher with one rank per ``placement.learner_gpus``
entry, each SGLang engine with its own ``CUDA_VISIBLE_DEVICES``, and processes on other hosts through ssh or
srun. Each local component is a child process in its own process group, logging to
``runs/<name>/logs/<component>.log``, that dies with the launcher (``common.lifeline``); the launcher waits
for each stage to be healthy before the next, prints one progress line per learner step, restarts a failed
actor or the buffer a bounded number of times (``vapo_launcher_component_restarts``), stops every child on
Ctrl-C or when the learner finishes, and exits non-zero naming the component that failed for good. At the
end it prints a summary table and writes PNG plots to ``runs/<name>/plots/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import lifeline  # noqa: E402
from common.config import Config, ConfigError, load_config, save_config  # noqa: E402
from common.metrics import Metrics  # noqa: E402
from common.placement import STORE_FILE_ENV, build_plan  # noqa: E402

PY = sys.executable
_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_GRACE_S = 6.0


@dataclass
class Child:
    """One supervised process (its own process group, so its engine children stop with it)."""

    name: str
    cmd: list[str]
    log_path: Path
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.cmd)}\n".encode())
        log.flush()
        # A parent that ran torch.distributed leaves rendezvous variables behind; a child learner would try
        # to reuse that (taken) MASTER_PORT. Each child sets up its own.
        env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}
        env.update(self.env)
        # lifeline: the child (and, transitively, its own children) dies with this launcher, even on SIGKILL.
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     **lifeline.popen_kwargs(env))
        log.close()
        self.started_at = time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])


class LaunchError(RuntimeError):
    def __init__(self, component: str, message: str) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component


def say(msg: str) -> None:
    print(f"[vapo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ health


def buffer_healthy(cfg: Config, timeout_s: float = 1.0) -> bool:
    """The buffer answers a StatsRequest on its learner socket."""
    import zmq

    from common import protocol

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        _apply_client_curve(sock, cfg)
        sock.connect(cfg.buffer.serve_addr)
        sock.send(protocol.encode(protocol.StatsRequest()))
        if sock.poll(int(timeout_s * 1000)):
            protocol.decode_as(sock.recv(), protocol.StatsReply)
            return True
        return False
    except Exception:
        return False
    finally:
        sock.close(0)


def _apply_client_curve(sock: Any, cfg: Config) -> None:
    from common.security import apply_client_curve, client_curve_keys

    apply_client_curve(sock, client_curve_keys(cfg.buffer.curve))


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback/config URLs
            return 200 <= r.status < 300
    except Exception:
        return False


def wait_until(what: str, ok: Any, child: Child | None, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    delay = 0.05
    while time.time() < deadline:
        if ok():
            return
        if child is not None and not child.alive():
            raise LaunchError(child.name, f"exited with code {child.returncode} while starting\n{child.tail()}")
        time.sleep(delay)  # polling a health condition with a deadline, not synchronising on time
        delay = min(delay * 1.5, 1.0)
    raise LaunchError(what, f"not healthy after {timeout_s:.0f} s" + (f"\n{child.tail()}" if child else ""))


# ----------------------------------------------------------------------------------------- progress


class Progress:
    """Follows <run dir>/metrics.jsonl and prints one line per learner step and per evaluation."""

    def __init__(self, path: Path, total_steps: int) -> None:
        self.path = path
        self.offset = 0
        self.total = total_steps
        self.t0 = time.time()
        self.records: list[dict[str, Any]] = []
        self.last_eval: float | None = None
        self.base_eval: float | None = None
        self.last_time: float | None = None

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1  # only whole lines; a line being written is read next time
        self.offset += cut
        new = []
        for line in data[:cut].splitlines():
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        for r in new:
            if r.get("kind") == "learner_step" and isinstance(r.get("time"), int | float):
                if self.last_time is not None and r["time"] > self.last_time:
                    r.setdefault("samples_per_second", r.get("samples", 0) / (r["time"] - self.last_time))
                self.last_time = r["time"]
            self.records.append(r)
            self._print(r)
        return new

    def _print(self, r: dict[str, Any]) -> None:
        kind = r.get("kind", "")
        ev = r if kind == "eval" else r.get("eval")
        if kind == "value_pretrain":
            say(f"value pretraining step {r.get('step', '?')}: explained variance (fresh groups) "
                f"{_fmt(r.get('explained_variance'))}  loss {_fmt(r.get('loss'), 4)}")
        elif kind == "learner_step":
            step = int(r.get("weight_version", r.get("step", 0)))
            elapsed = time.time() - self.t0
            eta = elapsed / max(step, 1) * max(self.total - step, 0)
            say(
                f"step {step}/{self.total}  reward {_fmt(r.get('reward_mean'))}"
                f"  ev {_fmt(r.get('value_explained_variance'))}  staleness {_fmt(r.get('staleness_mean'), 2)}"
                f"  samples/s {_fmt(r.get('samples_per_second'), 1)}  len {_fmt(r.get('response_length_mean'), 1)}"
                f"  ETA {int(eta // 60)}m{int(eta % 60):02d}s"
            )
        if isinstance(ev, dict):
            acc = ev.get("avg_at_k")
            if isinstance(acc, int | float):
                if self.base_eval is None:
                    self.base_eval = float(acc)
                self.last_eval = float(acc)
            say(f"eval  v{r.get('weight_version', r.get('version', '?'))}: held-out avg@k {_fmt(acc)}"
                f"  greedy {_fmt(ev.get('greedy_accuracy'))}  length {_fmt(ev.get('mean_response_length'), 1)}")


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, int | float):
        return f"{v:.{digits}f}"
    return "-"


# ------------------------------------------------------------------------------------------ launcher


def abs_run_dir(cfg: Config) -> Path:
    """The run directory (``run.root`` is relative to the repository unless absolute)."""
    return ROOT / cfg.run_dir if not Path(cfg.run.root).is_absolute() else cfg.run_dir


def resolve_run(cfg_path: str | None, overrides: list[str], resume: bool) -> tuple[Config, list[str]]:
    cfg = load_config(cfg_path, overrides)
    run_dir = abs_run_dir(cfg)
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        # Never delete a previous run: start this one under a new name.
        new_name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        say(f"{run_dir} exists; this run is '{new_name}' (use --resume to continue '{cfg.run.name}')")
        overrides = [*overrides, f"run.name={new_name}"]
        cfg = load_config(cfg_path, overrides)
    if resume and not run_dir.exists():
        raise LaunchError("launcher", f"--resume: no run at {run_dir}")
    return cfg, overrides


def write_prometheus_config(cfg: Config, path: Path) -> None:
    host = cfg.metrics.host
    targets = {
        "buffer": [f"{host}:{cfg.buffer.metrics_port}"],
        "learner": [f"{host}:{cfg.learner.metrics_port}"],
        "actors": [f"{host}:{cfg.actors.metrics_base_port + i}" for i in range(cfg.actors.num_actors)],
        "launcher": [f"{host}:{cfg.metrics.launcher_port}"],
    }
    if cfg.engine.kind == "rollout_server":
        targets["engines"] = [f"{cfg.engine.host}:{cfg.engine.base_port + i}" for i in range(cfg.actors.num_actors)]
    lines = ["# Generated by ops/launch.py for this run; start with: prometheus --config.file=" + str(path),
             "global:", "  scrape_interval: 2s", "  evaluation_interval: 2s", "scrape_configs:"]
    for job, tgts in targets.items():
        lines += [f"  - job_name: vapo_{job}", "    static_configs:", f"      - targets: [{', '.join(repr(t) for t in tgts)}]",
                  f"        labels: {{run: {cfg.run.name!r}}}"]
    path.write_text("\n".join(lines) + "\n")


class Launcher:
    def __init__(self, cfg: Config, cfg_file: Path, resume: bool) -> None:
        self.cfg = cfg
        self.cfg_file = cfg_file
        self.resume = resume
        self.run_dir = cfg_file.parent
        self.logs = self.run_dir / "logs"
        self.children: dict[str, Child] = {}
        self.metrics = Metrics("launcher")
        self.stopping = False
        self.t0 = time.time()
        self.plan = build_plan(cfg, self.cfg_file, PY, ROOT, self.run_dir)
        for name, text in self.plan.files.items():  # hostfile / deepspeed_env for multi-host learners
            (self.run_dir / name).write_text(text)

    def child(self, name: str) -> Child:
        """The plan's process ``name`` as a supervised child (its environment and devices from the plan)."""
        p = self.plan.proc(name)
        c = Child(name, p.argv, self.logs / f"{name}.log", p.max_restarts, env=dict(p.env))
        self.children[name] = c
        return c

    def start(self, c: Child) -> None:
        c.start()
        self.metrics.components_up.labels(component=c.name).set(1)

    # --- stages
    def bootstrap(self) -> None:
        model = Path(self.cfg.model.path)
        model = model if model.is_absolute() else ROOT / model
        if (model / "config.json").exists():
            say(f"base model: {model}")
            return
        if self.cfg.engine.kind != "rollout_server" and self.cfg.task.name != "addition":
            raise LaunchError("bootstrap", f"model.path {model} does not exist (GPU configs need a local HF checkpoint)")
        say(f"base model missing: bootstrapping {model} with learner.sft (progress below)")
        rc = subprocess.call([PY, "-m", "learner.sft", str(self.cfg_file)], cwd=ROOT, **lifeline.popen_kwargs())
        if rc != 0:
            raise LaunchError("bootstrap", f"learner.sft exited with code {rc}")

    def start_buffer(self) -> None:
        c = self.child("buffer")
        self.start(c)
        wait_until("buffer", lambda: buffer_healthy(self.cfg), c, 60)
        say(f"buffer up ({self.cfg.buffer.ingest_addr}, {self.cfg.buffer.serve_addr})")

    def start_engines(self) -> None:
        """SGLang servers (rollout_server engines are started and supervised by their actor; external URLs
        are given). Engines on this host are waited for here; a remote one is waited for by its actor."""
        engines = [p for p in self.plan.procs if p.role == "engine"]
        for p in engines:
            self.start(self.child(p.name))
        here = self.cfg.placement.hosts[0]
        for i, p in enumerate(engines):
            if p.host == here:
                url = f"http://{self.cfg.engine.host}:{self.cfg.engine.base_port + i}"
                wait_until(p.name, lambda u=url: http_ok(u + "/health"), self.children[p.name],
                           self.cfg.engine.startup_timeout_s)
        if engines:
            say(f"{len(engines)} SGLang engine(s) started")

    def start_actors(self) -> None:
        actors = [p for p in self.plan.procs if p.role == "actor"]
        for p in actors:
            self.start(self.child(p.name))
        say(f"{len(actors)} actor(s) started (logs in {self.logs})")

    def start_learner(self) -> None:
        store = self.plan.proc("learner").env.get(STORE_FILE_ENV)
        if store:  # a file store left by a killed run would make the new ranks rendezvous with ghosts
            Path(store).unlink(missing_ok=True)
        self.start(self.child("learner"))
        ranks = len(self.plan.ranks)
        say("learner started" + (f" ({ranks} DeepSpeed ranks)" if ranks > 1 else "")
            + (" (resume=auto)" if self.resume else ""))

    # --- supervision
    def supervise(self) -> None:
        progress = Progress(self.run_dir / "metrics.jsonl", self.cfg.learner.total_steps)
        self.progress = progress
        while True:
            progress.poll()
            learner = self.children["learner"]
            if not learner.alive():
                progress.poll()
                if learner.returncode == 0:
                    say("learner finished")
                    return
                raise LaunchError("learner", f"exited with code {learner.returncode}\n{learner.tail()}")
            for c in list(self.children.values()):
                if c.name == "learner" or c.alive():
                    continue
                if c.restarts >= c.max_restarts:
                    raise LaunchError(c.name, f"exited with code {c.returncode} and was restarted {c.restarts} times\n{c.tail()}")
                c.restarts += 1
                self.metrics.component_restarts.labels(component=c.name).inc()
                say(f"{c.name} exited with code {c.returncode}; restarting ({c.restarts}/{c.max_restarts})")
                self.start(c)
            if self.cfg.run.max_wall_seconds and time.time() - self.t0 > self.cfg.run.max_wall_seconds + 600:
                raise LaunchError("learner", "run.max_wall_seconds exceeded by more than 10 minutes")
            time.sleep(0.5)  # supervision tick

    def stop_all(self) -> None:
        self.stopping = True
        # Learner first (it stops consuming batches; it resumes from its last checkpoint), then actors/engines,
        # then the buffer.
        order = sorted(self.children.values(), key=lambda c: (c.name != "learner", c.name == "buffer"))
        for c in order:
            if c.alive():
                c.signal(signal.SIGTERM)
        # One deadline for all of them (not one per child), so that stopping is bounded however many
        # children are slow: SIGTERM grace, then SIGKILL every process group at once.
        deadline = time.time() + STOP_GRACE_S
        while any(c.alive() for c in order) and time.time() < deadline:
            time.sleep(0.05)  # poll interval while children shut down
        for c in order:
            c.signal(signal.SIGKILL)  # the survivor, and any grandchild left in its group (engines)
        reap_deadline = time.time() + 2.0
        for c in order:
            if c.proc is not None:
                try:
                    c.proc.wait(timeout=max(reap_deadline - time.time(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
            self.metrics.components_up.labels(component=c.name).set(0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ops/launch.sh",
        description="Run vapo end to end: bootstrap the base model if missing, start the buffer, engines, "
        "actors and learner (value pretraining, then async VAPO), stream progress, and finish with a "
        "summary table and plots in runs/<name>/. With no arguments: the embedded CPU default.",
        epilog="examples:\n  ops/launch.sh\n  ops/launch.sh ops/configs/smoke.yaml\n"
        "  ops/launch.sh ops/configs/default.yaml run.seed=1 buffer.max_staleness=2\n"
        "  ops/launch.sh --resume run.name=default\n"
        "  ops/launch.sh ops/configs/gpu-node8.yaml --dry-run   # the process plan (hosts, GPUs, commands); starts nothing\n"
        "  .venv/bin/python -m common.config --help   # every config key",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("config", nargs="?", help="YAML config (default: ops/configs/default.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. learner.total_steps=20")
    ap.add_argument("--resume", action="store_true", help="continue the run named by run.name from its newest checkpoint")
    ap.add_argument("--no-actors", action="store_true",
                    help="start only the buffer and learner here (actors run on other hosts: see README)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the process plan (host, command, environment, GPUs of every process, learner ranks, "
                    "memory estimate) and exit without starting or writing anything")
    # Flags may come anywhere (`CONFIG --resume key=val`): parse them intermixed with the positionals.
    args = ap.parse_intermixed_args(argv)
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)
        args.config = None
    if args.config is None:
        args.config = str(ROOT / "ops/configs/default.yaml")
    return args


def dry_run(args: argparse.Namespace) -> int:
    """Print the plan of this launch; starts nothing and writes nothing."""
    try:
        cfg = load_config(args.config, args.overrides)
        run_dir = abs_run_dir(cfg)
        plan = build_plan(cfg, run_dir / "config.yaml", PY, ROOT, run_dir)
    except ConfigError as e:
        print(f"ops/launch.sh: {e}", file=sys.stderr)
        return 2
    print(plan.render())
    return 0


def _stop(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def install_stop_handlers() -> None:
    """Make SIGINT, SIGTERM and SIGHUP stop the run in order.

    SIGINT is handled even when it arrived ignored: a non-interactive shell starts every ``cmd &`` with
    SIGINT ignored (and Python keeps an inherited SIG_IGN), so a launcher started from a script or CI job
    would shrug off ``kill -INT``. SIGHUP is left alone when it arrived ignored: that is ``nohup``, whose
    whole point is that closing the terminal does not stop the run.
    """
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _stop)  # a closed terminal or ssh session stops the run in order


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.chdir(ROOT)
    if args.dry_run:
        return dry_run(args)
    try:
        cfg, overrides = resolve_run(args.config, args.overrides, args.resume)
        build_plan(cfg, abs_run_dir(cfg) / "config.yaml", PY, ROOT)  # refuse a bad placement before anything is written
    except (ConfigError, LaunchError) as e:
        print(f"ops/launch.sh: {e}", file=sys.stderr)
        return 2
    cfg_file = save_config(cfg)
    write_prometheus_config(cfg, cfg.run_dir / "prometheus.yml")
    launcher = Launcher(cfg, cfg_file.resolve(), args.resume)

    install_stop_handlers()
    say(f"run '{cfg.run.name}' in {cfg.run_dir} (config {args.config}; resolved {cfg_file})")
    try:
        if cfg.metrics.prometheus:
            launcher.metrics.serve(cfg.metrics.launcher_port, cfg.metrics.host)
        launcher.bootstrap()
        launcher.start_buffer()
        launcher.start_learner()
        if not args.no_actors:
            launcher.start_engines()
            launcher.start_actors()
        launcher.supervise()
    except KeyboardInterrupt:
        say("interrupted: stopping every component")
        launcher.stop_all()
        return 130
    except LaunchError as e:
        say(f"FAILED — {e}")
        launcher.stop_all()
        return 1
    launcher.stop_all()
    import report  # ops/report.py

    report.finish(cfg, launcher.run_dir, time.time() - launcher.t0)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "ops"))
    sys.exit(main())
