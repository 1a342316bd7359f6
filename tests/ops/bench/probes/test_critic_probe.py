"""ops/bench/probes/critic_probe.py: the first-wrong-digit locator, and both CLI modes end to end on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from common.tasks import get_task
from common.tasks.addition import teacher_response
from ops.bench.probes import critic_probe
from tests.learner.synth import child_env

ROOT = Path(__file__).resolve().parents[4]
PROBE = ("-m", "ops.bench.probes.critic_probe")

SMALL = ["actors.group_size=2", "actors.max_new_tokens=12", "value_pretrain.batch_groups=2", "learner.micro_batch_size=4",
         "task.max_digits=2"]


def test_first_wrong_digit_is_where_the_response_leaves_the_teacher_trace() -> None:
    task = get_task(load_config(None, ["task.max_digits=2"]).task)
    prompt = task.train_prompt(3)
    want = teacher_response(prompt)  # e.g. "08:4+3\n...\nA:..." : line = carry digit, sum digit, ':' ...
    chars = list(want)
    assert critic_probe._first_wrong_digit(prompt, chars) is None  # the correct trace never leaves it
    wrong = chars.copy()
    wrong[1] = str((int(wrong[1]) + 1) % 10)  # the first column's sum digit
    assert critic_probe._first_wrong_digit(prompt, wrong) == 1
    late = chars.copy()
    late[-1] = "x"  # only the last answer character differs
    assert critic_probe._first_wrong_digit(prompt, late) == len(chars) - 1
    assert critic_probe._first_wrong_digit(prompt, chars[:-2]) is None  # stopping early is not a wrong digit


def _run(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, *PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=child_env())  # not this process's torch.distributed rendezvous port
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # trains or scores a critic in a subprocess (~7 s)
def test_train_mode_reports_an_ev_curve_and_plots_values(tiny_model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "groups.bin"
    out = _run(["--model", str(tiny_model_dir), "--train-groups", "4", "--fresh-groups", "3", "--steps", "2",
                "--eval-every", "1", "--threads", "1", "--cache", str(cache), "--plot", str(tmp_path / "v.png"),
                "--variant", "fast:value_pretrain.lr=1e-3", *SMALL])
    assert set(out["variants"]) == {"baseline", "fast"}
    for v in out["variants"].values():
        assert [p["step"] for p in v["curve"]] == [0, 1, 2]
        assert v["final_fresh_ev"] == v["curve"][-1]["fresh_ev"]
    assert out["best_variant"] in ("baseline", "fast")
    assert "mean_value_change_at_first_wrong_digit" in out["plot"] and (tmp_path / "v.png").stat().st_size > 1000
    assert cache.stat().st_size > 0  # sampled groups stored for the next probe


@pytest.mark.slow  # trains or scores a critic in a subprocess (~7 s)
def test_critic_mode_scores_a_saved_critic_on_unseen_prompts(tiny_model_dir: Path, tmp_path: Path) -> None:
    from learner.dist import setup_distributed
    from learner.models import build_critic, save_critic

    cfg = load_config(None, [f"model.path={tiny_model_dir}", *SMALL])
    setup_distributed(cfg)
    saved = save_critic(build_critic(cfg), tmp_path / "critic")
    out = _run(["--model", str(tiny_model_dir), "--critic", str(saved), "--train-groups", "0", "--fresh-groups", "3",
                "--first-index", "100000", "--threads", "1", *SMALL])
    assert out["critic"] == str(saved) and out["first_index"] == 100000 and out["fresh_groups"] == 3
    assert -10 < out["fresh_ev"] <= 1 and 0 <= out["base_reward_mean"] <= 1


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, *PROBE, "--model", str(tmp_path / "nope")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "not found" in p.stderr

