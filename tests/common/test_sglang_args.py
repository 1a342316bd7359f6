"""common.sglang_args, the parts that need no SGLang: an engine's GPUs, the private temp directory's
environment, the CPU KV pool's size and the admin-key config path (the command lines themselves are tested
with the launcher in tests/actors/test_sglang_launcher.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import Config
from common.sglang_args import (
    admin_key_config_path,
    gpu_ids,
    max_total_tokens,
    model_context_length,
    private_tmp_env,
)


def test_engine_gpus_are_consecutive_tp_groups_or_taken_from_the_placement() -> None:
    cfg = Config()
    cfg.engine.sglang_tp_size = 2
    assert [gpu_ids(cfg, i) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    cfg.placement.engine_gpus = "8-11"  # global GPUs on the second host of 8: local ids 0..3
    assert [gpu_ids(cfg, i) for i in range(2)] == [[0, 1], [2, 3]]


def test_the_private_tmpdir_moves_tmpdir_but_not_torchs_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/c")
    assert private_tmp_env("/run/e0") == {"TMPDIR": "/run/e0"}
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    env = private_tmp_env(Path("/run/e0"))
    assert env["TMPDIR"] == "/run/e0" and Path(env["TORCHINDUCTOR_CACHE_DIR"]).name.startswith("torchinductor_")


def test_the_cpu_kv_pool_holds_every_sequence_in_flight(tmp_path: Path) -> None:
    cfg = Config()
    cfg.model.path = str(tmp_path)  # no config.json: context unknown
    cfg.actors.prompts_in_flight, cfg.actors.group_size, cfg.actors.max_new_tokens = 4, 8, 96
    cfg.placement.est_prompt_tokens = 160
    assert max_total_tokens(cfg) == 4 * 8 * (160 + 96)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    assert model_context_length(str(tmp_path)) == 128
    assert max_total_tokens(cfg) == 4 * 8 * 128  # a sequence never outgrows the context
    cfg.engine.sglang_max_total_tokens = 5000
    assert max_total_tokens(cfg) == 5000


def test_the_admin_key_config_sits_beside_the_key_file() -> None:
    assert admin_key_config_path("/run/keys/admin.key") == Path("/run/keys/admin.key.sglang.yaml")
