"""ops/launch_checks.py: every problem a launch would refuse for, at once: missing files by key, and the
programs other hosts' processes start with, on a bare PATH (tests/bare_path.py) and with them there."""

from __future__ import annotations

from pathlib import Path

from common.config import load_config
from common.placement import build_plan
from ops.launch_checks import launch_problems, tool_problems
from tests.bare_path import bare_path

ROOT = Path(__file__).resolve().parents[2]
# Four CPU hosts: learner ranks on h0 and h1, actors (each with its rollout_server) on h0, h2, h3.
MULTI = ["placement.hosts=[h0,h1,h2,h3]", "placement.gpus_per_host=2", "placement.store_protection=private_network",
         "buffer.ingest_addr=tcp://10.9.0.1:5555", "learner.publish_addr=tcp://10.9.0.1:5557",
         "learner.query_addr=tcp://10.9.0.1:5558", "placement.learner_gpus=0,2-3", "placement.engine_gpus=1,4,7",
         "actors.num_actors=3"]


def _stand_ins(d: Path, *names: str) -> str:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_text("#!/bin/sh\nexit 0\n")
        (d / n).chmod(0o755)
    return str(d)


def _plan(tmp_path: Path, path: str, *overrides: str):
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [*MULTI, f"run.root={tmp_path}", *overrides])
    return cfg, build_plan(cfg, tmp_path / "config.yaml", "/venv/bin/python", ROOT, tmp_path, environ={"PATH": path},
                           dry_run=True)


def test_without_pdsh_ssh_or_srun_every_missing_program_is_named_with_the_processes_it_starts(tmp_path: Path) -> None:
    bare = str(tmp_path / "empty")
    Path(bare).mkdir()
    cfg, plan = _plan(tmp_path, bare)
    assert [p for p in plan.problems if "pdsh is not on PATH" in p]  # the learner across h0, h1
    assert tool_problems(plan, {"PATH": bare}) == [
        "placement.remote: actor-1, actor-2 start(s) with ssh, which is not on PATH: install ssh "
        "(Debian/Ubuntu: apt-get install openssh-client)"]
    _, plan = _plan(tmp_path, bare, "placement.remote=srun", "placement.learner_gpus=0,2")
    (srun,) = tool_problems(plan, {"PATH": bare})
    assert srun.startswith("placement.remote: actor-1, actor-2, learner start(s) with srun, which is not on PATH")


def test_with_the_programs_on_path_the_plan_has_no_problem(tmp_path: Path) -> None:
    path = _stand_ins(tmp_path / "bin", "pdsh", "ssh", "srun")
    _, plan = _plan(tmp_path, path)
    assert plan.problems == [] and tool_problems(plan, {"PATH": path}) == []
    _, plan = _plan(tmp_path, path, "placement.remote=srun", "placement.learner_gpus=0,2")
    assert tool_problems(plan, {"PATH": path}) == []


def test_launch_problems_lists_missing_files_and_programs_together(tmp_path: Path) -> None:
    """What a newcomer's machine without pdsh reads: the missing files by key and the missing programs, all."""
    path = bare_path(tmp_path)
    overrides = [f"task.name=jsonl:{tmp_path / 'no.jsonl'}", f"engine.admin_api_key_file={tmp_path / 'no.key'}"]
    cfg, plan = _plan(tmp_path, path, *overrides)
    problems, skipped = launch_problems(cfg, plan, ROOT, sglang=False, environ={"PATH": path})
    keys = [p.split(":", 1)[0] for p in problems]
    assert keys[:2] == ["task.name", "engine.admin_api_key_file"] and skipped == ""
    assert any("pdsh is not on PATH" in p for p in problems)
    # With the programs there (stand-ins), only the files remain.
    path = _stand_ins(tmp_path / "bin", "pdsh", "ssh")
    cfg, plan = _plan(tmp_path, path, *overrides)
    problems, _ = launch_problems(cfg, plan, ROOT, sglang=False, environ={"PATH": path})
    assert [p.split(":", 1)[0] for p in problems] == ["task.name", "engine.admin_api_key_file"]
