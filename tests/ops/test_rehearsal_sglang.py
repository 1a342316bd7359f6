"""The rehearsal's SGLang parts that need neither root nor a running engine: a disk version's tensors as
SGLang holds them (fused, vocabulary padded) and the digest its ``/weights_checker`` answers, the engines'
start read from their logs, which processes are an engine's, and the directories engines leave."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.generation.weights import read_state_dict
from ops.rehearsal import sglang
from ops.rehearsal.cluster import ENGINE_TMP_PREFIX, engine_tmps_left, engine_tmps_of, proc_environ
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]

# per_engine_checksum of SGLang 0.5.23's /weights_checker (action checksum) on a CPU engine serving the shipped
# ops/bases/addition-tiny (captured from the live server; the rehearsal compares each engine with this rule).
BASE_DIGEST = "8c18e78ac37fe6bb7f8e94fe06a6f6e5c6c2bf97e66238fb32d00902a1d1d20d"


def test_the_shipped_base_digests_as_sglang_answered_for_it() -> None:
    assert sglang.expected_digest(ROOT / "ops/bases/addition-tiny") == BASE_DIGEST


def test_sglang_names_fused_and_padded() -> None:
    state = {
        "model.embed_tokens.weight": torch.ones(89, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.full((4, 4), 1.0),
        "model.layers.0.self_attn.k_proj.weight": torch.full((2, 4), 2.0),
        "model.layers.0.self_attn.v_proj.weight": torch.full((2, 4), 3.0),
        "model.layers.0.self_attn.q_proj.bias": torch.zeros(4),
        "model.layers.0.self_attn.k_proj.bias": torch.ones(2),
        "model.layers.0.self_attn.v_proj.bias": torch.ones(2),
        "model.layers.0.mlp.up_proj.weight": torch.full((6, 4), 5.0),
        "model.layers.0.mlp.gate_proj.weight": torch.full((6, 4), 4.0),
        "model.norm.weight": torch.ones(4),
        "lm_head.weight": torch.ones(89, 4),
    }
    out = sglang.sglang_state(state, tied=True)
    assert sorted(out) == ["model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight",
                           "model.layers.0.self_attn.qkv_proj.bias", "model.layers.0.self_attn.qkv_proj.weight",
                           "model.norm.weight"]
    qkv = out["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (8, 4) and qkv[:4].eq(1).all() and qkv[4:6].eq(2).all() and qkv[6:].eq(3).all()
    gate_up = out["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up[:6].eq(4).all() and gate_up[6:].eq(5).all()  # gate first, whatever the checkpoint's order
    emb = out["model.embed_tokens.weight"]
    assert emb.shape == (128, 4) and emb[:89].eq(1).all() and emb[89:].eq(0).all()
    assert "lm_head.weight" in sglang.sglang_state(state, tied=False)
    del state["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match="qkv_proj"):
        sglang.sglang_state(state, tied=True)


def test_a_different_version_digests_differently(tmp_path: Path) -> None:
    base = ROOT / "ops/bases/addition-tiny"
    state = read_state_dict(base)
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    (tmp_path / "v1").mkdir()
    save_file(state, str(tmp_path / "v1" / "model.safetensors"))
    (tmp_path / "v1" / "config.json").write_text((base / "config.json").read_text())
    assert sglang.expected_digest(tmp_path / "v1") != BASE_DIGEST


def test_engine_start_from_the_launcher_line_to_sglang_ready(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "engine-0.log").write_text(
        "\n=== 23:59:50 start: ssh h2 ...\n[2026-12-04 00:00:01] Load weight begin.\n"
        "[2026-12-04 00:01:40] The server is fired up and ready to roll!\n"
        "=== 00:05:00 start: ssh h2 ...\n[2026-12-04 00:06:00] The server is fired up and ready to roll!\n")
    (logs / "engine-1.log").write_text("\n=== 10:00:00 start: ssh h3 ...\nTraceback: it never came up\n")
    assert sglang.engine_start_seconds(tmp_path) == {"engine-0": 110.0, "engine-1": None}


def test_which_processes_are_an_engine() -> None:
    server = ["/v/python", "-m", "sglang.launch_server", "--model-path", "m", "--port", "30000"]
    assert sglang.is_engine(server)
    assert not sglang.is_engine(["/v/python", "-m", "common.remote", "--timeout", "15", "--", *server])
    assert sglang.is_engine_part(b"sglang::scheduler\0") and sglang.is_engine_part("\0".join(server).encode())
    assert not sglang.is_engine_part(b"/v/python\0-m\0common.remote\0--\0/v/python\0-m\0sglang.launch_server")
    assert not sglang.is_engine_part(b"/v/python\0-m\0actors\0cfg.yaml")
    assert sglang.overrides("rollout_server") == []
    assert "engine.kind=sglang" in sglang.overrides("sglang")


def test_engine_directories_are_read_from_each_process_environment(tmp_path: Path) -> None:
    """The rehearsal finds an engine's private TMPDIR in its process's environment (``/proc/<pid>/environ``),
    and counts as left over only such a directory that no living process runs in."""
    live, left = tmp_path / f"{ENGINE_TMP_PREFIX}0-live", tmp_path / f"{ENGINE_TMP_PREFIX}1-left"
    live.mkdir()
    left.mkdir()
    procs = [subprocess.Popen(["sleep", "600"], env={**os.environ, "TMPDIR": tmp}) for tmp in (str(live), "/tmp")]
    try:
        for q in procs:  # Popen can return before the child's exec: its environment is the new one after it
            wait_for(lambda q=q: Path(f"/proc/{q.pid}/cmdline").read_bytes().startswith(b"sleep"), 10, "sleep's exec")
        assert proc_environ(procs[1].pid)["TMPDIR"] == "/tmp"
        assert engine_tmps_of([p.pid for p in procs]) == {live}
        assert engine_tmps_left(set(), tmp_path) == [str(left)]
        assert engine_tmps_left({left}, tmp_path) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
    with pytest.raises(OSError):
        proc_environ(procs[0].pid)
