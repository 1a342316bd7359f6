"""The automatic resume's decisions and accounting (``ops/launch_resume.py``): which stops it resumes, why it
refuses the others, the checkpoint it names (real checkpoint directories, a damaged one), the lost time it
counts in the launcher's real metrics registry and in resumes.jsonl, and the flag that sets the key. The
launched runs that it resumes are in test_launch_resume_run.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from common.config import Config, load_config
from common.metrics import Metrics
from ops.launch import parse_args
from ops.launch_child import LaunchError
from ops.launch_resume import RESUMES_FILE, AutoResume, newest_intact_checkpoint, refuse_or_wait

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "ops/configs/smoke.yaml")


def _cfg(*overrides: str) -> Config:
    return load_config(SMOKE, list(overrides))


def _checkpoint(root: Path, version: int, damaged: bool = False) -> None:
    d = root / "checkpoints" / f"v{version}"
    d.mkdir(parents=True)
    (d / "learner.json").write_text(json.dumps({"version": version}))
    if damaged:  # its marker lists a shard that is not there
        (d / "COMPLETE").write_text(json.dumps({"files": {"policy/state.pt": {"size": 4, "sha256": "00"}}}))
    else:  # a format-1 marker: the version alone (verified through learner.json)
        (d / "COMPLETE").write_text(str(version))


def _metrics() -> Metrics:
    return Metrics("launcher", registry=CollectorRegistry())


def test_the_flag_sets_the_key() -> None:
    args = parse_args(["--auto-resume", "2", "run.name=x"])
    assert "run.max_resumes=2" in args.overrides
    assert load_config(args.config, args.overrides).run.max_resumes == 2
    assert not any("max_resumes" in o for o in parse_args([]).overrides)


def test_which_stops_are_resumed() -> None:
    lost = LaunchError("learner", "exited with code -9", lost=True)
    own = LaunchError("learner", "exited with code 1")
    assert AutoResume(_cfg(), Path("."), _metrics()).refusal(lost) == ""  # off: told as before, nothing added
    auto = AutoResume(_cfg("run.max_resumes=1"), Path("."), _metrics())
    assert auto.refusal(lost) is None
    assert "failed of its own accord" in (auto.refusal(own) or "")
    auto.begin(lost, [], None)
    assert "run.max_resumes=1 resume(s) already spent" in (auto.refusal(lost) or "")
    never = AutoResume(_cfg("run.max_resumes=1", "learner.resume=never"), Path("."), _metrics())
    assert "learner.resume=never" in (never.refusal(lost) or "")


def test_the_checkpoint_named_and_a_refused_one(tmp_path: Path) -> None:
    assert newest_intact_checkpoint(_cfg(), tmp_path) == (None, None)  # no checkpoint yet: from the start
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4, damaged=True)
    assert newest_intact_checkpoint(_cfg(), tmp_path) == (2, None)  # the learner falls back past v4
    refuse = _cfg("run.max_resumes=3", "learner.resume_damaged=refuse")
    version, why = newest_intact_checkpoint(refuse, tmp_path)
    assert version is None and "refused" in (why or "") and "v4" in (why or "") and "v2" in (why or "")
    lost = LaunchError("learner", "exited with code -9", lost=True)
    _, why = refuse_or_wait(AutoResume(refuse, tmp_path, _metrics()), lost, tmp_path)
    assert (why or "").startswith("not resumed automatically: the checkpoint is refused")


def test_no_wait_for_host_zero_or_srun_nodes() -> None:
    auto = AutoResume(_cfg("run.max_resumes=1", "run.resume_wait_s=0"), Path("."), _metrics())
    assert auto.wait_for_hosts(("localhost", "")) is None
    srun = AutoResume(_cfg("run.max_resumes=1", "placement.remote=srun"), Path("."), _metrics())
    assert srun.wait_for_hosts(("node7",)) is None


def test_lost_time_is_the_downtime_plus_the_redone_steps(tmp_path: Path) -> None:
    m = _metrics()
    auto = AutoResume(_cfg("run.max_resumes=2"), tmp_path, m)
    t = time.time()
    steps = [{"kind": "learner_step", "weight_version": v, "time": t - 30 + 10 * v} for v in range(1, 4)]
    r = auto.begin(LaunchError("learner", "exited with code -9 (killed)\ntail", lost=True), steps, 1)
    assert r.redo_steps == 2 and r.redo_s == 20.0 and r.cause == "learner: exited with code -9 (killed)"
    assert m.registry.get_sample_value("vapo_launcher_auto_resumes_total") == 1
    auto.after_poll(steps)  # nothing new yet: the clock runs on
    assert auto.pending is r and not (tmp_path / RESUMES_FILE).exists()
    auto.after_poll([*steps, {"kind": "learner_step", "weight_version": 5, "time": time.time()}])
    assert auto.pending is None and r.down_s is not None and r.lost_s >= 20.0
    assert m.registry.get_sample_value("vapo_launcher_resume_lost_seconds_total") == r.lost_s
    line = json.loads((tmp_path / RESUMES_FILE).read_text())
    assert line["checkpoint"] == 1 and line["lost_s"] == r.lost_s
    s = auto.summary()
    assert s["auto_resumes"] == 1 and s["resume_lost_seconds"] == round(r.lost_s, 1)
