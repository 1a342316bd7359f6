"""Process placement: which host and which GPUs run the buffer, each learner rank, each engine and actor.

    plan = build_plan(cfg, "runs/x/config.yaml")      # pure: reads the config (and model config.json)
    print(plan.render())                               # what `ops/launch.sh CONFIG --dry-run` prints

The launcher (``ops/launch.py``) starts exactly the processes of the plan; nothing else decides placement.

CPU (``run.device=cpu``) on one host: everything there; the learner is one ``python -m learner`` process
and each actor supervises its own CPU engine. CPU across several hosts: the CUDA plan with slots for GPUs
(``gpus_per_host`` slots per host; a slot only chooses the host, no device is assigned). CUDA: ``placement.engine_gpus`` and ``placement.learner_gpus``
name global GPU indices (GPU ``g`` is local GPU ``g % gpus_per_host`` of host ``g // gpus_per_host``).
Engine ``i`` takes the next ``engine.sglang_tp_size`` engine GPUs (one for ``rollout_server`` engines) and
its actor runs on the same host, talking to it over loopback. The learner is started through DeepSpeed's
launcher, one rank per learner GPU: ``--include`` on one host, ``--hostfile`` plus pdsh (``placement.remote
= ssh``) or srun (``slurm``) across hosts. Engines and learner never share a GPU unless
``placement.share_gpus`` says so (the one-GPU config). Processes on other hosts start through ssh or srun
from host 0; such a run needs routable, CurveZMQ-protected buffer and weight addresses and a run directory
on a filesystem every host sees (weights travel as files).

Weight push (``learner.weight_transport=distributed``): the addresses learner rank 0 binds on host 0 are
checked against host 0's (``common.push_addresses``), so a placeholder is refused now, not after value
pretraining.

Memory check (``common.gpu_memory``): from the model's ``config.json`` the plan estimates each learner rank's model states
(weights, gradients, Adam; divided by ZeRO stage) for policy and critic, and each engine GPU's weights, and
refuses a placement that cannot hold them (``placement.gpu_memory_gib``,
``placement.learner_memory_fraction``, ``engine.sglang_mem_fraction_static``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import balance, remote
from common.config import Config, ConfigError
from common.gpu_memory import check_memory, count_parameters, read_model_config
from common.gpu_spec import engine_tp, parse_gpus
from common.push_addresses import check_push_addresses
from common.security import is_local_endpoint
from common.sglang_args import sglang_command

STORE_FILE_ENV = "VAPO_STORE_FILE"  # learner.dist reads it: one-host ranks rendezvous in this file
# Written by learner rank 0 into the run dir when its steps are done. The launcher trusts it, not the exit code:
# DeepSpeed's multi-node runner exits 0 when its pdsh dies of a signal, so a run killed part-way looked finished.
LEARNER_DONE_FILE = "learner_done.json"


@dataclass(frozen=True)
class Proc:
    """One process the launcher starts (on ``host``; ``argv`` already wrapped in ssh/srun when remote)."""

    name: str
    role: str  # buffer | learner | engine | actor
    host: str
    argv: list[str]
    env: dict[str, str]
    gpus: tuple[int, ...] = ()  # global GPU indices
    max_restarts: int = 0
    via: str = ""  # how it reaches its host: "" (host 0) | ssh | srun; the learner: pdsh | srun across hosts
    stop_signal: int = signal.SIGTERM  # how to ask it to stop where no ssh link is closed instead


@dataclass(frozen=True)
class Rank:
    """One learner rank: where DeepSpeed's launcher will put it."""

    rank: int
    host: str
    local_gpu: int
    gpu: int


@dataclass
class Plan:
    device: str
    procs: list[Proc]
    ranks: list[Rank]
    memory: dict[str, Any] = field(default_factory=dict)
    balance: dict[str, Any] = field(default_factory=dict)  # common.balance.estimate: time per step of each side
    files: dict[str, str] = field(default_factory=dict)  # run-dir relative name -> content the launcher writes
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what a launch would refuse, shown by a dry run instead

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def render(self) -> str:
        """The human-readable plan (``--dry-run``)."""
        lines = [f"process plan ({self.device}; {len(self.procs)} processes, {len(self.ranks)} learner rank(s))"]
        for p in self.procs:
            gpus = ",".join(str(g) for g in p.gpus) if p.gpus else "-"
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.env.items()))
            lines.append(f"  {p.name:<10} host={p.host}  gpus={gpus}  restarts={p.max_restarts}")
            lines.append(f"             env: {env or '-'}")
            lines.append(f"             cmd: {shlex.join(p.argv)}")
        for r in self.ranks:
            unit = "slot" if self.device == "cpu" else "GPU"
            where = f"local {unit} {r.local_gpu} (global {r.gpu})" if r.gpu >= 0 else "CPU"
            lines.append(f"  learner rank {r.rank}: host={r.host} {where}")
        for name, text in self.files.items():
            lines.append(f"  file <run dir>/{name}:")
            lines += [f"    {ln}" for ln in text.splitlines()]
        if self.memory:
            lines.append("  memory: " + json.dumps(self.memory, sort_keys=True))
        if self.balance:
            lines += [f"  {ln}" for ln in balance.describe(self.balance)]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- plan


@dataclass
class _Build:
    """What the parts of one plan share while it is built."""

    cfg: Config
    py: str
    root: Path
    run_dir: Path
    cfgf: str
    environ: Mapping[str, str]
    base_env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def cpu(self) -> bool:
        return self.cfg.run.device == "cpu"

    def host_of(self, g: int) -> str:
        return self.cfg.placement.hosts[g // self.cfg.placement.gpus_per_host]

    def local(self, g: int) -> int:
        return g % self.cfg.placement.gpus_per_host

    def proc(self, name: str, role: str, host: str, argv: list[str], env: dict[str, str],
             gpus: tuple[int, ...], restarts: int) -> Proc:
        """A process of the plan; on a host other than host 0 wrapped in ssh or srun, carrying ``env`` and the
        launcher's socket-interface variables (``common.remote.FORWARD_PREFIXES``); an engine there with a
        temporary directory of its own (on host 0 the launcher gives it one: ``Launcher.child``)."""
        if host == self.cfg.placement.hosts[0]:
            return Proc(name, role, host, argv, env, gpus, restarts)
        env = {**remote.forwarded_env(self.environ), **env}
        argv = remote.wrap_remote(self.cfg, host, argv, env, self.root, self.py, self.environ,
                                  private_tmp=f"vapo-{name}-" if role == "engine" else "")
        via = self.cfg.placement.remote
        return Proc(name, role, host, argv, {}, gpus, restarts, via=via,
                    stop_signal=remote.SRUN_STOP if via == "srun" else signal.SIGTERM)


def build_plan(cfg: Config, cfg_file: str | Path, python: str | None = None, root: Path | None = None,
               run_dir: Path | None = None, hf_config: dict[str, Any] | None = None,
               environ: Mapping[str, str] | None = None, dry_run: bool = False) -> Plan:
    """The processes of a run, validated. ``hf_config`` overrides reading ``model.path/config.json``;
    ``environ`` (default: this process's) gives PATH, ``VAPO_SSH_ARGS`` and the variables forwarded to
    other hosts. ``dry_run``: a missing launcher program (pdsh) goes into ``problems`` instead of refusing,
    so that the plan and its estimates can be read on a machine that will not launch it."""
    py = python or sys.executable
    pl = cfg.placement
    if pl.min_engines > cfg.actors.num_actors:
        # The run could never have that many: it would stop after the grace instead of refusing now.
        raise ConfigError(f"placement.min_engines={pl.min_engines}: the run has only actors.num_actors="
                          f"{cfg.actors.num_actors} engines (each with its actor)")
    if cfg.run.device == "cpu" and len(pl.hosts) == 1:
        check_push_addresses(cfg, remote_engines=False)
        return _cpu_plan(cfg, str(cfg_file), py, {"PYTHONUNBUFFERED": "1"})
    # Every process names its accelerator: an inherited DS_ACCELERATOR=cpu would build a CUDA learner on
    # DeepSpeed's CPU accelerator (and the reverse on CPU hosts).
    b = _Build(cfg, py, root or Path(__file__).resolve().parents[1], run_dir or cfg.run_dir, str(cfg_file),
               os.environ if environ is None else environ, {"PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": cfg.run.device},
               dry_run=dry_run)
    eg, lg = _device_lists(cfg)
    lg = sorted(lg, key=lambda g: (g // pl.gpus_per_host, g))  # DeepSpeed numbers ranks host-major
    ranks = _ranks(b, lg)
    b.procs.append(Proc("buffer", "buffer", pl.hosts[0], [py, "-m", "buffer", b.cfgf], dict(b.base_env), (), 3))
    b.procs.append(_learner(b, ranks))
    _engines_and_actors(b, eg)
    check_push_addresses(cfg, remote_engines=any(p.host != pl.hosts[0] for p in b.procs if p.role in ("engine", "actor")))
    _check_eval_engine(b)
    plan = Plan(cfg.run.device, b.procs, ranks, files=b.files, notes=b.notes, problems=b.problems)
    if b.cpu:
        b.notes.append("run.device=cpu: placement.*_gpus name slots (no device is assigned); GPU memory not checked")
    else:
        _size(plan, cfg, eg, lg, hf_config if hf_config is not None else read_model_config(cfg.model.path))
    return plan


def _ranks(b: _Build, lg: list[int]) -> list[Rank]:
    """One learner rank per learner GPU (slot), in DeepSpeed's order; rank 0 on host 0."""
    ranks = [Rank(r, b.host_of(g), b.local(g), g) for r, g in enumerate(lg)]
    if ranks[0].host != b.cfg.placement.hosts[0]:
        raise ConfigError(f"placement.learner_gpus: learner rank 0 must run on host 0 ({b.cfg.placement.hosts[0]}): it "
                          "talks to the buffer and publishes the weights there")
    return ranks


def _check_eval_engine(b: _Build) -> None:
    """Held-out evaluation on engine 0 (no evaluation URL given) needs engine 0 on host 0, beside rank 0."""
    cfg, pl = b.cfg, b.cfg.placement
    if (cfg.learner.eval_every > 0 and not cfg.learner.eval_engine_url and not cfg.learner.eval_engine_urls
            and cfg.engine.kind != "external"):
        engine0 = next((p for p in b.procs if p.name in ("engine-0", "actor-0")), None)
        if engine0 is not None and engine0.host != pl.hosts[0]:
            raise ConfigError(f"learner.eval_engine_url: held-out evaluation runs on a rollout engine, and engine 0 is on "
                              f"{engine0.host}, not on host 0 where learner rank 0 runs: give the URL of an engine that "
                              "host 0 can reach, or learner.eval_every=0")


def _size(plan: Plan, cfg: Config, eg: list[int], lg: list[int], hf: dict[str, Any] | None) -> None:
    """The plan's GPU memory check (``common.gpu_memory``) and, when the model's shape was readable, the
    balance of engine and learner GPUs (``common.balance``)."""
    plan.memory = check_memory(cfg, plan.notes, eg, lg, hf)
    if hf is not None and plan.memory:
        engine_gpus = len(eg) if cfg.engine.kind != "external" else 0
        plan.balance = balance.estimate(cfg, engine_gpus, len(lg), count_parameters(hf), hf)


def _device_lists(cfg: Config) -> tuple[list[int], list[int]]:
    """Engine and learner GPUs (CPU: slots), checked against the hosts and each other."""
    pl = cfg.placement
    unit, where = ("slot", " with several placement.hosts") if cfg.run.device == "cpu" else ("GPU", "")
    engines_needed = cfg.engine.kind != "external"
    eg = parse_gpus(pl.engine_gpus, "placement.engine_gpus")
    lg = parse_gpus(pl.learner_gpus, "placement.learner_gpus")
    if not lg:
        raise ConfigError(f"placement.learner_gpus: run.device={cfg.run.device}{where} needs the learner's {unit}s, e.g. "
                          "placement.learner_gpus=0 (see ops/configs/gpu-small.yaml, gpu-node8.yaml)")
    if engines_needed and not eg:
        raise ConfigError(f"placement.engine_gpus: run.device={cfg.run.device}{where} needs the engines' {unit}s, "
                          "e.g. placement.engine_gpus=0")
    _check_device_lists(cfg, eg, lg, unit)
    return eg, lg


def _check_device_lists(cfg: Config, eg: list[int], lg: list[int], unit: str) -> None:
    """Every GPU (slot) exists, none is both an engine's and the learner's unless shared on purpose, and the
    engines get exactly their tensor-parallel share each."""
    pl = cfg.placement
    n_gpus = len(pl.hosts) * pl.gpus_per_host
    for key, gs in (("placement.engine_gpus", eg), ("placement.learner_gpus", lg)):
        bad = [g for g in gs if g >= n_gpus]
        if bad:
            raise ConfigError(f"{key}: {unit} {bad[0]} does not exist: {len(pl.hosts)} host(s) x "
                              f"placement.gpus_per_host={pl.gpus_per_host} = {n_gpus} {unit}s (0-{n_gpus - 1})")
    shared = sorted(set(eg) & set(lg))
    if shared and not pl.share_gpus:
        raise ConfigError(f"placement.engine_gpus/learner_gpus: {unit}(s) {shared} are given to both engines and the "
                          "learner; set placement.share_gpus=true to allow it (and size engine.sglang_mem_fraction_static)")
    tp = engine_tp(cfg)
    if cfg.engine.kind != "external" and len(eg) != cfg.actors.num_actors * tp:
        raise ConfigError(f"placement.engine_gpus: {len(eg)} {unit}(s) for actors.num_actors={cfg.actors.num_actors} "
                          f"engines x {tp} {unit}(s) each (engine.sglang_tp_size) = {cfg.actors.num_actors * tp}; make them match")


def _learner(b: _Build, ranks: list[Rank]) -> Proc:
    """The learner: DeepSpeed's launcher with one rank per learner GPU (slot); across hosts pdsh or srun."""
    cfg, pl = b.cfg, b.cfg.placement
    learner_hosts = list(dict.fromkeys(r.host for r in ranks))
    ds_env = {"DS_ACCELERATOR": cfg.run.device, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if b.cpu and len(learner_hosts) > 1:
        # DeepSpeed's shared-memory all-reduce joins the ranks of one host only; across hosts it is plain gloo
        # (and no ~80 s JIT build of the op on every host).
        ds_env["VAPO_DS_SHM"] = "0"
    env = {**b.base_env, **ds_env}
    gpus = tuple(r.gpu for r in ranks)
    if len(learner_hosts) > 1:
        return _learner_across_hosts(b, ranks, learner_hosts, ds_env)
    if b.cpu and len(ranks) == 1:  # one CPU rank: no launcher, as in a one-host CPU run
        return Proc("learner", "learner", pl.hosts[0], [b.py, "-m", "learner", b.cfgf], env, gpus, 0)
    ds = [b.py, "-m", "deepspeed.launcher.runner", "--master_port", str(pl.master_port), "--no_local_rank"]
    if b.cpu:
        # DeepSpeed's CPU accelerator counts one device per NUMA node, so the slots come from a hostfile
        # (one host: no ssh involved, hence no ssh check).
        b.files["hostfile"] = f"localhost slots={pl.gpus_per_host}\n"
        ds += ["--hostfile", str((b.run_dir / "hostfile").resolve()), "--no_ssh_check"]
    ds += ["--include", "localhost:" + ",".join(str(r.local_gpu) for r in ranks), "--master_addr", "127.0.0.1"]
    # One host: the ranks rendezvous in a file (the launcher removes a stale one), so no port is opened.
    env[STORE_FILE_ENV] = str((b.run_dir / "torch_store").resolve())
    return Proc("learner", "learner", pl.hosts[0], [*ds, "--module", "learner", b.cfgf], env, gpus, 0)


def _learner_across_hosts(b: _Build, ranks: list[Rank], hosts: list[str], ds_env: dict[str, str]) -> Proc:
    """ssh: DeepSpeed's launcher, ``--hostfile`` + pdsh. srun: one step of all ranks (DeepSpeed's Slurm runner
    sets no RANK/WORLD_SIZE/MASTER_ADDR and drops ``--module``): each rank derives its rank from Slurm's
    SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and meets rank 0 at MASTER_ADDR:MASTER_PORT."""
    pl = b.cfg.placement
    if not pl.store_protection:
        raise ConfigError(f"placement.store_protection: the learner spans {len(hosts)} hosts, so its "
                          f"torch.distributed store listens on {pl.hosts[0]}:{pl.master_port} on every interface, "
                          "without authentication; say how that port is protected (firewall | private_network)")
    master = pl.master_addr or pl.hosts[0]
    b.notes.append(f"learner spans {len(hosts)} hosts: the torch.distributed store listens on "
                   f"{master}:{pl.master_port}; keep that port inside the cluster network")
    ds_env = {**ds_env, **remote.forwarded_env(b.environ)}
    per_host = {h: sorted(r.local_gpu for r in ranks if r.host == h) for h in hosts}
    if pl.remote == "srun":
        return _learner_srun(b, ranks, per_host, ds_env, master)
    return _learner_pdsh(b, ranks, per_host, ds_env, master)


def _learner_srun(b: _Build, ranks: list[Rank], per_host: dict[str, list[int]], ds_env: dict[str, str],
                  master: str) -> Proc:
    """One srun step of all the learner's ranks, each host's first N GPUs (Slurm places tasks by count)."""
    cfg, pl, hosts = b.cfg, b.cfg.placement, list(per_host)
    if any(v != list(range(len(v))) for v in per_host.values()) or len({len(v) for v in per_host.values()}) > 1:
        raise ConfigError("placement.learner_gpus: under placement.remote=srun one srun step places the ranks by count "
                          f"(--ntasks-per-node), not by GPU id: give every learner host its first N GPUs (got {per_host})")
    n = len(per_host[hosts[0]])
    env = {**b.base_env, **ds_env, "MASTER_ADDR": master, "MASTER_PORT": str(pl.master_port)}
    cpus = remote.srun_cpus(cfg, b.environ)
    argv = ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(ranks)}", f"--ntasks-per-node={n}",
            f"--nodelist={','.join(hosts)}", "--distribution=block", "--overlap", "--kill-on-bad-exit=1",
            *([f"--cpus-per-task={max(cpus // n, 1)}"] if cpus else []), f"--chdir={b.root}",
            "env", *(f"{k}={v}" for k, v in sorted(env.items())), b.py, "-m", "learner", b.cfgf]
    b.notes.append("learner ranks follow Slurm's node order (task 0 on the first node of the step): list "
                   "placement.hosts in the allocation's order, as ops/slurm/vapo.sbatch does")
    return Proc("learner", "learner", pl.hosts[0], argv, {}, tuple(r.gpu for r in ranks), 0, via="srun")


def _learner_pdsh(b: _Build, ranks: list[Rank], per_host: dict[str, list[int]], ds_env: dict[str, str],
                  master: str) -> Proc:
    """DeepSpeed's launcher with ``--hostfile`` and pdsh, under a guard that ends it with the launcher."""
    cfg, pl, hosts = b.cfg, b.cfg.placement, list(per_host)
    if shutil.which("pdsh", path=b.environ.get("PATH")) is None:
        why = (f"placement.remote: the learner spans {len(hosts)} hosts and placement.remote=ssh starts its ranks with "
               "DeepSpeed's pdsh launcher, but pdsh is not on PATH: install it (Debian/Ubuntu: apt-get install pdsh) or "
               "use placement.remote=srun inside a Slurm allocation")
        if not b.dry_run:
            raise ConfigError(why)
        b.problems.append(why)
    include = "@".join(f"{h}:" + ",".join(str(g) for g in per_host[h]) for h in hosts)
    b.files["hostfile"] = "".join(f"{h} slots={pl.gpus_per_host}\n" for h in hosts)
    # DeepSpeed forwards only a few variables to other hosts; the rest travel in this file.
    b.files["deepspeed_env"] = "".join(f"{k}={v}\n" for k, v in sorted(ds_env.items()))
    env = {**b.base_env, **ds_env, "DS_ENV_FILE": str((b.run_dir / "deepspeed_env").resolve()),
           "PDSH_SSH_ARGS_APPEND": remote.pdsh_ssh_args(cfg, b.environ)}
    # --no_ssh_check: DeepSpeed's own check runs a bare `ssh HOST hostname`, without placement.ssh_args.
    ds = [b.py, "-m", "deepspeed.launcher.runner", "--master_port", str(pl.master_port), "--no_local_rank",
          "--hostfile", str((b.run_dir / "hostfile").resolve()), "--include", include, "--master_addr", master,
          "--launcher", "pdsh", "--no_ssh_check", "--module", "learner", b.cfgf]
    # The runner under a guard (stdin from the launcher, no heartbeat: it is local): when the launcher dies
    # the guard stops the runner's process group, so pdsh's ssh sessions close and the remote ranks get SIGHUP.
    guarded = [b.py, "-m", "common.remote", "--timeout", "0", "--", *ds]
    return Proc("learner", "learner", pl.hosts[0], guarded, env, tuple(r.gpu for r in ranks), 0, via="pdsh")


def _engines_and_actors(b: _Build, eg: list[int]) -> None:
    """Engine i on the next engine.sglang_tp_size engine GPUs (CPU: slots), its actor beside it."""
    cfg, pl = b.cfg, b.cfg.placement
    tp = engine_tp(cfg)
    remote_actor = False
    for i in range(cfg.actors.num_actors):
        gpus = eg[i * tp:(i + 1) * tp] if cfg.engine.kind != "external" else []
        hosts = {b.host_of(g) for g in gpus}
        if len(hosts) > 1:
            raise ConfigError(f"placement.engine_gpus: engine {i} would span hosts {sorted(hosts)}; an engine's "
                              f"{tp} tensor-parallel GPUs must be on one host")
        host = hosts.pop() if hosts else pl.hosts[0]
        visible = {"CUDA_VISIBLE_DEVICES": ",".join(str(b.local(g)) for g in gpus)} if gpus and not b.cpu else {}
        actor_env = dict(b.base_env)
        if cfg.engine.kind == "sglang":
            argv, env = sglang_command(cfg, i)
            b.procs.append(b.proc(f"engine-{i}", "engine", host, argv, {**b.base_env, **env, **visible}, tuple(gpus),
                                  cfg.engine.max_restarts))
        elif cfg.engine.kind == "rollout_server":
            actor_env.update(visible)  # the actor starts its engine, which inherits the devices
        remote_actor |= host != pl.hosts[0]
        b.procs.append(b.proc(f"actor-{i}", "actor", host, [b.py, "-m", "actors", b.cfgf, "--actor-id", str(i)],
                              actor_env, tuple(gpus) if cfg.engine.kind == "rollout_server" else (),
                              cfg.engine.max_restarts))
    if remote_actor:
        _check_remote_actors(b)


def _check_remote_actors(b: _Build) -> None:
    """Actors on other hosts: the addresses they connect to must be reachable from there, and the run
    directory shared."""
    cfg = b.cfg
    local_addrs = [k for k, a in (("buffer.ingest_addr", cfg.buffer.ingest_addr),
                                  ("learner.publish_addr", cfg.learner.publish_addr),
                                  ("learner.query_addr", cfg.learner.query_addr),
                                  *((("learner.push_addr", cfg.learner.push_addr),
                                     ("learner.push_master_address", f"tcp://{cfg.learner.push_master_address}:1"))
                                    if cfg.learner.weight_transport == "distributed" else ())) if is_local_endpoint(a)]
    if local_addrs:
        raise ConfigError(f"{', '.join(local_addrs)}: actors run on other hosts, so these must be addresses they can "
                          "reach (e.g. tcp://0.0.0.0:5555 with CurveZMQ keys in buffer.curve.*; python -m buffer.keys)")
    b.notes.append(f"actors on other hosts read weights from {b.run_dir}/weights: the run directory must be on a "
                   "filesystem every host mounts at the same path")


def _cpu_plan(cfg: Config, cfgf: str, py: str, base_env: dict[str, str]) -> Plan:
    pl = cfg.placement
    for key, spec in (("placement.engine_gpus", pl.engine_gpus), ("placement.learner_gpus", pl.learner_gpus)):
        if spec.strip():
            raise ConfigError(f"{key}: set to {spec!r} but run.device=cpu on one host (set run.device=cuda, name "
                              "several placement.hosts to place CPU slots across them, or clear it)")
    env = {**base_env, "DS_ACCELERATOR": "cpu"}
    host = pl.hosts[0]
    procs = [Proc("buffer", "buffer", host, [py, "-m", "buffer", cfgf], dict(env), (), 3),
             Proc("learner", "learner", host, [py, "-m", "learner", cfgf], dict(env), (), 0)]
    if cfg.engine.kind == "sglang":
        for i in range(cfg.actors.num_actors):
            argv, e = sglang_command(cfg, i)
            procs.append(Proc(f"engine-{i}", "engine", host, argv, {**env, **e}, (), cfg.engine.max_restarts))
    for i in range(cfg.actors.num_actors):
        procs.append(Proc(f"actor-{i}", "actor", host, [py, "-m", "actors", cfgf, "--actor-id", str(i)], dict(env), (),
                          cfg.engine.max_restarts))
    return Plan("cpu", procs, [Rank(0, host, -1, -1)])
