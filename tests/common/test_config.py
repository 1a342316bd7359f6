"""common.config: YAML + dotted overrides, strict errors naming the key, round trip, shipped configs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import Config, ConfigError, describe, dump_yaml, load_config, save_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_validate_and_every_field_is_documented() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    rows = describe()
    assert len(rows) > 80
    undocumented = [key for key, _, _, doc in rows if not doc.strip()]
    assert undocumented == []


def test_yaml_then_overrides(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("learner:\n  total_steps: 7\n  actor_lr: 1.0e-3\nalgo:\n  alpha: 1\n")
    cfg = load_config(p, ["learner.total_steps=9", "learner.critic_lr=3e-4", "run.name=x", "buffer.filter_uniform_groups=true"])
    assert cfg.learner.total_steps == 9  # override beats file
    assert cfg.learner.actor_lr == 1e-3
    assert cfg.learner.critic_lr == 3e-4  # YAML would read "3e-4" as a string; the float field coerces
    assert cfg.algo.alpha == 1.0 and isinstance(cfg.algo.alpha, float)  # int accepted for float
    assert cfg.run.name == "x" and cfg.run_dir == Path("runs/x")
    assert cfg.buffer.filter_uniform_groups is True
    assert cfg.engine.urls == []
    assert load_config(None, ["engine.urls=[http://a:1, http://b:2]"]).engine.urls == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["learner.bogus=1"], "learner.bogus: unknown config key"),
        (["bogus.x=1"], "bogus: unknown config key"),
        (["learner.total_steps=abc"], "learner.total_steps: expected an int"),
        (["learner.total_steps=1.5"], "learner.total_steps: expected an int"),
        (["buffer.filter_uniform_groups=3"], "buffer.filter_uniform_groups: expected a bool"),
        (["learner=3"], "learner: expected a mapping"),
        (["engine.urls=notalist"], "engine.urls: expected a list"),
        (["algo.loss_agg=mean"], "algo.loss_agg: 'mean' is not one of"),
        (["algo.clip_low=1.5"], "algo.clip_low"),
        (["buffer.max_staleness=-1"], "buffer.max_staleness"),
        (["noequals"], "expected key=value"),
        (["actors.temperature=0.7"], "actors.temperature: 0.7 needs engine.logprobs=scaled"),
        (["algo.critic=oracle"], "algo.critic: oracle needs task.name=chain"),
        (["algo.critic=psychic"], "algo.critic: 'psychic' is not one of"),
        (["learner.value_head_surprise=true", "learner.value_head_surprise_source=frozen_base", "learner.zero_stage=3"],
         "learner.value_head_surprise_source: frozen_base keeps a whole frozen copy"),
    ],
)
def test_errors_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_unknown_key_in_yaml_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("actors:\n  group_sizee: 4\n")
    with pytest.raises(ConfigError, match=r"actors.group_sizee: unknown config key \(did you mean group_size\?\)"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "ops/configs/smoke.yaml", ["run.root=" + str(tmp_path), "engine.urls=[u]"])
    path = save_config(cfg)
    assert path == tmp_path / "smoke" / "config.yaml"
    back = load_config(path)
    assert dataclasses.asdict(back) == dataclasses.asdict(cfg)
    assert dump_yaml(back) == dump_yaml(cfg)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "ops/configs").glob("*.yaml")))
def test_shipped_configs_load(name: str) -> None:
    load_config(ROOT / "ops/configs" / name)


def test_cli_help_and_error_exit_codes() -> None:
    out = subprocess.run([sys.executable, "-m", "common.config", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "algo.alpha" in out.stdout and "length-adaptive" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "common.config", "x.y=1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "x: unknown config key" in bad.stderr


@pytest.mark.parametrize(("override", "hint"), [
    ("learner.lr=1e-6", "did you mean actor_lr, critic_grown_lr_scale, critic_lr, value_head_lr_scale?"),       # a word of the known keys
    ("learner.total_step=3", "did you mean total_steps?"),           # a near spelling
    ("buffer.max_stalenes=1", "did you mean max_staleness?"),
])
def test_unknown_key_suggests_the_nearest_known_ones(override: str, hint: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).endswith(f"unknown config key ({hint})"), str(e.value)


def test_metrics_on_a_non_loopback_address_need_a_stated_protection() -> None:
    """/metrics has no authentication: metrics.host=0.0.0.0 alone would show every process's metrics to
    anyone who reaches the node."""
    with pytest.raises(ConfigError, match=r"metrics.host: '0.0.0.0' is not a loopback address.*metrics.bind_protection"):
        load_config(None, ["metrics.host=0.0.0.0"])
    cfg = load_config(None, ["metrics.host=0.0.0.0", "metrics.bind_protection=firewall"])
    assert cfg.metrics.bind_protection == "firewall"
    assert load_config(None, ["metrics.host=0.0.0.0", "metrics.prometheus=false"]).metrics.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="metrics.bind_protection"):
        load_config(None, ["metrics.host=0.0.0.0", "metrics.bind_protection=hope"])


def test_trackers_are_a_list_of_known_names_from_a_file_or_the_command_line(tmp_path: Path) -> None:
    assert load_config(None, []).metrics.trackers == []  # none unless asked for
    cfg = load_config(None, ["metrics.trackers=[tensorboard,wandb]"])
    assert cfg.metrics.trackers == ["tensorboard", "wandb"] and cfg.metrics.wandb_mode == "offline"
    p = tmp_path / "c.yaml"
    p.write_text("metrics:\n  trackers: [wandb]\n  wandb_mode: online\n  wandb_project: mine\n")
    cfg = load_config(p)
    assert (cfg.metrics.trackers, cfg.metrics.wandb_mode, cfg.metrics.wandb_project) == (["wandb"], "online", "mine")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["metrics.trackers=[tensorboard,mlflow]"])
    assert str(e.value) == "metrics.trackers: 'mlflow' is not one of tensorboard, wandb"
    with pytest.raises(ConfigError, match="metrics.trackers: expected a list"):
        load_config(None, ["metrics.trackers=tensorboard"])
    with pytest.raises(ConfigError, match="metrics.wandb_mode: 'cloud' is not one of offline, online"):
        load_config(None, ["metrics.wandb_mode=cloud"])
