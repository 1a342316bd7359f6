"""common.provenance: what produced a result, read from the machine and the checkout themselves."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from common import provenance
from common.checksum import weights_sha256

ROOT = Path(__file__).resolve().parents[2]


def test_collect_reports_this_checkout_machine_and_libraries(tiny_model_dir: Path) -> None:
    p = provenance.collect(tiny_model_dir, {"learner": 1})
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert p["commit"]["sha"] == head and isinstance(p["commit"]["dirty"], bool)
    model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name"))
    assert p["cpu"]["model"] == model
    assert p["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert all(f.startswith(provenance.SIMD_PREFIXES) for f in p["cpu"]["simd_flags"])
    assert p["versions"]["torch"] == torch.__version__ and p["versions"]["deepspeed"] == metadata.version("deepspeed")
    assert p["threads"]["learner"] == 1 and p["threads"]["torch"] == torch.get_num_threads()
    assert p["base"]["sha256"] == weights_sha256(tiny_model_dir)
    json.dumps(p)  # it goes into JSON records as it is
    line = provenance.describe(p)
    assert head[:10] in line and torch.__version__ in line and p["base"]["sha256"][:12] in line
    assert provenance.describe(None) == "unknown"


def test_base_without_weights_or_outside_git_is_recorded_as_unknown(tmp_path: Path) -> None:
    assert provenance.base_checksum(tmp_path / "missing") is None
    assert provenance.commit(tmp_path) == {"sha": None, "dirty": None}


def test_a_checkout_is_dirty_for_changed_code_not_for_the_results_a_suite_writes(tmp_path: Path) -> None:
    """An experiment suite appends to its ledger in docs/results/ after each run; the next run in the same
    checkout is made by the same code, so it is not recorded as dirty. Any other changed tracked file is."""
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    (tmp_path / "docs" / "results").mkdir(parents=True)
    ledger, code = tmp_path / "docs" / "results" / "runs.jsonl", tmp_path / "train.py"
    ledger.write_text("{}\n")
    code.write_text("lr = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    clean = provenance.commit(tmp_path)
    assert clean["dirty"] is False and len(clean["sha"]) == 40
    ledger.write_text("{}\n{}\n")
    (tmp_path / "notes.txt").write_text("untracked")
    assert provenance.commit(tmp_path)["dirty"] is False
    code.write_text("lr = 2\n")
    assert provenance.commit(tmp_path)["dirty"] is True


def test_verify_base_accepts_the_described_weights_and_names_a_changed_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    assert provenance.verify_base(base) is None  # no manifest: nothing to check against
    (base / "manifest.json").write_text(json.dumps({"sha256": weights_sha256(base)}))
    assert provenance.verify_base(base) is None
    w = next(base.glob("*.safetensors"))
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    problem = provenance.verify_base(base)
    assert problem is not None and "not the one its manifest.json describes" in problem
    assert weights_sha256(base) in problem


def test_machines_line_names_each_machine_and_the_runs_without_a_header(tiny_model_dir: Path, tmp_path: Path) -> None:
    from common.config import load_config
    from learner.records import RunRecords, append_jsonl

    dirs = []
    for name in ("a", "b", "old"):
        cfg = load_config(None, [f"run.root={tmp_path}", f"run.name={name}", f"model.path={tiny_model_dir}"])
        if name != "old":
            RunRecords(cfg).append_header()
        append_jsonl(cfg.run_dir / "metrics.jsonl", {"kind": "learner_step", "step": 1})
        dirs.append(cfg.run_dir)
    assert provenance.of_run(dirs[2]) is None and provenance.of_run(dirs[0])["kind"] == "header"
    line = provenance.machines_line(dirs)
    p = provenance.of_run(dirs[0])
    assert f"{p['cpu']['model']} ({p['cpu']['torch_capability']}" in line and ": 2 runs, load " in line
    assert " at start, commit " in line  # one group whatever each run's load was
    assert p["base"]["sha256"][:12] in line and line.endswith("unknown (no metrics.jsonl header): 1 run")


def test_a_run_with_a_critic_of_its_own_records_that_base_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    from common.config import load_config

    critic = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, critic)
    assert "critic_base" not in provenance.for_config(load_config(None, [f"model.path={tiny_model_dir}"]))
    p = provenance.for_config(load_config(None, [f"model.path={tiny_model_dir}", f"model.critic_path={critic}"]))
    assert p["critic_base"] == {"path": str(critic), "sha256": weights_sha256(critic)}
    assert p["base"]["path"] == str(tiny_model_dir)
