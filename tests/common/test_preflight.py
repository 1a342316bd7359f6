"""common.preflight.missing_files: each file a config names and a run would read, checked before the run
starts; every problem is one line led by its config key and naming the missing path. Real files in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import load_config
from common.preflight import can_bootstrap, check_dataset, missing_files
from common.security import generate_run_keys

ROOT = Path(__file__).resolve().parents[2]
# A model the launcher cannot build itself (an SGLang engine on a jsonl task): it must be on disk.
NO_BOOTSTRAP = ["engine.kind=sglang", "task.name=jsonl:data/train.jsonl", "model.path=models/base"]


def _model_and_data(root: Path) -> None:
    (root / "models" / "base").mkdir(parents=True)
    (root / "models" / "base" / "config.json").write_text("{}")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')


def test_the_default_config_needs_nothing_it_cannot_make(tmp_path: Path) -> None:
    cfg = load_config()
    assert can_bootstrap(cfg)  # the tiny addition model is built by learner.sft when missing
    assert missing_files(cfg, tmp_path) == []


def test_a_missing_model_and_task_file_are_named_relative_to_root(tmp_path: Path) -> None:
    cfg = load_config(None, NO_BOOTSTRAP)
    assert not can_bootstrap(cfg)
    problems = missing_files(cfg, tmp_path)
    assert problems == [
        f"model.path: {tmp_path / 'models' / 'base'} has no config.json (a local HF checkpoint; nothing is downloaded)",
        f"task.name: the jsonl file {tmp_path / 'data' / 'train.jsonl'} does not exist",
    ]
    _model_and_data(tmp_path)
    assert missing_files(cfg, tmp_path) == []


def test_absolute_paths_are_not_taken_from_root(tmp_path: Path) -> None:
    _model_and_data(tmp_path)
    cfg = load_config(None, ["engine.kind=sglang", f"model.path={tmp_path / 'models' / 'base'}"])
    assert missing_files(cfg, tmp_path / "elsewhere") == []


def test_named_key_files_must_exist_and_keys_dir_fills_in_the_rest(tmp_path: Path) -> None:
    keys = generate_run_keys(tmp_path / "keys")
    cfg = load_config(None, [f"buffer.curve.keys_dir={keys}", f"buffer.curve.server_secret_key={keys}/server.key_secret"])
    assert missing_files(cfg, tmp_path) == []
    (keys / "learner.key_secret").unlink()
    (keys / "authorized_clients" / "actor.key").unlink()  # the directory is still there
    assert missing_files(cfg, tmp_path) == [
        f"buffer.curve.keys_dir (client_secret_key): file {keys}/learner.key_secret does not exist "
        "(python -m buffer.keys DIR writes a run's keys)"]


def test_a_named_key_that_is_missing_is_led_by_its_own_key(tmp_path: Path) -> None:
    cfg = load_config(None, ["buffer.curve.server_secret_key=keys/server.key_secret",
                             "buffer.curve.authorized_clients_dir=keys/clients"])
    problems = missing_files(cfg, tmp_path)
    assert [p.split(":", 1)[0] for p in problems] == ["buffer.curve.server_secret_key",
                                                      "buffer.curve.authorized_clients_dir"]
    assert f"file {tmp_path / 'keys' / 'server.key_secret'} does not exist" in problems[0]
    assert f"dir {tmp_path / 'keys' / 'clients'} does not exist" in problems[1]
    (tmp_path / "keys" / "clients").mkdir(parents=True)
    (tmp_path / "keys" / "server.key_secret").write_text("")  # preflight checks presence, not contents
    assert missing_files(cfg, tmp_path) == []


@pytest.mark.parametrize("ssh_args, missing", [("-F conf/ssh_config", "conf/ssh_config"), ("-iid/key -p 22", "id/key"),
                                               ("-o BatchMode=yes", None)])
def test_ssh_config_and_identity_files(tmp_path: Path, ssh_args: str, missing: str | None) -> None:
    cfg = load_config(None, [f"placement.ssh_args={ssh_args}"])
    want = [] if missing is None else [f"placement.ssh_args: file {tmp_path / missing} does not exist"]
    assert missing_files(cfg, tmp_path) == want


def test_admin_key_file_and_resume_checkpoint(tmp_path: Path) -> None:
    cfg = load_config(None, ["engine.admin_api_key_file=admin.key", "learner.resume=ckpt/step_10"])
    assert missing_files(cfg, tmp_path) == [
        f"engine.admin_api_key_file: file {tmp_path / 'admin.key'} does not exist",
        f"learner.resume: checkpoint {tmp_path / 'ckpt' / 'step_10'} does not exist",
    ]
    (tmp_path / "admin.key").write_text("k")
    (tmp_path / "ckpt" / "step_10").mkdir(parents=True)  # a checkpoint may be a directory
    assert missing_files(cfg, tmp_path) == []


def test_a_critic_path_without_a_model_is_named(tmp_path: Path) -> None:
    """The launcher builds a missing policy base, never a critic's: a critic_path without config.json is refused."""
    cfg = load_config(None, ["model.critic_path=models/critic"])
    assert missing_files(cfg, tmp_path) == [
        f"model.critic_path: {tmp_path / 'models' / 'critic'} has no config.json (the critic's base is never built "
        "by the launcher: python -m learner.sft CONFIG model.path=DIR builds one)"]
    (tmp_path / "models" / "critic").mkdir(parents=True)
    (tmp_path / "models" / "critic" / "config.json").write_text("{}")
    assert missing_files(cfg, tmp_path) == []


def test_a_dataset_task_is_loaded_and_fitted_before_the_run(tmp_path: Path) -> None:
    """dataset:<path>: a missing path is named; its bad rows are reported (skip) or refused (error), the
    too-long ones found with model.path's tokenizer (the shipped base: 256 positions)."""
    cfg = load_config(None, ["task.name=dataset:data/own.jsonl", f"model.path={ROOT / 'ops/bases/addition-tiny'}",
                             "actors.max_new_tokens=200"])
    assert missing_files(cfg, tmp_path) == [f"task.name: the data set {tmp_path / 'data' / 'own.jsonl'} does not exist"]
    assert check_dataset(cfg, tmp_path) == ([], "")
    (tmp_path / "data").mkdir()
    rows = [{"question": f"Q:{i}+1\n", "answer": str(i + 1)} for i in range(30)]
    rows[3]["answer"] = ""
    rows[8]["question"] = "Q:" + "1+" * 40 + "1\n"  # 84 tokens with BOS > 256 - 200
    (tmp_path / "data" / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert missing_files(cfg, tmp_path) == []
    assert check_dataset(cfg, tmp_path) == (
        [], "2 bad rows of 30: 1 without an answer (row 3), 1 too long for the context (row 8)")
    strict = load_config(None, ["task.name=dataset:data/own.jsonl", f"model.path={cfg.model.path}",
                                "actors.max_new_tokens=200", "task.bad_rows=error"])
    problems, _ = check_dataset(strict, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("task.name: dataset:") and "1 without an answer (row 3)" in problems[0]


def test_a_users_reward_file_must_exist(tmp_path: Path) -> None:
    cfg = load_config(None, ["task.reward=file:rewards/r.py:compute_score",
                             "task.reward_by_source={gsm8k: boxed, mine: 'file:rewards/mine.py:score'}"])
    assert missing_files(cfg, tmp_path) == [
        f"task.reward: file {tmp_path / 'rewards' / 'r.py'} does not exist",
        f"task.reward_by_source['mine']: file {tmp_path / 'rewards' / 'mine.py'} does not exist",
    ]
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "r.py").write_text("")
    (tmp_path / "rewards" / "mine.py").write_text("")
    assert missing_files(cfg, tmp_path) == []
