"""ops/bench/probes/value_curve.py: locating the first mistake of a response, picking the newest version, CLI errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import yaml

from common.config import TaskConfig
from common.tasks import Prompt, get_task

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def vc() -> ModuleType:
    from ops.bench.probes import value_curve as mod
    return mod


def test_first_mistake_is_the_first_token_off_the_correct_trace(vc: ModuleType) -> None:
    task = get_task(TaskConfig(name="chain"))
    p = Prompt("x", "Q:3+7x03\n", "4")  # correct: "02:3+7=0\n01:0+7=7\n00:7+7=4\nA:4"
    assert vc.first_mistake(task, p, list("02:3+7=0\n01:0+7=7\n00:7+7=4\nA:4")) is None
    # A slip in the second line's result: token 16 ('8' for '7'); everything after follows from it.
    assert vc.first_mistake(task, p, list("02:3+7=0\n01:0+7=8\n00:8+7=5\nA:5")) == 16
    assert vc.first_mistake(task, p, list("02:3+7=1\n01:1+7=8\n00:8+7=5\nA:5")) == 7
    # The index is the token's, whatever its width; a wrong last token is not a step mistake (only the answer).
    assert vc.first_mistake(task, p, ["02:3", "+7=0\n", "01:0+7=8", "\n00:8+7=5"]) == 2
    assert vc.first_mistake(task, p, ["02:3", "+7=0\n", "01:0+7=8"]) is None
    assert vc.first_mistake(task, p, list("02:3+7=0\n01:0+7=7\n00:7+7=4\nA:5")) is None


def test_newest_version_is_numeric_not_lexical(vc: ModuleType, tmp_path: Path) -> None:
    for v in ("v9", "v10", "v2", "vx", "latest"):
        (tmp_path / v).mkdir()
    assert vc.newest(tmp_path).name == "v10"
    with pytest.raises(FileNotFoundError):
        vc.newest(tmp_path / "v2")


@pytest.mark.slow  # a probe's CLI in subprocesses (~12 s)
def test_cli_refuses_what_it_cannot_probe(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "ops.bench.probes.value_curve", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "has no config.yaml" in bad.stderr
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algo": {"advantage": "grpo"}}))
    bad = subprocess.run([sys.executable, "-m", "ops.bench.probes.value_curve", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "without a critic" in bad.stderr



def test_the_mistake_line_and_its_share_of_the_advantage(vc: ModuleType) -> None:
    text = list("02:3+7=0\n01:0+7=8\n00:8+7=5\nA:5")
    assert vc.line_span(text, 16) == (9, 18)  # "01:0+7=8\n": the slip and its line
    assert vc.line_span(text, 2) == (0, 9) and vc.line_span(text, 28) == (27, 30)  # first line; the answer line
    c = vc.credit_on_line(np.array([0.5, 0.5, -2.0, -1.0, 0.0, 0.0]), (2, 4))
    assert c == {"share": 0.75, "uniform": 2 / 6, "line_mean": -1.5, "before_mean": 0.5, "after_mean": 0.0}


def test_actor_advantages_follow_lambda_actor(vc: ModuleType) -> None:
    """A failed response (score 0) whose value falls 0.6 at its second token: with λ = 0 (α·l ≤ 1) the
    advantage is the one-step TD error, all of the drop on that token; with λ = 1 every token gets R − V."""
    import torch

    batch = SimpleNamespace(lengths=torch.tensor([4]), scores=torch.tensor([0.0]), mask=torch.ones(1, 4))
    values = torch.tensor([[0.8, 0.8, 0.2, 0.2]])
    algo = SimpleNamespace(alpha=0.25, length_adaptive=True, lambda_actor=0.95, gamma=1.0, whiten_advantages=False)
    td = vc.actor_advantages(values, batch, algo)[0]
    assert np.allclose(td, [0.0, -0.6, 0.0, -0.2])
    assert vc.credit_on_line(td, (1, 2))["share"] == pytest.approx(0.75)  # 3 times the uniform 0.25
    mc = vc.actor_advantages(values, batch, SimpleNamespace(**{**vars(algo), "length_adaptive": False, "lambda_actor": 1.0}))[0]
    assert np.allclose(mc, [-0.8, -0.8, -0.2, -0.2]) and vc.credit_on_line(mc, (1, 2))["share"] == pytest.approx(0.4)
    whitening = SimpleNamespace(**{**vars(algo), "whiten_advantages": True})
    raw = vc.actor_advantages(values, batch, whitening)
    assert np.allclose(raw, td)  # the probe's raw_* figures: the run whitens, the critic's credit is before it
    white = vc.as_trained(raw, batch, whitening)[0]
    assert abs(white.mean()) < 1e-6 and np.allclose(white, (td - td.mean()) / td.std(ddof=1), atol=1e-4)
    assert vc.as_trained(raw, batch, algo) is raw  # a run that does not whiten trains on the raw advantages
