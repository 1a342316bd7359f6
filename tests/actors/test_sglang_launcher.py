"""actors.sglang_launcher: the GPU path's sglang.launch_server command lines, checked against SGLang's flags."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from actors.sglang_launcher import write_admin_key_config
from common.config import ConfigError, load_config
from common.sglang_args import SGLANG_FLAGS_USED, sglang_command

# ServerArgs fields of sgl-project/sglang python/sglang/srt/server_args.py (commit 001067ff), as flags
# (field model_path -> --model-path): host, port, model_path, tokenizer_path, skip_tokenizer_init,
# load_format, context_length, dtype, mem_fraction_static, max_running_requests, max_prefill_tokens,
# tp_size, random_seed, weight_version.
SGLANG_SERVER_ARGS = {
    "--host", "--port", "--model-path", "--tokenizer-path", "--skip-tokenizer-init", "--load-format",
    "--context-length", "--dtype", "--mem-fraction-static", "--max-running-requests", "--max-prefill-tokens",
    "--tp-size", "--random-seed", "--weight-version",
    # SGLang 0.5.23 arg_groups/fields/observability.py: enable_metrics (without it there is no /metrics)
    "--enable-metrics",
    # SGLang 0.5.23 server_args.py: --config, a YAML of further options (utils/server_args_config_parser.py)
    "--config",
}
SGLANG_DTYPES = {"auto", "half", "float16", "bfloat16", "float", "float32"}


def _flags(argv: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            out[a] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
    return out


def test_one_engine_per_gpu_group_with_real_flag_names() -> None:
    cfg = load_config("ops/configs/gpu-small.yaml", [
        "actors.num_actors=2", "engine.sglang_tp_size=2", "engine.base_port=31000", "engine.host=127.0.0.1",
        "model.path=/models/qwen", "engine.sglang_mem_fraction_static=0.5", "engine.context_length=4096",
        "run.seed=7", "engine.sglang_extra_args=[--enable-torch-compile]", "placement.engine_gpus="])
    cmds = [sglang_command(cfg, i) for i in range(2)]
    for i, (argv, env) in enumerate(cmds):
        assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
        assert argv[-1] == "--enable-torch-compile"  # extra args appended verbatim
        flags = _flags(argv[3:-1])
        assert set(flags) <= SGLANG_SERVER_ARGS and set(SGLANG_FLAGS_USED) <= SGLANG_SERVER_ARGS
        assert flags == {
            "--model-path": "/models/qwen", "--host": "127.0.0.1", "--port": str(31000 + i), "--tp-size": "2",
            "--mem-fraction-static": "0.5", "--dtype": "bfloat16", "--random-seed": str(7000 + i),
            "--weight-version": "0", "--context-length": "4096", "--enable-metrics": "",
        }
        assert flags["--dtype"] in SGLANG_DTYPES
        assert env == {"CUDA_VISIBLE_DEVICES": ["0,1", "2,3"][i], "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def test_scaled_logprobs_default_context_and_bad_settings() -> None:
    cfg = load_config(None, ["engine.kind=sglang", "engine.logprobs=scaled", "actors.num_actors=3"])
    argv, env = sglang_command(cfg, 2)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    assert "--context-length" not in argv and _flags(argv[3:])["--port"] == str(cfg.engine.base_port + 2)
    with pytest.raises(ValueError):
        sglang_command(cfg, 3)
    with pytest.raises(ConfigError, match="base_port"):
        sglang_command(load_config(None, ["engine.base_port=0"]), 0)


def test_cli_prints_one_shell_command_per_engine() -> None:
    out = subprocess.run([sys.executable, "-m", "actors.sglang_launcher", "actors.num_actors=2", "engine.kind=sglang"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    assert len(out) == 2
    words = shlex.split(out[1])
    assert words[0] == "CUDA_VISIBLE_DEVICES=1" and "sglang.launch_server" in words
    bad = subprocess.run([sys.executable, "-m", "actors.sglang_launcher", "engine.nope=1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "engine.nope" in bad.stderr


def test_engine_gpus_follow_the_placement() -> None:
    # engine 0: GPUs 0-3 of host 0; engine 1: GPUs 52-55 = host 6's 4-7; engine 2: 56-59 = host 7's 0-3
    cfg = load_config("ops/configs/paper.yaml", ["placement.engine_gpus=0-3,52-63"])
    assert sglang_command(cfg, 0)[1]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert sglang_command(cfg, 1)[1]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert sglang_command(cfg, 2)[1]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_admin_key_reaches_sglang_through_a_private_config_file(tmp_path) -> None:
    """SGLang takes --admin-api-key; on a command line any local user could read it, so it goes in the YAML
    of SGLang's --config (0600), which SGLang's parser turns back into the flag."""
    import json as _json
    import stat

    import yaml

    key_file = tmp_path / "engine.key"
    key_file.write_text("s3cret: with a colon\n")
    cfg = load_config(None, ["engine.kind=sglang", f"engine.admin_api_key_file={key_file}"])
    argv, _ = sglang_command(cfg, 0)
    assert "s3cret" not in " ".join(argv)
    conf = tmp_path / "engine.key.sglang.yaml"
    assert _flags(argv[3:])["--config"] == str(conf) and "--config" in SGLANG_FLAGS_USED
    assert not conf.exists()  # planning (--dry-run) writes nothing; whoever starts the engines does
    assert write_admin_key_config(str(key_file)) == conf
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert yaml.safe_load(conf.read_text()) == {"admin-api-key": "s3cret: with a colon"}
    assert _json.loads(conf.read_text().split(": ", 1)[1]) == "s3cret: with a colon"
    key_file.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        write_admin_key_config(str(key_file))
