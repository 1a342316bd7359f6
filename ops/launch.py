"""Run a whole vapo pipeline: bootstrap → buffer → engines/actors → learner → summary and plots.

    ops/launch.sh [config.yaml] [key=value ...] [--resume] [--auto-resume N] [--dry-run] [--no-actors]

(``ops/launch.sh`` runs ``ops/setup.sh`` and then this file with the project's venv.) With no arguments it
runs the embedded CPU default, ``ops/configs/default.yaml``. What runs where is the process plan of
``common.placement`` (``--dry-run`` prints it and starts nothing): on CPU one learner process and one actor
per engine (SGLang engines, ``engine.kind=sglang``, started here; their install is checked before anything
starts, ``launch_engines``); on GPUs the learner through DeepSpeed's launcher with one rank per
``placement.learner_gpus`` entry, each SGLang engine with its own ``CUDA_VISIBLE_DEVICES``, and processes on
other hosts through ssh or srun. Each local component is a child process in its own process group, logging to
``runs/<name>/logs/<component>.log``, that dies with the launcher (``common.lifeline``); the launcher waits
for each stage to be healthy before the next, prints one progress line per learner step, restarts a failed
actor or the buffer a bounded number of times (``vapo_launcher_component_restarts``), gives up an engine or
actor past that and waits for a lost engine host to return while ``placement.min_engines`` hold
(``launch_supervise``, ``launch_elastic``), stops every child on Ctrl-C or when the learner finishes, and
exits non-zero naming the component that failed for good, unless ``--auto-resume N`` (``run.max_resumes``)
resumes a lost learner, buffer or host by itself (``launch_resume``). At the
end it prints a summary table and writes PNG plots to ``runs/<name>/plots/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from actors.sglang_launcher import write_admin_key_config
from buffer.client import BatchClient
from common import lifeline, provenance
from common.config import Config, ConfigError, load_config, save_config
from common.metrics import Metrics
from common.placement import LEARNER_DONE_FILE, STORE_FILE_ENV, build_plan
from common.preflight import missing_files
from common.security import apply_client_curve, client_curve_keys, generate_run_keys, url_host
from common.sglang_args import private_tmp_env
from ops import report
from ops.launch_checks import launch_problems
from ops.launch_child import Child, LaunchError
from ops.launch_engines import engine_targets, engine_tmp_dir, write_prometheus_config  # noqa: F401
from ops.launch_progress import say
from ops.launch_resume import RESUME, AutoResume, run_once
from ops.launch_supervise import Supervision

if TYPE_CHECKING:
    from common.security import ClientKeys

ROOT = Path(__file__).resolve().parents[1]

PY = sys.executable
STOP_GRACE_S = 6.0


# ------------------------------------------------------------------------------------------ health


class ProbeError(RuntimeError):
    """A health probe that cannot succeed however long it waits (its keys, a wrong server): said at once."""


def buffer_healthy(cfg: Config, timeout_s: float = 1.0) -> bool:
    """The buffer answers a StatsRequest on its learner socket (False: no answer yet; ProbeError: the probe
    cannot work, e.g. a client key file that does not exist)."""

    addr = cfg.buffer.serve_addr
    try:
        client = BatchClient(addr, curve=_probe_keys(cfg), request_timeout_s=timeout_s, ctx=zmq.Context.instance())
    except Exception as e:
        raise ProbeError(f"the health probe cannot reach buffer.serve_addr={addr}: {e}") from None
    try:
        client.stats(retries=0)  # one try per probe: the launcher's own loop is the retry
        return True
    except (TimeoutError, zmq.ZMQError):  # no answer yet, or the socket failed mid-request: probe again
        return False
    except Exception as e:
        raise ProbeError(f"buffer.serve_addr={addr} answered, but not as a vapo buffer: {e}") from None
    finally:
        client.close()


def _probe_keys(cfg: Config) -> ClientKeys | None:
    """The health probe's CURVE client keys (the ``monitor`` role; None without CURVE)."""
    return client_curve_keys(cfg.buffer.curve, "monitor")


def _apply_client_curve(sock: Any, cfg: Config) -> None:
    """The probe's keys on a socket of one's own (how a test checks which keys the probe presents)."""
    apply_client_curve(sock, _probe_keys(cfg))


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # loopback/config URLs
            return 200 <= r.status < 300
    except Exception:
        return False


def wait_until(what: str, ok: Any, child: Child | None, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    delay = 0.05
    while time.time() < deadline:
        try:
            if ok():
                return
        except ProbeError as e:
            raise LaunchError(what, str(e) + (f"\n{child.tail()}" if child else "")) from None
        if child is not None and not child.alive():
            raise LaunchError(child.name, f"exited with code {child.returncode} while starting\n{child.tail()}")
        time.sleep(delay)  # polling a health condition with a deadline, not synchronising on time
        delay = min(delay * 1.5, 1.0)
    raise LaunchError(what, f"not healthy after {timeout_s:.0f} s" + (f"\n{child.tail()}" if child else ""))


# ------------------------------------------------------------------------------------------ launcher


def abs_run_dir(cfg: Config) -> Path:
    """The run directory (``run.root`` is relative to the repository unless absolute)."""
    return ROOT / cfg.run_dir if not Path(cfg.run.root).is_absolute() else cfg.run_dir


def resolve_run(cfg_path: str | None, overrides: list[str], resume: bool) -> tuple[Config, list[str]]:
    cfg = load_config(cfg_path, overrides)
    run_dir = abs_run_dir(cfg)
    # A multi-host run's buffer lives outside the run directory (buffer.local_root): a leftover one under this
    # run's name would be adopted as if resumed.
    buffer_dir = cfg.buffer_path if cfg.buffer_path.is_absolute() else ROOT / cfg.buffer_path
    used = [d for d in (run_dir, *([buffer_dir] if not cfg.buffer.path else [])) if d.exists() and any(d.iterdir())]
    if not resume and used:
        # Never delete a previous run: start this one under a new name.
        new_name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        say(f"{used[0]} exists; this run is '{new_name}' (use --resume to continue '{cfg.run.name}')")
        overrides = [*overrides, f"run.name={new_name}"]
        cfg = load_config(cfg_path, overrides)
    if resume and not run_dir.exists():
        raise LaunchError("launcher", f"--resume: no run at {run_dir}")
    return cfg, overrides


def ensure_run_keys(cfg: Config) -> Path | None:
    """Every ZeroMQ socket of the run authenticates its clients, loopback included: when ``buffer.curve`` names
    no key, write a key set to ``<run dir>/keys`` (0700, secrets 0600; kept on --resume) and point
    ``buffer.curve.keys_dir`` at it, so each process uses the key of its role. Each actor gets a pair of its
    own, ``actor-<i>``, which binds actor id i to that key at the buffer (``common.security``); the shared
    ``actor`` pair stays for actors started by hand. Returns the keys directory."""
    c = cfg.buffer.curve
    if c.server_secret_key or c.server_public_key or c.client_secret_key or c.authorized_clients_dir:
        return None  # keys of the operator's own making (e.g. on a shared filesystem): used as configured
    if not c.keys_dir:
        c.keys_dir = str(abs_run_dir(cfg) / "keys")
    return generate_run_keys(c.keys_dir, cfg.actors.num_actors)


class Launcher(Supervision):
    def __init__(self, cfg: Config, cfg_file: Path, resume: bool, metrics: Metrics | None = None,
                 t0: float | None = None) -> None:
        self.cfg = cfg
        self.cfg_file = cfg_file
        self.resume = resume
        self.run_dir = cfg_file.parent
        self.logs = self.run_dir / "logs"
        self.children: dict[str, Child] = {}
        self.private_tmps: list[Path] = []  # engines' TMPDIRs, removed when every child has stopped
        self.metrics = metrics or Metrics("launcher")  # one for every automatic resume of the launch
        self.stopping = False
        self.t0 = time.time() if t0 is None else t0
        self.plan = build_plan(cfg, self.cfg_file, PY, ROOT, self.run_dir)
        for name, text in self.plan.files.items():  # hostfile / deepspeed_env for multi-host learners
            (self.run_dir / name).write_text(text)
        self._beats = threading.Event()  # set: the heartbeat thread ends
        self.init_supervision()
        if any(p.via == "ssh" for p in self.plan.procs):
            threading.Thread(target=self._heartbeat, name="ssh-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """A byte down every ssh link each ssh_alive_interval_s: the remote guards' proof that we live. A
        thread, so a main loop blocked in a health wait does not starve them."""
        while not self._beats.wait(self.cfg.placement.ssh_alive_interval_s):
            for c in list(self.children.values()):
                if c.via == "ssh":
                    c.beat()

    def child(self, name: str) -> Child:
        """The plan's process ``name`` as a supervised child (its environment and devices from the plan)."""
        p = self.plan.proc(name)
        env = dict(p.env)
        if p.role == "engine" and not p.via:  # an SGLang server on this host: its temporary files kept apart
            tmp, note = engine_tmp_dir(self.run_dir, name)
            if note:
                say(note)
            self.private_tmps.append(tmp)
            env.update(private_tmp_env(tmp))
        c = Child(name, p.argv, self.logs / f"{name}.log", p.max_restarts, env=env, via=p.via, host=p.host,
                  stop_signal=p.stop_signal)
        self.children[name] = c
        return c

    def start(self, c: Child) -> None:
        c.start()
        self.metrics.components_up.labels(component=c.name).set(1)

    # --- stages
    def bootstrap(self) -> None:
        model = Path(self.cfg.model.path)
        model = model if model.is_absolute() else ROOT / model
        if (model / "config.json").exists() and not self.cfg.model.rebuild:
            # A shipped base (or one learner.sft built) is checked against its manifest.json: a changed
            # base would silently change every figure compared with the published ones.
            if problem := provenance.verify_base(model):
                raise LaunchError("bootstrap", f"{problem}. Restore it from git, or rebuild it on this machine "
                                  "with model.rebuild=true (results then differ from the published tables)")
            say(f"base model: {model}")
            return
        if self.cfg.engine.kind != "rollout_server" and self.cfg.task.name != "addition":
            raise LaunchError("bootstrap", f"model.path {model} does not exist (GPU configs need a local HF checkpoint)")
        why = "model.rebuild=true" if (model / "config.json").exists() else "base model missing"
        say(f"{why}: bootstrapping {model} with learner.sft (progress below)")
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
        if engines and self.cfg.engine.admin_api_key_file:
            write_admin_key_config(self.cfg.engine.admin_api_key_file)  # the --config file their argv names
        t0 = time.time()
        for p in engines:
            self.start(self.child(p.name))
        here = self.cfg.placement.hosts[0]
        probe_s = self.cfg.engine.health_timeout_s  # SGLang's /health generates a token: slow on a busy CPU
        for i, p in enumerate(engines):
            if p.host == here:
                url = f"http://{url_host(self.cfg.engine.host)}:{self.cfg.engine.base_port + i}"
                wait_until(p.name, lambda u=url: http_ok(u + "/health", probe_s), self.children[p.name],
                           self.cfg.engine.startup_timeout_s)
        if engines:
            say(f"{len(engines)} SGLang engine(s) started on {self.cfg.run.device} in {time.time() - t0:.0f} s "
                f"(logs {self.logs}/engine-*.log)")

    def start_actors(self) -> None:
        actors = [p for p in self.plan.procs if p.role == "actor"]
        for p in actors:
            self.start(self.child(p.name))
        say(f"{len(actors)} actor(s) started (logs in {self.logs})")

    def start_learner(self) -> None:
        store = self.plan.proc("learner").env.get(STORE_FILE_ENV)
        if store:  # a file store left by a killed run would make the new ranks rendezvous with ghosts
            Path(store).unlink(missing_ok=True)
        (self.run_dir / LEARNER_DONE_FILE).unlink(missing_ok=True)  # only this start's learner may write it
        learner = self.child("learner")
        # pdsh's reports are looked for in what this run appends (a resumed run's log has the old run's).
        self._pdsh_offset = learner.log_path.stat().st_size if learner.log_path.exists() else 0
        self.start(learner)
        ranks = len(self.plan.ranks)
        say("learner started" + (f" ({ranks} DeepSpeed ranks)" if ranks > 1 else "")
            + (" (resume=auto)" if self.resume else ""))

    def stop_all(self) -> None:
        self.stopping = True
        self._beats.set()
        self.cancel_probes()
        # Learner first (it stops consuming batches; it resumes from its last checkpoint), then actors/engines,
        # then the buffer. A process behind ssh is stopped by closing its link: its guard SIGTERMs it, and
        # ssh returns once it has exited; an srun'd one by SIGUSR1, which its guard turns into a SIGTERM.
        order = sorted(self.children.values(), key=lambda c: (c.name != "learner", c.name == "buffer"))
        for c in order:
            if c.alive():
                c.ask_to_stop()
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
        for d in self.private_tmps:  # after the stop: a live engine could still write there
            shutil.rmtree(d, ignore_errors=True)
        if self.private_tmps and (self.run_dir / "tmp").is_dir() and not any((self.run_dir / "tmp").iterdir()):
            (self.run_dir / "tmp").rmdir()


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
    ap.add_argument("--auto-resume", type=int, metavar="N", default=None,
                    help="after a stop --resume recovers from (a lost learner, buffer or host), wait for the host and "
                    "resume by itself, at most N times (sets run.max_resumes=N)")
    ap.add_argument("--no-actors", action="store_true",
                    help="start only the buffer and learner here (actors run on other hosts: see docs/MULTIHOST.md)")
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
    if args.auto_resume is not None:  # the flag is a spelling of the key, which the saved config keeps
        args.overrides.append(f"run.max_resumes={args.auto_resume}")
    return args


def dry_run(args: argparse.Namespace) -> int:
    """Print the plan of this launch and every problem a launch would refuse for; starts and writes nothing."""
    try:
        cfg = load_config(args.config, args.overrides)
        run_dir = abs_run_dir(cfg)
    except ConfigError as e:
        print(f"ops/launch.sh: {e}", file=sys.stderr)
        return 2
    try:
        plan = build_plan(cfg, run_dir / "config.yaml", PY, ROOT, run_dir, dry_run=True)
    except ConfigError as e:  # no plan to show; the files the config names are still checked
        print(f"ops/launch.sh: {e}", file=sys.stderr)
        for line in missing_files(cfg, ROOT):
            print(f"ops/launch.sh: missing {line}", file=sys.stderr)
        return 2
    print(plan.render())
    # SGLang's install is not a dry run's business: a plan is read on machines that will not run it.
    missing, skipped = launch_problems(cfg, plan, ROOT, sglang=False)
    if skipped:
        print(f"ops/launch.sh: {cfg.task.name}: {skipped}; these rows are skipped (task.bad_rows=skip)", file=sys.stderr)
    for line in missing:
        print(f"ops/launch.sh: missing {line}", file=sys.stderr)
    return 2 if missing else 0


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
        # A bad placement is refused before any write; then every other problem at once.
        plan = build_plan(cfg, abs_run_dir(cfg) / "config.yaml", PY, ROOT, dry_run=True)
        problems, skipped = launch_problems(cfg, plan, ROOT, sglang=not args.no_actors)
        if problems:  # one on its line; several under a heading, one a line
            raise ConfigError(problems[0] if len(problems) == 1 else "the run cannot start:\n  " + "\n  ".join(problems))
        if skipped:
            say(f"{cfg.task.name}: {skipped}; these rows are skipped (task.bad_rows=skip)")
    except (ConfigError, LaunchError) as e:
        print(f"ops/launch.sh: {e}", file=sys.stderr)
        return 2
    ensure_run_keys(cfg)
    cfg_file = save_config(cfg)
    launcher = Launcher(cfg, cfg_file.resolve(), args.resume)
    write_prometheus_config(cfg, cfg.run_dir / "prometheus.yml", launcher.plan)

    install_stop_handlers()
    say(f"run '{cfg.run.name}' in {cfg.run_dir} (config {args.config}; resolved {cfg_file})")
    auto = AutoResume(cfg, launcher.run_dir, launcher.metrics)
    if cfg.metrics.prometheus:
        launcher.metrics.serve(cfg.metrics.launcher_port, cfg.metrics.host)
    while (rc := run_once(launcher, auto, args.no_actors, ROOT)) == RESUME:
        old, launcher = launcher, Launcher(cfg, cfg_file.resolve(), True, launcher.metrics, launcher.t0)
        launcher.progress = old.progress  # the steps already printed are not printed again
    if rc:
        return rc
    launcher.stop_all()
    report.finish(cfg, launcher.run_dir, time.time() - launcher.t0, auto.summary() if auto.limit else None)
    return 0



if __name__ == "__main__":
    sys.exit(main())
