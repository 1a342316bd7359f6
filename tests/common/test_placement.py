"""The process plan of the GPU configs (what `ops/launch.sh CONFIG --dry-run` prints), checked without GPUs.

Each failure class a GPU run would hit before its first step is a test here: a CUDA process told to use
DeepSpeed's CPU accelerator, two processes on one GPU, ranks or engines that do not add up to the GPUs
given, model states that cannot fit, a learner started without DeepSpeed's launcher.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.gpu_memory import GIB
from common.placement import build_plan, parse_gpus
from tests.common.placement_fixtures import QWEN_05B, QWEN_7B, QWEN_32B

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("pdsh_on_path")

GPU_CONFIGS = [("gpu-small.yaml", QWEN_05B), ("gpu-node8.yaml", QWEN_7B), ("paper.yaml", QWEN_32B)]


def test_parse_gpus() -> None:
    assert parse_gpus("0-3,8, 10-11", "k") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_gpus("", "k") == []
    for bad in ("3-1", "a", "0,0", "-1"):
        with pytest.raises(ConfigError, match="^k:"):
            parse_gpus(bad, "k")


def _plan(name: str, hf: dict, *overrides: str):
    cfg = load_config(ROOT / "ops" / "configs" / name, list(overrides))
    return cfg, build_plan(cfg, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=hf)


def _runner(p) -> list[str]:
    """The command inside the plan's local guard (``python -m common.remote ... -- CMD``), else the command."""
    argv = p.argv
    return argv[argv.index("--") + 1:] if argv[1:3] == ["-m", "common.remote"] else argv


def _env_of(p) -> dict[str, str]:
    """The environment a process really gets: the plan's, or the `env K=V` inside its ssh/srun command."""
    if p.env:
        return p.env
    words = shlex.split(p.argv[-1]) if p.argv[0] == "ssh" else p.argv
    i = words.index("env")
    out = {}
    for w in words[i + 1:]:
        if "=" not in w:
            break
        k, v = w.split("=", 1)
        out[k] = v
    return out


@pytest.mark.parametrize("name,hf", GPU_CONFIGS)
def test_gpu_config_plans_add_up(name: str, hf: dict) -> None:
    cfg, plan = _plan(name, hf)
    pl = cfg.placement
    n_gpus = len(pl.hosts) * pl.gpus_per_host
    # No CUDA process is told to use DeepSpeed's CPU accelerator; every one names CUDA.
    for p in plan.procs:
        assert _env_of(p).get("DS_ACCELERATOR") == "cuda", (p.name, p.env)
        assert "DS_ACCELERATOR=cpu" not in " ".join(p.argv)
    # The learner is DeepSpeed's launcher with one rank per learner GPU.
    learner = plan.proc("learner")
    assert _runner(learner)[1:3] == ["-m", "deepspeed.launcher.runner"] and "--module" in learner.argv
    assert len(plan.ranks) == len(parse_gpus(pl.learner_gpus, "")) == len(learner.gpus)
    assert [r.rank for r in plan.ranks] == list(range(len(plan.ranks)))
    assert plan.ranks[0].host == pl.hosts[0]
    # One-host learners rendezvous in a file (no port); a learner across hosts uses the TCP store.
    assert ("VAPO_STORE_FILE" in learner.env) == (len({r.host for r in plan.ranks}) == 1)
    include = learner.argv[learner.argv.index("--include") + 1]
    listed = sum(len(part.split(":")[1].split(",")) for part in include.split("@"))
    assert listed == len(plan.ranks)
    # Engines: num_actors of them, tp GPUs each, on one host, disjoint from each other.
    engines = [p for p in plan.procs if p.role == "engine"]
    assert len(engines) == cfg.actors.num_actors
    tp = cfg.engine.sglang_tp_size
    seen: set[int] = set()
    for i, e in enumerate(engines):
        assert len(e.gpus) == tp and not seen & set(e.gpus)
        seen |= set(e.gpus)
        assert len({g // pl.gpus_per_host for g in e.gpus}) == 1
        assert e.host == pl.hosts[e.gpus[0] // pl.gpus_per_host]
        assert _env_of(e)["CUDA_VISIBLE_DEVICES"] == ",".join(str(g % pl.gpus_per_host) for g in e.gpus)
        assert f"--port {cfg.engine.base_port + i}" in " ".join(e.argv)
        actor = plan.proc(f"actor-{i}")
        assert actor.host == e.host  # an actor talks to its engine over loopback
    # Learner and engines share GPUs only where the config says so.
    overlap = seen & set(learner.gpus)
    assert bool(overlap) == pl.share_gpus
    assert max(seen | set(learner.gpus)) < n_gpus
    if not pl.share_gpus:
        assert len(seen) + len(learner.gpus) <= n_gpus
    # Model states fit the budget; the estimate is in the plan (and printed by --dry-run).
    assert 0 < plan.memory["learner_states_gib_per_gpu"] <= plan.memory["learner_budget_gib_per_gpu"]
    assert "memory:" in plan.render() and "learner rank 0" in plan.render()


def test_paper_plan_spans_hosts_with_a_hostfile_and_remote_starts() -> None:
    cfg, plan = _plan("paper.yaml", QWEN_32B)
    assert len(plan.ranks) == 48 and len({r.host for r in plan.ranks}) == 7
    learner = plan.proc("learner")
    assert "--hostfile" in learner.argv and learner.argv[learner.argv.index("--launcher") + 1] == "pdsh"
    assert plan.files["hostfile"].splitlines()[0] == "node0 slots=8"
    assert "DS_ACCELERATOR=cuda" in plan.files["deepspeed_env"]
    remote = [p for p in plan.procs if p.host != "node0"]
    assert remote and all(p.argv[0] == "ssh" for p in remote)
    # 32B policy + critic over 48 ZeRO-3 ranks: (32.76e9 + 31.99e9) * 16 / 48 bytes.
    expected = (32_763_876_352 + 31_985_313_793) * 16 / 48 / GIB
    assert plan.memory["learner_states_gib_per_gpu"] == pytest.approx(expected, abs=0.01)


def test_cpu_default_plan_is_unchanged() -> None:
    cfg = load_config(ROOT / "ops" / "configs" / "default.yaml")
    plan = build_plan(cfg, "/run/config.yaml", "/venv/bin/python", ROOT)
    assert plan.proc("learner").argv == ["/venv/bin/python", "-m", "learner", "/run/config.yaml"]
    assert all(p.env["DS_ACCELERATOR"] == "cpu" for p in plan.procs)
    assert [p.name for p in plan.procs] == ["buffer", "learner", "actor-0"]


@pytest.mark.parametrize("name,hf,overrides,match", [
    # A 32B policy + critic cannot be trained on one shared GPU.
    ("gpu-small.yaml", QWEN_32B, [], "placement.learner_gpus: policy \\+ critic model states need"),
    # The paper's placement with a quarter of the learner GPUs does not fit either.
    ("paper.yaml", QWEN_32B, ["placement.learner_gpus=4-10", "placement.engine_gpus=0-3,52-63"], "model states"),
    ("gpu-node8.yaml", QWEN_7B, ["placement.learner_gpus=1-7"], "given to both engines and the learner"),
    ("gpu-node8.yaml", QWEN_7B, ["placement.engine_gpus=0"], "engine_gpus: 1 GPU"),
    ("gpu-node8.yaml", QWEN_7B, ["placement.learner_gpus=2-8"], "GPU 8 does not exist"),
    ("gpu-node8.yaml", QWEN_7B, ["placement.learner_gpus="], "needs the learner's GPUs"),
    ("paper.yaml", QWEN_32B, ["placement.engine_gpus=6-9,52-63", "placement.learner_gpus=0-5,10-51"],
     "would span hosts"),
    ("paper.yaml", QWEN_32B, ["placement.engine_gpus=0-7,56-63", "placement.learner_gpus=8-55"],
     "rank 0 must run on host 0"),
    ("paper.yaml", QWEN_32B, ["buffer.ingest_addr=tcp://127.0.0.1:5555"], "buffer.ingest_addr: actors run on other hosts"),
    ("paper.yaml", QWEN_32B, ["placement.remote=srun"], "one srun step places the ranks by count"),
    ("paper.yaml", QWEN_32B, ["placement.store_protection="], "placement.store_protection: the learner spans 7 hosts"),
    ("paper.yaml", QWEN_32B, ["placement.engine_gpus=52-63,0-3"], None),
    ("default.yaml", None, ["placement.engine_gpus=0"], "run.device=cpu"),
    # More engines required than the run has: it would only stop after placement.min_engines_grace_s.
    ("paper.yaml", QWEN_32B, ["placement.min_engines=5"], "placement.min_engines=5: the run has only actors.num_actors=4"),
    ("default.yaml", None, ["placement.min_engines=3"], "placement.min_engines=3: the run has only"),
])
def test_bad_placements_are_refused_naming_the_key(name: str, hf: dict | None, overrides: list[str],
                                                   match: str | None) -> None:
    if match is None:  # a reordered engine list is still valid: engine 0 moves to host 6 ...
        with pytest.raises(ConfigError, match="learner.eval_engine_url"):  # ... so evaluation needs a URL
            _plan(name, hf, *overrides)
        return
    with pytest.raises(ConfigError, match=match):
        _plan(name, hf, *overrides)


@pytest.mark.parametrize("name,hf", GPU_CONFIGS)
def test_deepspeed_launcher_accepts_the_learner_command(name: str, hf: dict, tmp_path: Path) -> None:
    """DeepSpeed's own argument parser and resource filter turn the plan's learner command into exactly the
    plan's ranks (host by host)."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_args, parse_inclusion_exclusion

    cfg = load_config(ROOT / "ops" / "configs" / name)
    plan = build_plan(cfg, tmp_path / "config.yaml", "/venv/bin/python", ROOT, tmp_path, hf_config=hf)
    args = parse_args(_runner(plan.proc("learner"))[3:])
    assert args.module and args.no_local_rank and args.user_script == "learner"
    assert args.user_args == [str(tmp_path / "config.yaml")]
    if "hostfile" in plan.files:
        (tmp_path / "hostfile").write_text(plan.files["hostfile"])
        pool = fetch_hostfile(args.hostfile)
    else:
        pool = {"localhost": cfg.placement.gpus_per_host}
    active = parse_inclusion_exclusion(pool, args.include, args.exclude)
    want: dict[str, list[int]] = {}
    for r in plan.ranks:
        want.setdefault("localhost" if "hostfile" not in plan.files else r.host, []).append(r.local_gpu)
    assert {h: list(s) for h, s in active.items()} == want


@pytest.mark.parametrize("name,hf", GPU_CONFIGS)
def test_sglang_accepts_the_engine_commands(name: str, hf: dict) -> None:
    """Every engine command line parses with the installed SGLang's own ServerArgs (GPU machines, where
    `ops/setup.sh --cuda` installed it; skipped on CPU machines)."""
    import argparse

    server_args = pytest.importorskip("sglang.srt.server_args")
    cfg, plan = _plan(name, hf)
    for p in (p for p in plan.procs if p.role == "engine"):
        words = shlex.split(p.argv[-1]) if p.argv[0] == "ssh" else p.argv
        argv = words[words.index("sglang.launch_server") + 1:]
        ap = argparse.ArgumentParser()
        server_args.ServerArgs.add_cli_args(ap)
        sa = server_args.ServerArgs.from_cli_args(ap.parse_args(argv))
        assert sa.tp_size == cfg.engine.sglang_tp_size and sa.enable_metrics


# ---------------------------------------------------------------------------------- CPU across hosts

CPU_HOSTS = ["placement.hosts=[h0,h1,h2,h3]", "placement.gpus_per_host=2", "placement.store_protection=private_network",
             "buffer.ingest_addr=tcp://10.9.0.1:5555", "learner.publish_addr=tcp://10.9.0.1:5557",
             "learner.query_addr=tcp://10.9.0.1:5558"]


def _cpu_hosts_plan(tmp_path: Path, *overrides: str):
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [*CPU_HOSTS, *overrides])
    return cfg, build_plan(cfg, tmp_path / "config.yaml", "/venv/bin/python", ROOT, tmp_path)


def _ds_ranks(plan, tmp_path: Path) -> dict[str, list[int]]:
    """What DeepSpeed's own parser and resource filter make of the plan's learner command."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_args, parse_inclusion_exclusion

    for name, text in plan.files.items():
        (tmp_path / name).write_text(text)
    args = parse_args(_runner(plan.proc("learner"))[3:])
    assert args.module and args.user_script == "learner"
    active = parse_inclusion_exclusion(fetch_hostfile(args.hostfile), args.include, args.exclude)
    return {h: list(s) for h, s in active.items()}


def test_cpu_plan_across_hosts_places_slots_like_gpus(tmp_path: Path) -> None:
    # Slots: h0 = 0,1; h1 = 2,3; h2 = 4,5; h3 = 6,7. Learner ranks on h0 and h1, engine 0 beside rank 0.
    cfg, plan = _cpu_hosts_plan(tmp_path, "placement.learner_gpus=0,2-3", "placement.engine_gpus=1,4,7",
                                "actors.num_actors=3")
    assert plan.device == "cpu"
    assert [(r.rank, r.host, r.local_gpu) for r in plan.ranks] == [(0, "h0", 0), (1, "h1", 0), (2, "h1", 1)]
    assert plan.proc("buffer").host == "h0" and plan.proc("learner").host == "h0"
    for p in plan.procs:  # CPU everywhere, and no device assignment on CPU
        env = _env_of(p)
        assert env["DS_ACCELERATOR"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in env, p
    assert "DS_ACCELERATOR=cpu" in plan.files["deepspeed_env"].splitlines()
    learner = plan.proc("learner")
    assert learner.argv[learner.argv.index("--launcher") + 1] == "pdsh"
    assert learner.argv[learner.argv.index("--master_addr") + 1] == "h0"
    assert _ds_ranks(plan, tmp_path) == {"h0": [0], "h1": [0, 1]}
    # Actor i runs on the host of its slot (it starts its rollout_server engine there); remote ones via ssh.
    assert [plan.proc(f"actor-{i}").host for i in range(3)] == ["h0", "h2", "h3"]
    assert plan.proc("actor-0").argv[0] != "ssh"
    assert all(plan.proc(f"actor-{i}").argv[0] == "ssh" for i in (1, 2))
    assert "run.device=cpu" in plan.render() and "local slot 1 (global 3)" in plan.render()


def test_cpu_plan_across_hosts_learner_on_host_0(tmp_path: Path) -> None:
    # One CPU rank: a plain learner process, as on one host.
    _, plan = _cpu_hosts_plan(tmp_path, "placement.learner_gpus=0", "placement.engine_gpus=1,4,6", "actors.num_actors=3")
    assert plan.proc("learner").argv == ["/venv/bin/python", "-m", "learner", str(tmp_path / "config.yaml")]
    # Two ranks on host 0: DeepSpeed's launcher with a one-host hostfile (its CPU accelerator counts NUMA
    # nodes, not slots) and a file rendezvous.
    _, plan = _cpu_hosts_plan(tmp_path, "placement.learner_gpus=0-1", "placement.engine_gpus=2,4,6",
                              "actors.num_actors=3", "learner.eval_every=0")
    assert _ds_ranks(plan, tmp_path) == {"localhost": [0, 1]}
    assert "--no_ssh_check" in plan.proc("learner").argv and "VAPO_STORE_FILE" in plan.proc("learner").env


@pytest.mark.parametrize("overrides,match", [
    (["placement.learner_gpus=0,2", "placement.engine_gpus="], "needs the engines' slots"),
    (["placement.learner_gpus=", "placement.engine_gpus=1"], "needs the learner's slots"),
    (["placement.learner_gpus=0,8", "placement.engine_gpus=1"], "slot 8 does not exist"),
    (["placement.learner_gpus=0,1", "placement.engine_gpus=1"], "given to both engines and the learner"),
])
def test_cpu_plan_across_hosts_refuses_bad_slots(tmp_path: Path, overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cpu_hosts_plan(tmp_path, *overrides)


# ------------------------------------------------------------------------------------------ Slurm route

SRUN_7B = ["placement.remote=srun", "placement.learner_gpus=0-3,8-11,16-19,24-27",
           "placement.engine_gpus=4-7,12-15,20-23,28-63", "actors.num_actors=12"]


def _srun_tasks(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:argv.index("env")] if "=" in a}
    return opts, argv[argv.index("env") + 1:]


def test_srun_learner_is_one_step_of_all_ranks() -> None:
    """DeepSpeed's Slurm runner sets no RANK/WORLD_SIZE/MASTER_ADDR and drops --module: the plan starts the
    ranks itself as one srun step, MASTER_ADDR/MASTER_PORT in its environment."""
    cfg, plan = _plan("paper.yaml", QWEN_7B, *SRUN_7B, "placement.master_addr=10.0.0.1")
    learner = plan.proc("learner")
    assert learner.argv[0] == "srun" and learner.via == "srun" and "deepspeed.launcher.runner" not in learner.argv
    opts, inner = _srun_tasks(learner.argv)
    assert opts["--nodes"] == "4" and opts["--ntasks"] == "16" and opts["--ntasks-per-node"] == "4"
    assert opts["--nodelist"] == "node0,node1,node2,node3" and "--overlap" in learner.argv
    assert "--kill-on-bad-exit=1" in learner.argv  # one dead rank ends the step, not a hang at a collective
    env = dict(w.split("=", 1) for w in inner if "=" in w and not w.startswith("/"))
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == str(cfg.placement.master_port)
    assert env["DS_ACCELERATOR"] == "cuda"
    assert inner[-4:] == ["/venv/bin/python", "-m", "learner", "/run/config.yaml"]


def test_srun_ranks_match_the_plan_through_slurms_variables() -> None:
    """The contract with learner/dist.py: each task of the step, given the variables Slurm sets under block
    distribution, becomes exactly the plan's rank on the plan's host and local GPU."""
    dist = pytest.importorskip("learner.dist")
    if not hasattr(dist, "adopt_slurm_env"):
        pytest.skip("learner.dist does not derive ranks from Slurm's variables yet")
    _, plan = _plan("paper.yaml", QWEN_7B, *SRUN_7B)
    opts, _ = _srun_tasks(plan.proc("learner").argv)
    nodes, n = opts["--nodelist"].split(","), int(opts["--ntasks-per-node"])
    for r in plan.ranks:
        node = r.rank // n  # block distribution: tasks fill the first node, then the next
        env = {"SLURM_PROCID": str(r.rank), "SLURM_NTASKS": opts["--ntasks"], "SLURM_STEP_NUM_TASKS": opts["--ntasks"],
               "SLURM_LOCALID": str(r.rank % n), "SLURM_NODEID": str(node),
               "SLURM_STEP_TASKS_PER_NODE": f"{n}(x{len(nodes)})"}
        dist.adopt_slurm_env(env)
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(r.rank), "16", str(r.local_gpu))
        assert nodes[node] == r.host


def test_srun_engines_and_actors_get_the_cpus_of_a_node() -> None:
    # srun gives a step one CPU unless told otherwise.
    _, plan = _plan("paper.yaml", QWEN_7B, *SRUN_7B, "placement.srun_cpus_per_task=16")
    remote = [p for p in plan.procs if p.host != "node0"]
    assert remote and all(p.argv[0] == "srun" and "--cpus-per-task=16" in p.argv for p in remote)
    assert "--cpus-per-task=4" in plan.proc("learner").argv  # 16 CPUs over 4 ranks per node
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml", SRUN_7B)  # 0: the allocation's own count
    plan = build_plan(cfg, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=QWEN_7B,
                      environ={"SLURM_CPUS_ON_NODE": "96", "PATH": ""})
    assert "--cpus-per-task=96" in plan.proc("actor-5").argv
