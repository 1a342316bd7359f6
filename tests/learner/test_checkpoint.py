"""Checkpoint/resume: a SIGKILLed learner continues at the right version with the same next update; a damaged
newest checkpoint (truncated, flipped, garbage) is found by its digests and the run resumes from the newest
intact one (or refuses), with that checkpoint's version and data cursor; checkpoints are fsynced."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from common.config import Config, load_config
from learner import checkpoint
from learner.data import ListSource
from learner.runner import Runner
from learner.synthetic import synth_groups
from learner.weights import complete_versions
from tests.learner.synth import child_env

REPO = Path(__file__).resolve().parents[2]

HARNESS = textwrap.dedent("""
    import os, signal, sys
    from common.config import load_config
    from learner.data import ListSource
    from learner.runner import Runner
    from learner.synthetic import synth_groups
    from tests.learner.synth import child_env

    root, model, name, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    class KillingSource(ListSource):
        def get_batch(self, version, n, timeout_s=0.0):
            if version == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, after v<kill_at> was checkpointed and published
            return super().get_batch(version, n, timeout_s)

    cfg = load_config(None, [f"run.root={{root}}", f"run.name={{name}}", f"model.path={{model}}",
                             "learner.total_steps=3", "learner.batch_groups=4", "learner.micro_batch_size=8",
                             "learner.checkpoint_every=1", "learner.eval_every=0", "metrics.prometheus=false",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    Runner(cfg, KillingSource(synth_groups(16, 4, 60, seed=11))).start().run()
""")


def _run(harness: Path, root: Path, model: Path, name: str, kill_at: int) -> int:
    env = child_env()
    p = subprocess.run([sys.executable, str(harness), str(root), str(model), name, str(kill_at)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode in (0, -9), p.stderr[-3000:]
    return p.returncode


def _weights(root: Path, name: str, v: int) -> dict[str, torch.Tensor]:
    return load_file(str(root / name / "weights" / f"v{v}" / "model.safetensors"))


def test_sigkill_and_resume_matches_uninterrupted_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS.format())
    assert _run(harness, tmp_path, tiny_model_dir, "straight", -1) == 0
    assert _run(harness, tmp_path, tiny_model_dir, "killed", 2) == -9
    killed = tmp_path / "killed"
    assert complete_versions(killed / "weights")[-1] == 2
    stable_v2 = (killed / "weights" / "v2" / "STABLE").read_text()
    assert _run(harness, tmp_path, tiny_model_dir, "killed", -1) == 0
    # v2 was not published a second time; v3 exists and equals the uninterrupted run's v3.
    assert (killed / "weights" / "v2" / "STABLE").read_text() == stable_v2
    a, b = _weights(tmp_path, "straight", 3), _weights(tmp_path, "killed", 3)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    a2 = _weights(tmp_path, "straight", 2)
    assert max(float((a[k] - a2[k]).abs().max()) for k in a) > 1e-5  # the resumed step did update
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_versions_published_past_the_checkpoint_are_skipped(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.total_steps=3", "learner.batch_groups=2", "learner.checkpoint_every=2",
                             "learner.eval_every=0", "metrics.prometheus=false",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    groups = synth_groups(8, 2, 60, seed=4)
    Runner(cfg, ListSource(groups)).start().run()  # checkpoints v2 and (final) v3, publishes v1..v3
    # Simulate a crash after v3 was published but before its checkpoint became visible.
    ck = tmp_path / "r" / "checkpoints"
    (ck / "v3" / "COMPLETE").unlink()
    cfg.learner.total_steps = 4
    r = Runner(cfg, ListSource(groups)).start()
    # Restored v2's state; v3 (published, lost with its checkpoint) is not reused: v2's weights become v4.
    assert r.learner.version == 4
    r.run()
    assert complete_versions(tmp_path / "r" / "weights") == [2, 3, 4]


def _cfg(root: Path, model: Path, *extra: str) -> Config:
    return load_config(None, [f"run.root={root}", "run.name=r", f"model.path={model}", "learner.total_steps=3",
                              "learner.batch_groups=2", "learner.checkpoint_every=1", "learner.keep_checkpoints=3",
                              "learner.eval_every=0", "metrics.prometheus=false",
                              "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0", *extra])


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 3-step run checkpointing every step (v1, v2, v3; weights v1..v3), with every fsync's path recorded."""
    root = tmp_path_factory.mktemp("ckpt")
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", recording)
        Runner(_cfg(root, tiny_model_dir), ListSource(synth_groups(8, 2, 60, seed=4))).start().run()
    return {"root": root, "synced": synced}


@pytest.fixture
def run_dir(trained: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the trained run (each test damages its own)."""
    shutil.copytree(trained["root"] / "r", tmp_path / "r")
    return tmp_path / "r"


def _largest(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_truncated_model_state_resumes_from_previous_with_its_version_and_cursor(
        run_dir: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = run_dir / "checkpoints"
    victim = _largest(ck / "v3" / "policy")
    size = victim.stat().st_size
    os.truncate(victim, size // 3)
    v2 = json.loads((ck / "v2" / "learner.json").read_text())
    assert v2["source"] != json.loads((ck / "v3" / "learner.json").read_text())["source"]
    stable_v3 = (run_dir / "weights" / "v3" / "STABLE").read_text()
    cfg = _cfg(run_dir.parent, tiny_model_dir, "learner.total_steps=5")
    with caplog.at_level(logging.WARNING, logger="learner.checkpoint"):
        r = Runner(cfg, ListSource(synth_groups(8, 2, 60, seed=4))).start()
    rel = victim.relative_to(ck / "v3")
    assert f"v3 damaged ({rel}: size {size // 3} != {size}); resuming from v2, 1 version back" in caplog.text
    # v2's data cursor and sample count; v2's weights republished past the published v3 (never reused).
    assert r.learner.source.state_dict() == v2["source"] and r.learner.samples_seen == v2["samples_seen"]
    assert r.learner.version == 4
    assert (ck / "v3.damaged").is_dir() and not (ck / "v3").exists()
    r.run()
    assert (run_dir / "weights" / "v3" / "STABLE").read_text() == stable_v3
    assert complete_versions(run_dir / "weights") == [3, 4, 5]
    # The set-aside copy is no v<N>: pruning (keep 3) kept real checkpoints and left it alone.
    assert [v for v, _ in checkpoint.complete_checkpoints(ck)] == [2, 4, 5]
    assert checkpoint.latest_checkpoint(ck) == ck / "v5" and (ck / "v3.damaged").is_dir()


def test_garbage_learner_json_falls_back_naming_it(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = run_dir / "checkpoints"
    (ck / "v3" / "learner.json").write_text('{"version": 3, "samp')
    with caplog.at_level(logging.WARNING, logger="learner.checkpoint"):
        assert checkpoint.choose(ck) == ck / "v2"
    assert "v3 damaged (learner.json: size" in caplog.text and "resuming from v2" in caplog.text


def test_refuse_raises_naming_the_file_and_the_intact_checkpoint(run_dir: Path) -> None:
    ck = run_dir / "checkpoints"
    victim = _largest(ck / "v3" / "critic")
    os.truncate(victim, 10)
    with pytest.raises(checkpoint.CheckpointDamaged) as e:
        checkpoint.choose(ck, "refuse")
    assert str(victim.relative_to(ck / "v3")) in str(e.value) and str(ck / "v2") in str(e.value)
    assert (ck / "v3").is_dir()  # left for the operator to look at


def test_same_size_byte_flip_is_caught_by_the_digest(run_dir: Path) -> None:
    v3 = run_dir / "checkpoints" / "v3"
    victim = _largest(v3 / "policy")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointDamaged, match="sha256") as e:
        checkpoint.verify(v3)
    assert e.value.file == str(victim.relative_to(v3))


def test_a_file_that_cannot_be_read_is_damage_not_a_crash(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = run_dir / "checkpoints"
    real = checkpoint.file_digest

    def eio(path: Path, sync: bool = False) -> dict[str, Any]:
        if path.name == "learner.json" and path.parent.name == "v3":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path, sync)

    monkeypatch.setattr(checkpoint, "file_digest", eio)
    with pytest.raises(checkpoint.CheckpointDamaged, match=r"learner.json: unreadable \(Input/output error\)"):
        checkpoint.verify(ck / "v3")
    assert checkpoint.choose(ck) == ck / "v2"


def test_explicit_path_and_no_intact_checkpoint_raise(run_dir: Path) -> None:
    ck = run_dir / "checkpoints"
    for v in (1, 2, 3):
        (ck / f"v{v}" / "rng_rank0.pt").unlink()
    with pytest.raises(checkpoint.CheckpointDamaged, match=r"rng_rank0.pt: missing.*learner.resume"):
        checkpoint.check_explicit(ck / "v2")
    with pytest.raises(checkpoint.CheckpointDamaged, match="no intact checkpoint"):
        checkpoint.choose(ck)
    assert [v for v, _ in checkpoint.complete_checkpoints(ck)] == [1, 2, 3]  # nothing set aside


def test_legacy_checkpoint_without_digests_loads_unverified(run_dir: Path) -> None:
    ck = run_dir / "checkpoints"
    (ck / "v3" / "COMPLETE").write_text("3")  # the marker's old format
    os.truncate(_largest(ck / "v3" / "policy"), 10)  # undetectable without digests
    assert checkpoint.verify(ck / "v3") is False
    assert checkpoint.choose(ck) == ck / "v3"
    (ck / "v3" / "learner.json").write_text("garbage")
    assert checkpoint.choose(ck) == ck / "v2"


def test_files_and_directories_are_fsynced_before_complete_and_the_rename(trained: dict[str, Any]) -> None:
    ck = trained["root"] / "r" / "checkpoints"
    synced = trained["synced"]
    tmp = str(ck / "v3.tmp")
    files = [str(ck / "v3.tmp" / f) for f in checkpoint.digests(ck / "v3")]
    dirs = [tmp] + [str(ck / "v3.tmp" / p.relative_to(ck / "v3")) for p in (ck / "v3").rglob("*") if p.is_dir()]
    complete = synced.index(f"{tmp}/COMPLETE")
    assert set(files) | set(dirs) <= set(synced[:complete])
    # COMPLETE's directory entry after it, then the parent after the rename (the new name is durable).
    assert tmp in synced[complete + 1:] and str(ck) in synced[complete + 1:]
    assert json.loads((ck / "v3" / "COMPLETE").read_text())["files"]["learner.json"]["size"] > 0


@pytest.mark.slow
def test_launcher_resume_goes_back_past_a_truncated_checkpoint(tmp_path: Path) -> None:
    """ops/launch.sh on the smoke config (checkpoints v2, v3), v3's largest policy file cut to a third (a
    power loss after the rename), then ``--resume``: the run ends at its total steps from v2, v3 set aside."""
    from tests.ports import port_overrides

    over = [f"run.root={tmp_path}", "run.name=pl", *port_overrides()]

    def launch(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(REPO / "ops" / "launch.sh"), "ops/configs/smoke.yaml", *over, *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=600, start_new_session=True)

    first = launch()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ck = tmp_path / "pl" / "checkpoints"
    assert [v for v, _ in checkpoint.complete_checkpoints(ck)] == [2, 3]
    victim = _largest(ck / "v3" / "policy")
    os.truncate(victim, victim.stat().st_size // 3)
    second = launch("--resume", "learner.total_steps=5")
    out = second.stdout + second.stderr + (tmp_path / "pl" / "logs" / "learner.log").read_text()
    assert second.returncode == 0, out[-4000:]
    assert f"v3 damaged ({victim.relative_to(ck / 'v3')}: size" in out and "resuming from v2, 1 version back" in out
    assert (ck / "v3.damaged").is_dir()
    assert json.loads((tmp_path / "pl" / "learner_done.json").read_text())["version"] == 5
    assert complete_versions(tmp_path / "pl" / "weights")[-3:] == [3, 4, 5]  # v3 not reused


TWO_RANKS = textwrap.dedent("""
    import sys
    from common.config import load_config
    from learner.data import ListSource
    from learner.dist import exit_process, rank
    from learner.runner import Runner
    from learner.synthetic import synth_groups

    root, model, steps, *extra = sys.argv[1:]
    cfg = load_config(None, [f"run.root={{root}}", "run.name=r", f"model.path={{model}}", f"learner.total_steps={{steps}}",
                             "learner.batch_groups=2", "learner.checkpoint_every=1", "learner.eval_every=0",
                             "metrics.prometheus=false", "learner.publish_addr=tcp://127.0.0.1:0",
                             "learner.query_addr=tcp://127.0.0.1:0", *extra])
    r = Runner(cfg, ListSource(synth_groups(8, 2, 60, seed=4)) if rank() == 0 else None).start()
    print(f"rank {{rank()}} resumed at {{r.learner.version}}", flush=True)
    r.run()
    exit_process(0)
""")


@pytest.mark.slow
def test_two_ranks_fall_back_together_and_refuse_together(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 verifies and chooses, rank 1 follows (broadcast); with refuse both ranks stop, none hangs."""
    from tests.ports import free_port

    harness = tmp_path / "two.py"
    harness.write_text(TWO_RANKS.format())

    def two(steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(harness), str(tmp_path), str(tiny_model_dir), str(steps), *extra]
        return subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0"), capture_output=True,
                              text=True, timeout=300, cwd=REPO)

    assert two(2).returncode == 0
    ck = tmp_path / "r" / "checkpoints"
    # Each rank hashed its share; rank 0's COMPLETE lists all of them, both ranks' RNG files included.
    listed = json.loads((ck / "v1" / "COMPLETE").read_text())["files"]
    assert sorted(listed) == sorted(str(p.relative_to(ck / "v1")) for p in (ck / "v1").rglob("*")
                                    if p.is_file() and p.name != "COMPLETE") and "rng_rank1.pt" in listed
    os.truncate(_largest(ck / "v2" / "critic"), 100)
    p = two(3, "learner.resume_damaged=refuse")
    assert p.returncode != 0 and "v2 damaged (critic/" in p.stderr and "failed while verifying" in p.stderr
    p = two(3)
    assert p.returncode == 0, p.stderr[-3000:]
    # Both ranks resumed from v1, republished past the published v2 as v3.
    assert "rank 0 resumed at 3" in p.stdout and "rank 1 resumed at 3" in p.stdout
    assert (ck / "v2.damaged").is_dir() and [v for v, _ in checkpoint.complete_checkpoints(ck)] == [1, 3]
