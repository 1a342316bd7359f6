"""The SGLang CPU launch option (``ops/configs/sglang-cpu.yaml``): its config against the default's, its
engine command against SGLang's own parser, the launcher's stop at once when SGLang is missing, and (marked
``sglang``) the launcher starting a real engine, waiting for it and stopping its whole process group and removing
its temporary files."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from common.config import load_config, save_config
from common.placement import build_plan
from ops import launch_engines
from tests.common.placement_fixtures import QWEN_05B
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SGLANG_CPU = ROOT / "ops" / "configs" / "sglang-cpu.yaml"


@pytest.fixture(scope="module")
def launch() -> ModuleType:
    from ops import launch as mod
    return mod


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_config_is_the_default_workload_on_sglang_engines() -> None:
    """Only the run's name and the engine differ from ops/configs/default.yaml (the shared sections in sync)."""
    default = _flat(dataclasses.asdict(load_config(ROOT / "ops/configs/default.yaml")))
    sglang = _flat(dataclasses.asdict(load_config(SGLANG_CPU)))
    differ = {k for k in default if default[k] != sglang[k]}
    assert differ == {"run.name", "engine.kind"}, differ
    assert sglang["engine.kind"] == "sglang" and sglang["run.device"] == "cpu"
    assert sglang["learner.weight_transport"] == "disk"


def test_sglang_parses_the_engine_command_the_launcher_starts() -> None:
    """The plan's engine argv through the installed SGLang's own argument parser (skipped without SGLang)."""
    import argparse

    server_args = pytest.importorskip("sglang.srt.server_args")
    cfg = load_config(SGLANG_CPU)
    plan = build_plan(cfg, "/tmp/sglang-cpu/config.yaml")
    (engine,) = [p for p in plan.procs if p.role == "engine"]
    assert engine.env["SGLANG_USE_CPU_ENGINE"] == "1" and "CUDA_VISIBLE_DEVICES" not in engine.env
    ap = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(ap)
    ns = ap.parse_args(engine.argv[engine.argv.index("sglang.launch_server") + 1:])
    assert (ns.device, ns.dtype, ns.port) == ("cpu", "float32", cfg.engine.base_port)
    assert ns.attention_backend in ("torch_native", "intel_amx")
    assert ns.sleep_on_idle and ns.disable_overlap_schedule and ns.enable_metrics
    assert not ns.disable_radix_cache  # disk updates drain the engine and flush the cache
    assert ns.max_total_tokens == 16 * 8 * 256


def test_missing_sglang_stops_the_launch_at_once(launch: ModuleType, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A venv without SGLang: one line naming ops/setup.sh --sglang, exit 2, nothing started or written."""
    monkeypatch.setattr(launch_engines, "SGLANG_MODULES", ("vapo_no_such_module_for_this_test",))
    t0 = time.monotonic()
    rc = launch.main([str(SGLANG_CPU), f"run.root={tmp_path}", "run.name=nosglang"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and time.monotonic() - t0 < 30
    assert len(err.splitlines()) == 1 and "run ops/setup.sh --sglang" in err
    assert "vapo_no_such_module_for_this_test" in err
    assert not (tmp_path / "nosglang").exists()


def test_install_check_names_the_setup_of_the_device(launch: ModuleType) -> None:
    eng = launch_engines
    assert eng.missing_modules(sys.executable, ("json", "vapo_no_such_module_for_this_test")) == [
        "vapo_no_such_module_for_this_test"]
    gone = ("vapo_no_such_module_for_this_test",)
    gpu = load_config(ROOT / "ops/configs/gpu-small.yaml", ["model.path=/models/qwen"])
    plan = build_plan(gpu, "/tmp/x/config.yaml", hf_config=QWEN_05B)
    assert "run ops/setup.sh --cuda" in eng.sglang_install_problem(gpu, plan, gone)
    default = load_config(ROOT / "ops/configs/default.yaml")
    assert eng.sglang_install_problem(default, build_plan(default, "/tmp/x/config.yaml"), gone) is None


def _group_pids(pgid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.add(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.sglang
def test_launcher_starts_a_real_engine_and_stops_its_process_group(launch: ModuleType, tmp_path: Path) -> None:
    port = free_port()
    cfg = load_config(SGLANG_CPU, [f"run.root={tmp_path}", "run.name=engine", f"engine.base_port={port}",
                                   "metrics.prometheus=false"])
    launcher = launch.Launcher(cfg, save_config(cfg).resolve(), False)
    try:
        launcher.start_engines()  # returns once /health answers (a one-token generation in SGLang)
        engine = launcher.children["engine-0"]
        assert launch.http_ok(f"http://127.0.0.1:{port}/health", 60)
        pids = _group_pids(engine.proc.pid)
        assert len(pids) >= 3, pids  # the HTTP server, its scheduler and detokenizer
        log = (tmp_path / "engine" / "logs" / "engine-0.log").read_text()
        assert "sglang.launch_server" in log and "--sleep-on-idle" in log
        # SGLang's ZeroMQ ipc sockets (which it never removes) in the engine's own TMPDIR in the run directory
        # (in the system's only where the run directory is too deep for a socket path)
        tmp = Path(engine.env["TMPDIR"])
        here = launcher.run_dir / "tmp" / "vapo-engine-0"
        if len(str(here)) + launch_engines.SGLANG_SOCKET_NAME_LEN <= launch_engines.UNIX_SOCKET_PATH_MAX:
            assert tmp == here
        else:
            assert tmp.parent == Path(tempfile.gettempdir()) and tmp.name.startswith("vapo-engine-0-")
        sockets = [f.name for f in tmp.iterdir() if f.is_socket()]
        assert len(sockets) >= 3, sorted(f.name for f in tmp.iterdir())  # tokenizer, scheduler, detokenizer
    finally:
        t0 = time.monotonic()
        launcher.stop_all()
    assert time.monotonic() - t0 < launch.STOP_GRACE_S + 5
    left = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
    assert not left, left
    assert not tmp.exists()  # removed with the engine


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
