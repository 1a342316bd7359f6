"""The rehearsal's weight-sync parts that need no root: the figures read back from a run directory
(metrics.jsonl, the actors' ``ACTOR DONE`` lines, the weight versions) with the engines' digests compared
against real safetensors versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ops.rehearsal.push import bitwise, param_digest_of, sync_figures


def _version(run_dir: Path, version: int, scale: float) -> None:
    d = run_dir / "weights" / f"v{version}"
    d.mkdir(parents=True)
    save_file({"w": torch.full((4, 4), scale), "b": torch.arange(3, dtype=torch.float32) * scale},
              str(d / "model.safetensors"))
    (d / "STABLE").write_text("{}")


def _run_dir(tmp_path: Path, transport: str) -> Path:
    run = tmp_path / f"run-{transport}"
    (run / "logs").mkdir(parents=True)
    publish = {"disk": [0.5, 0.7], "distributed": [0.1, 0.3]}[transport]
    with (run / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"kind": "start"}) + "\n")
        for v, s in enumerate(publish, 1):
            f.write(json.dumps({"kind": "learner_step", "weight_version": v,
                                "phase_seconds": {"fetch": 0.01, "publish": s}}) + "\n")
        f.write("not json\n")
    for aid in (0, 1):
        done = {"actor_id": aid, "weight_version": 2, "weight_loads": 2 if transport == "disk" else 0, "weight_sync_failures": 0, "fatal": None,
                "weight_sync_latency_s": [1.0, 2.0] if transport == "disk" else []}
        if transport == "distributed":
            done.update(weight_pushes=2, push_pause_ms=400 + 200 * aid)
        lines = ["ACTOR READY {}", "ACTOR DONE " + json.dumps({**done, "weight_version": 1}), "ACTOR DONE " + json.dumps(done)]
        (run / "logs" / f"actor-{aid}.log").write_text("\n".join(["some log line", *lines]) + "\n")
    _version(run, 1, 1.0)
    _version(run, 2, 2.0)
    (run / "weights" / "v3").mkdir()  # being written: no STABLE, not a version yet
    return run


def test_figures_per_transport(tmp_path: Path) -> None:
    disk = sync_figures(_run_dir(tmp_path, "disk"), "disk")
    assert disk["publishes"] == 2 and disk["learner_blocked_s_mean"] == pytest.approx(0.6)
    assert disk["learner_blocked_s_max"] == pytest.approx(0.7)
    assert disk["engine_pushes"] == 0 and disk["engine_pause_s_mean"] is None
    assert disk["disk_syncs"] == 4 and disk["disk_sync_latency_s_mean"] == pytest.approx(1.5)
    size = (tmp_path / "run-disk" / "weights" / "v2" / "model.safetensors").stat().st_size
    assert disk["bytes_per_version"] == size
    assert "bitwise" not in disk
    dist = sync_figures(_run_dir(tmp_path, "distributed"), "distributed")
    assert dist["learner_blocked_s_mean"] == pytest.approx(0.2)
    assert dist["engine_pushes"] == 4 and dist["engine_pause_s_mean"] == pytest.approx(1.0 / 4)
    assert [a["weight_version"] for a in dist["actors"]] == [2, 2]  # each actor's last ACTOR DONE


def test_bitwise_against_the_disk_versions(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, "distributed")
    v1, v2 = param_digest_of(run / "weights" / "v1"), param_digest_of(run / "weights" / "v2")
    assert v1 != v2
    good = {"h2:30000": {1: v1, 2: v2}, "h3:30001": {2: v2}}
    out = sync_figures(run, "distributed", good, param_digest_of)["bitwise"]
    assert out["ok"] and out["newest_disk_version"] == 2 and out["engines_at_newest"] == 2
    assert out["versions_compared"] == 3 and out["mismatched"] == []
    wrong = bitwise(run, {"h2:30000": {2: v2}, "h3:30001": {1: v1, 2: v1}}, param_digest_of)
    assert not wrong["ok"] and wrong["mismatched"] == ["h3:30001@v2"]
    behind = bitwise(run, {"h2:30000": {2: v2}, "h3:30001": {1: v1}}, param_digest_of)
    assert not behind["ok"] and behind["engines_at_newest"] == 1
    assert not bitwise(run, {}, param_digest_of)["ok"]  # no engine seen is no evidence
