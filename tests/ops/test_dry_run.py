"""`ops/launch.sh CONFIG --dry-run`: the whole process plan, nothing started, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from common.preflight import missing_files
from tests.bare_path import bare_path
from tests.common.placement_fixtures import QWEN_05B, QWEN_7B, QWEN_32B

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str, path_dir: Path | None = None, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """``path``: the whole PATH (a bare machine's: tests/bare_path.py); ``path_dir``: a directory put first."""
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    if path_dir is not None:  # multi-host ssh plans need pdsh at plan time: a stand-in where it is missing
        env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(ROOT / "ops" / "launch.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def _model_and_data(tmp_path: Path, hf: dict) -> list[str]:
    """A model directory with the config.json of the real model, a jsonl task file, a pdsh on PATH."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(hf))
    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if shutil.which("pdsh") is None:
        (bin_dir / "pdsh").write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / "pdsh").chmod(0o755)
    return [f"model.path={tmp_path / 'model'}", f"task.name=jsonl:{tmp_path / 'train.jsonl'}"]


@pytest.mark.parametrize("config,ranks,engines,hf", [("gpu-small.yaml", 1, 1, QWEN_05B), ("gpu-node8.yaml", 6, 2, QWEN_7B),
                                                     ("paper.yaml", 48, 4, QWEN_32B)])
def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path, config: str, ranks: int, engines: int,
                                                    hf: dict) -> None:
    # Flags may follow the overrides (`CONFIG key=val --dry-run`), as they may precede them.
    files = _model_and_data(tmp_path, hf)
    p = _launch(f"ops/configs/{config}", f"run.root={tmp_path / 'runs'}", *files, "--dry-run", path_dir=tmp_path / "bin")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"{ranks} learner rank(s)" in out
    assert out.count("sglang.launch_server") == engines
    assert "deepspeed.launcher.runner" in out and "DS_ACCELERATOR=cpu" not in out
    assert not (tmp_path / "runs").exists()  # nothing written


def test_dry_run_refuses_a_placeholder_push_address(tmp_path: Path) -> None:
    """paper.yaml's documented command used to leave learner.push_master_address at a placeholder, which
    learner rank 0 binds only after value pretraining: the dry run now says so, naming the key."""
    files = _model_and_data(tmp_path, QWEN_32B)
    p = _launch("ops/configs/paper.yaml", f"run.root={tmp_path / 'runs'}", *files, "learner.push_master_address=10.0.0.1",
                "--dry-run", path_dir=tmp_path / "bin")
    assert p.returncode == 2 and p.stdout == ""
    assert "learner.push_master_address: 10.0.0.1 is not an address of host 0 (node0)" in p.stderr


def test_dry_run_refuses_a_placement_that_cannot_work(tmp_path: Path) -> None:
    p = _launch("ops/configs/gpu-node8.yaml", "--dry-run", "placement.learner_gpus=1-7", f"run.root={tmp_path}")
    assert p.returncode == 2
    assert "placement.engine_gpus/learner_gpus" in p.stderr and "share_gpus" in p.stderr


def test_resume_flag_after_the_overrides_is_accepted(tmp_path: Path) -> None:
    # Used to fail with "unrecognized arguments": flags only worked before the positionals.
    p = _launch("ops/configs/smoke.yaml", f"run.root={tmp_path}", "--dry-run", "--resume")
    assert p.returncode == 0, p.stderr
    assert " -m learner " in p.stdout and "DS_ACCELERATOR=cpu" in p.stdout  # the CPU plan: one learner process


@pytest.mark.parametrize("machine", ["bare", "with_pdsh"])
def test_dry_run_names_every_missing_file_by_its_key(tmp_path: Path, machine: str) -> None:
    """Every file a config names is checked before anything starts: each missing one is named by its key,
    and the exit code says the run would fail. On a bare machine (no pdsh, sshd, Slurm) the missing pdsh is
    named too, beside the files, not instead of them."""
    nokeys = tmp_path / "nokeys"
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "pdsh").write_text("#!/bin/sh\nexit 1\n")
    (stand_in / "pdsh").chmod(0o755)
    where = {"path": bare_path(tmp_path)} if machine == "bare" else {"path_dir": stand_in}
    p = _launch("ops/configs/paper.yaml", f"run.root={tmp_path / 'runs'}", f"model.path={tmp_path / 'nomodel'}",
                f"task.name=jsonl:{tmp_path / 'no.jsonl'}", f"buffer.curve.server_secret_key={nokeys}/server.key_secret",
                f"buffer.curve.client_secret_key={nokeys}/actor.key_secret", f"buffer.curve.keys_dir={nokeys}",
                f"engine.admin_api_key_file={tmp_path / 'no.key'}", f"placement.ssh_args=-F {tmp_path / 'no_ssh_config'}",
                "--dry-run", **where)
    assert p.returncode == 2, p.stdout[-2000:]
    for key in ("model.path", "task.name", "buffer.curve.server_secret_key", "buffer.curve.client_secret_key",
                "buffer.curve.keys_dir (server_public_key)", "engine.admin_api_key_file", "placement.ssh_args"):
        assert f"missing {key}: " in p.stderr, (key, p.stderr)
    pdsh = "missing placement.remote: the learner spans 7 hosts and placement.remote=ssh starts its ranks with " \
           "DeepSpeed's pdsh launcher, but pdsh is not on PATH"
    assert (pdsh in p.stderr) == (machine == "bare"), p.stderr
    assert "process plan" in p.stdout  # the plan is still shown
    assert not (tmp_path / "runs").exists()


def test_a_placement_that_cannot_be_planned_still_names_every_missing_file(tmp_path: Path) -> None:
    p = _launch("ops/configs/gpu-node8.yaml", "--dry-run", "placement.learner_gpus=1-7", f"run.root={tmp_path}",
                f"model.path={tmp_path / 'nomodel'}", f"task.name=jsonl:{tmp_path / 'no.jsonl'}",
                path=bare_path(tmp_path))
    assert p.returncode == 2 and p.stdout == ""  # no plan to show
    lines = p.stderr.splitlines()
    assert lines[0].startswith("ops/launch.sh: placement.engine_gpus/learner_gpus: GPU(s) [1] are given to both")
    assert [ln.split(":")[1].strip() for ln in lines[1:]] == ["missing model.path", "missing task.name"]


def test_paper_keys_are_what_the_documented_command_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """paper.yaml's keys are found after `python -m buffer.keys keys/` (docs/MULTIHOST.md's command) in the
    repository root: the server's and every client role's."""
    from common.security import ROLES, client_curve_keys, server_keys

    subprocess.run([sys.executable, "-m", "buffer.keys", "keys/"], cwd=tmp_path, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml")
    monkeypatch.chdir(tmp_path)  # every process of a run starts in the repository root
    assert server_keys(cfg.buffer.curve) is not None
    for role in ROLES:
        assert client_curve_keys(cfg.buffer.curve, role) is not None
    assert not [m for m in missing_files(cfg, tmp_path) if m.startswith("buffer.curve")]


def test_paper_dry_run_with_the_shipped_shape_prints_both_estimates_and_the_flip(tmp_path: Path) -> None:
    """paper.yaml's documented dry run on a machine without the model: the shipped Qwen2.5-32B shape
    (ops/configs/shapes/qwen2.5-32b, a config.json without weights) gives the memory check, the learner's and
    the engines' estimates and the mean response length at which the bound flips."""
    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if shutil.which("pdsh") is None:
        (bin_dir / "pdsh").write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / "pdsh").chmod(0o755)
    p = _launch("ops/configs/paper.yaml", "model.path=ops/configs/shapes/qwen2.5-32b", f"run.root={tmp_path / 'runs'}",
                f"task.name=jsonl:{tmp_path / 'train.jsonl'}", "--dry-run", path_dir=bin_dir)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert '"policy_params_b": 32.764' in out  # the shape read: 32,763,876,352 parameters
    assert "balance at ~5000-token mean responses (8192 samples a step" in out
    assert "learner ~" in out and "min/step on 48 GPU(s)" in out and "micro-batch plan" in out
    assert "generation ~" in out and "min/step on 16 engine GPU(s), memory-bound" in out
    assert "the run turns from learner-bound to generation-bound at a mean response length of ~" in out
    assert not (tmp_path / "runs").exists()


def test_dry_run_without_pdsh_shows_the_plan_and_says_a_launch_would_refuse(tmp_path: Path) -> None:
    """Where pdsh is missing (a bare machine's PATH), a launch refuses an ssh plan over several hosts; the dry run still
    prints the plan and its estimates, names the problem by its key and exits 2."""
    p = _launch("ops/configs/paper.yaml", "model.path=ops/configs/shapes/qwen2.5-32b", f"run.root={tmp_path / 'runs'}",
                "--dry-run", path=bare_path(tmp_path))
    assert p.returncode == 2
    assert "process plan" in p.stdout and "generation ~" in p.stdout
    assert "ops/launch.sh: missing placement.remote: the learner spans 7 hosts" in p.stderr and "pdsh" in p.stderr
