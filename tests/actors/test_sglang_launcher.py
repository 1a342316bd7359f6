"""actors.sglang_launcher and common.sglang_args: sglang.launch_server command lines on GPUs and on the CPU,
checked against SGLang's flags."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from actors.sglang_launcher import write_admin_key_config
from common import sglang_args
from common.config import ConfigError, load_config
from common.sglang_args import (
    SGLANG_FLAGS_USED,
    max_total_tokens,
    private_tmp_env,
    radix_cache_kept,
    sglang_command,
)

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
    # SGLang 0.5.23 arg_groups/fields: memory.py disable_radix_cache; device.py device, sleep_on_idle;
    # exec_.py attention_backend; schedule.py max_total_tokens, disable_overlap_schedule
    "--disable-radix-cache", "--device", "--sleep-on-idle", "--attention-backend", "--max-total-tokens",
    "--disable-overlap-schedule",
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
        "actors.num_actors=2", "actors.push_pause=retract", "engine.sglang_tp_size=2", "engine.base_port=31000",
        "engine.host=127.0.0.1",
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
        }  # a push paused with retract can flush the radix cache: kept
        assert flags["--dtype"] in SGLANG_DTYPES
        assert env == {"CUDA_VISIBLE_DEVICES": ["0,1", "2,3"][i], "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def test_scaled_logprobs_default_context_and_bad_settings() -> None:
    cfg = load_config(None, ["run.device=cuda", "engine.kind=sglang", "engine.logprobs=scaled", "actors.num_actors=3"])
    argv, env = sglang_command(cfg, 2)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    assert "--device" not in argv and "--max-total-tokens" not in argv
    assert "--disable-radix-cache" not in argv  # disk updates drain the engine, then flush
    assert "--context-length" not in argv and _flags(argv[3:])["--port"] == str(cfg.engine.base_port + 2)
    with pytest.raises(ValueError):
        sglang_command(cfg, 3)
    with pytest.raises(ConfigError, match="base_port"):
        sglang_command(load_config(None, ["engine.base_port=0"]), 0)


def test_cli_prints_one_shell_command_per_engine() -> None:
    out = subprocess.run([sys.executable, "-m", "actors.sglang_launcher", "actors.num_actors=2", "engine.kind=sglang",
                          "run.device=cuda"],
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
    # SGLang 0.5.23 makes "--admin-api-key -7TKa..." of such a key, and its argparse stops on "expected one argument"
    key_file.write_text("-7TKa9ZfJtQWzlpB7Vcv\n")
    with pytest.raises(ConfigError, match="starts with '-'"):
        write_admin_key_config(str(key_file))


def test_cpu_form_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """run.device=cpu: SGLang's CPU engine with the flags a small shared CPU host needs, no CUDA variables."""
    monkeypatch.setattr(sglang_args, "amx_path_available", lambda: False)
    cfg = load_config("ops/configs/sglang-cpu.yaml", ["engine.base_port=31700", "engine.threads=2"])
    argv, env = sglang_command(cfg, 0)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = _flags(argv[3:])
    assert set(flags) <= SGLANG_SERVER_ARGS and set(SGLANG_FLAGS_USED) <= SGLANG_SERVER_ARGS
    assert flags == {
        "--model-path": "ops/bases/addition-tiny", "--host": "127.0.0.1", "--port": "31700", "--tp-size": "1",
        "--mem-fraction-static": "0.8", "--dtype": "float32", "--random-seed": "0", "--weight-version": "0",
        "--enable-metrics": "", "--device": "cpu", "--attention-backend": "torch_native",
        "--disable-overlap-schedule": "", "--sleep-on-idle": "",
        # 16 prompts in flight x 8 samples x min(256 + 96, the base's 256 positions)
        "--max-total-tokens": str(16 * 8 * 256),
    }
    assert env == {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    monkeypatch.setattr(sglang_args, "amx_path_available", lambda: True)  # AMX tiles and SGLang's compiled kernels
    assert _flags(sglang_command(cfg, 0)[0][3:])["--attention-backend"] == "intel_amx"
    extra = load_config("ops/configs/sglang-cpu.yaml", ["engine.sglang_extra_args=[--attention-backend,torch_native]"])
    assert sglang_command(extra, 0)[0][-2:] == ["--attention-backend", "torch_native"]  # last: argparse keeps it


def test_a_private_tmpdir_leaves_torchs_compile_cache_where_torch_puts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """TMPDIR moves SGLang's temporary files; torch's inductor cache, whose default follows TMPDIR, is pinned to
    the default torch computes here (a private one would be cold at every start), unless the user set one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = private_tmp_env("/tmp/vapo-engine-0-x")
    assert env == {"TMPDIR": "/tmp/vapo-engine-0-x", "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/inductor")
    assert private_tmp_env("/tmp/e") == {"TMPDIR": "/tmp/e"}  # the user's own: inherited, not overridden


def test_amx_path_is_detected_not_assumed() -> None:
    """The AMX attention backend only where SGLang's own test would pass: AMX tiles and a compiled sgl_kernel
    (vapo's pure-torch stub registers no convert_weight_packed)."""
    import importlib.util

    import torch

    expected = False
    if torch.cpu._is_amx_tile_supported() and importlib.util.find_spec("sgl_kernel") is not None:
        import sgl_kernel  # noqa: F401

        expected = hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    sglang_args.amx_path_available.cache_clear()
    assert sglang_args.amx_path_available() is expected


def test_kv_pool_size(tmp_path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 4096}')
    base = [f"model.path={model}", "actors.prompts_in_flight=4", "actors.group_size=2", "actors.max_new_tokens=100",
            "placement.est_prompt_tokens=50"]
    assert max_total_tokens(load_config(None, base)) == 4096  # 4 x 2 x 150 = 1200 < one full context
    assert max_total_tokens(load_config(None, [*base, "actors.prompts_in_flight=64"])) == 64 * 2 * 150
    assert max_total_tokens(load_config(None, [*base, "engine.context_length=100"])) == 4 * 2 * 100
    assert max_total_tokens(load_config(None, [*base, "engine.sglang_max_total_tokens=777"])) == 777
    assert max_total_tokens(load_config(None, ["model.path=/nonexistent", "actors.prompts_in_flight=2",
                                               "actors.group_size=2", "actors.max_new_tokens=10",
                                               "placement.est_prompt_tokens=5"])) == 2 * 2 * 15
    with pytest.raises(ConfigError, match="sglang_max_total_tokens"):
        sglang_command(load_config(None, ["engine.kind=sglang", "engine.sglang_max_total_tokens=-1"]), 0)
    gpu = load_config(None, ["run.device=cuda", "engine.kind=sglang", "engine.sglang_max_total_tokens=5000"])
    assert _flags(sglang_command(gpu, 0)[0][3:])["--max-total-tokens"] == "5000"


@pytest.mark.parametrize(("overrides", "kept"), [
    ([], True),                                        # disk, weight_sync=wait: SGLang drains, then flushes
    (["actors.weight_sync=abort"], True),
    (["learner.weight_transport=distributed"], False),  # push_pause=in_place: every flush refused
    (["learner.weight_transport=distributed", "actors.push_pause=retract"], True),
    (["learner.weight_transport=distributed", "actors.push_pause=abort"], True),
    (["learner.weight_transport=distributed", "actors.push_pause=none"], True),  # drained before each bucket
    (["learner.weight_transport=distributed", "engine.sglang_radix_cache=enabled"], True),
    (["engine.sglang_radix_cache=disabled"], False),
])
def test_radix_cache_only_where_every_update_can_flush_it(overrides: list[str], kept: bool) -> None:
    cfg = load_config(None, ["engine.kind=sglang", *overrides])
    assert radix_cache_kept(cfg) is kept
    assert ("--disable-radix-cache" in sglang_command(cfg, 0)[0]) is not kept


def test_radix_cache_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="engine.sglang_radix_cache"):
        sglang_command(load_config(None, ["engine.kind=sglang", "engine.sglang_radix_cache=sometimes"]), 0)
