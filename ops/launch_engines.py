"""The launcher's side of the engines (``ops/launch.py``): the check that SGLang is installed where the plan
starts SGLang engines, before anything starts or is written, and every engine's Prometheus target.

SGLang engines (``engine.kind = sglang``, on GPUs or on CPU) are the launcher's children; ``rollout_server``
engines are their actors' children; external ones are given. Each SGLang engine started here keeps its
temporary files (ZeroMQ ipc sockets, the Prometheus multiprocess directory: ``common.sglang_args``) in
``<run dir>/tmp/vapo-engine-<i>/`` (``engine_tmp_dir``), which the launcher removes after the engines stop; a
killed launcher leaves them in the run directory, not in the machine's temporary directory, and the run's next
start ends the engine processes still running with that ``TMPDIR`` (``end_processes_in``) before it empties it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from common.config import Config
from common.security import is_loopback_host

# What an SGLang engine imports first: SGLang, and its kernels (on CPU vapo's pure-torch stand-in).
SGLANG_MODULES = ("sglang", "sgl_kernel")
_FIND = ("import importlib.util, sys\n"
         "missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]\n"
         "print(' '.join(missing))\n"
         "sys.exit(3 if missing else 0)\n")


# A Unix socket's path holds at most 107 bytes; SGLang names each one TMPDIR + "/tmp" + 8 random characters.
UNIX_SOCKET_PATH_MAX = 107
SGLANG_SOCKET_NAME_LEN = len("/tmpXXXXXXXX")


def engine_tmp_dir(run_dir: Path, name: str) -> tuple[Path, str]:
    """(the directory for engine ``name``'s temporary files, made empty; a note when it is not in the run
    directory). ``<run dir>/tmp/vapo-<name>``, unless that path is too long for SGLang's socket paths: then a
    directory of its own in the system's temporary directory, which the launcher removes all the same."""
    d = run_dir / "tmp" / f"vapo-{name}"  # the prefix every engine TMPDIR has (ops/rehearsal checks it)
    if len(str(d.resolve())) + SGLANG_SOCKET_NAME_LEN > UNIX_SOCKET_PATH_MAX:
        tmp = Path(tempfile.mkdtemp(prefix=f"vapo-{name}-"))
        return tmp, (f"{name}: temporary files in {tmp}: {d} is too long a directory for SGLang's socket paths "
                     f"({UNIX_SOCKET_PATH_MAX} bytes)")
    note = ""
    if ended := end_processes_in(d):
        note = (f"{name}: ended {len(ended)} process(es) left by this run's previous launcher, whose engine they "
                f"were part of (pids {', '.join(map(str, ended))}; TMPDIR {d})")
    shutil.rmtree(d, ignore_errors=True)  # a killed launcher's leftovers of the same run
    d.mkdir(parents=True)
    return d, note


def end_processes_in(tmp: Path) -> list[int]:
    """SIGKILL every live process whose ``TMPDIR`` is ``tmp`` (Linux; elsewhere none); returns their pids.

    An SGLang server's spawned scheduler and detokenizer set their parent-death signal only once their imports
    are done (~10 s): a launcher killed while an engine starts leaves them running, and on a GPU a scheduler
    goes on to load the model and hold its memory. Their ``TMPDIR``, this run's engine directory, names them
    as this run's; the next start of the run (``--resume``, an automatic resume) ends them."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    wanted = {f"TMPDIR={tmp}".encode(), f"TMPDIR={tmp.resolve()}".encode()}
    ended = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if wanted.intersection(env.split(b"\0")):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                ended.append(int(entry.name))
            except OSError:
                pass
    return sorted(ended)


def missing_modules(python: str, modules: tuple[str, ...] = SGLANG_MODULES) -> list[str]:
    """The ``modules`` that ``python`` cannot find (found without importing them: ``import sglang`` alone takes
    ~10 s here, and the engine's own start reports an import that fails)."""
    r = subprocess.run([python, "-c", _FIND, *modules], capture_output=True, text=True, timeout=120)
    if r.returncode not in (0, 3):
        return [f"{' '.join(modules)} (the check itself failed: {(r.stderr.strip().splitlines() or ['?'])[-1]})"]
    return r.stdout.split()


def sglang_install_problem(cfg: Config, plan: Any, modules: tuple[str, ...] | None = None) -> str | None:
    """One line naming the setup command when the plan starts SGLang engines on this host with a Python that
    lacks SGLang (None otherwise; ``modules`` default ``SGLANG_MODULES``, read at the call). Engines on other
    hosts are not checked here: their hosts' venvs are theirs."""
    modules = modules or SGLANG_MODULES
    here = cfg.placement.hosts[0]
    pythons = sorted({p.argv[0] for p in plan.procs if p.role == "engine" and p.host == here and p.via == ""})
    for python in pythons:
        missing = missing_modules(python, modules)
        if missing:
            fix = "ops/setup.sh --sglang" if cfg.run.device == "cpu" else "ops/setup.sh --cuda"
            return (f"engine.kind=sglang needs SGLang, but {python} has no {', '.join(missing)}: "
                    f"run {fix} (or use engine.kind=rollout_server)")
    return None


def engine_targets(cfg: Config, plan: Any = None) -> list[str]:
    """host:port of every engine's /metrics: rollout_server's, or SGLang's (``sglang:*``, which it serves
    with ``--enable-metrics`` on its HTTP port). An engine on another host is scraped by that host's name
    when it binds a non-loopback address; one bound to its own loopback cannot be scraped from host 0."""
    if cfg.engine.kind not in ("rollout_server", "sglang"):
        return []
    here = cfg.placement.hosts[0]
    hosts = {p.name: p.host for p in plan.procs} if plan is not None else {}
    out = []
    for i in range(cfg.actors.num_actors):
        host = hosts.get(f"engine-{i}", hosts.get(f"actor-{i}", here))
        if host == here:
            out.append(f"{cfg.engine.host}:{cfg.engine.base_port + i}")
        elif not is_loopback_host(cfg.engine.host):
            out.append(f"{host}:{cfg.engine.base_port + i}")
    return out


def write_prometheus_config(cfg: Config, path: Path, plan: Any = None) -> None:
    host = cfg.metrics.host
    targets = {
        "buffer": [f"{host}:{cfg.buffer.metrics_port}"],
        "learner": [f"{host}:{cfg.learner.metrics_port}"],
        "actors": [f"{host}:{cfg.actors.metrics_base_port + i}" for i in range(cfg.actors.num_actors)],
        "launcher": [f"{host}:{cfg.metrics.launcher_port}"],
    }
    engines = engine_targets(cfg, plan)
    if engines:
        targets["engines" if cfg.engine.kind == "rollout_server" else "sglang"] = engines
    lines = ["# Generated by ops/launch.py for this run; start with: prometheus --config.file=" + str(path),
             "global:", "  scrape_interval: 2s", "  evaluation_interval: 2s", "scrape_configs:"]
    for job, tgts in targets.items():
        lines += [f"  - job_name: vapo_{job}", "    static_configs:", f"      - targets: [{', '.join(repr(t) for t in tgts)}]",
                  f"        labels: {{run: {cfg.run.name!r}}}"]
    path.write_text("\n".join(lines) + "\n")
