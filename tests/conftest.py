"""Shared fixtures: a tiny HF-format model + char tokenizer built once per session (no downloads), and the
session's temporary files kept out of /tmp."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import sockdirs

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _session_temporary_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the tests' processes leave in /tmp, kept out of it: torchrun (every multi-rank test) makes a log
    directory per run there unless told where (``PET_LOG_DIR``: kept with the session's temporary files), and
    the ipc socket directories (``tests/sockdirs.py``) go when the session ends."""
    os.environ.setdefault("PET_LOG_DIR", str(tmp_path_factory.mktemp("torchelastic")))
    yield
    sockdirs.remove_all()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 1-layer Qwen2 with the char tokenizer, saved with save_pretrained."""
    from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf

    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=256, seed=0)
    return save_hf(model, tok, tmp_path_factory.mktemp("models") / "tiny")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``sglang`` need the real server: skipped with the reason where it cannot run, failed
    instead under ``VAPO_REQUIRE_SGLANG=1`` (CI installs SGLang; a skip there would hide a broken install)."""
    if item.get_closest_marker("sglang") is None:
        return
    from ops.sglang_cpu.live import skip_reason

    reason = skip_reason()
    if reason is None:
        return
    if os.environ.get("VAPO_REQUIRE_SGLANG") == "1":
        pytest.fail(f"VAPO_REQUIRE_SGLANG=1 but {reason}", pytrace=False)
    pytest.skip(reason)
