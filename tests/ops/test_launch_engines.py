"""ops/launch_engines.py: where an SGLang engine started by the launcher keeps its temporary files (the
environment it is given, checked without SGLang: the real server's use of it is
tests/ops/test_sglang_cpu_launch.py's and tests/actors/test_sglang_live.py's), and its Prometheus targets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from common.config import load_config, save_config
from ops import launch
from ops.launch_engines import SGLANG_SOCKET_NAME_LEN, UNIX_SOCKET_PATH_MAX, engine_tmp_dir
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_an_engines_temporary_directory_is_in_the_run_directory_and_starts_empty(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    (run_dir / "tmp" / "vapo-engine-1").mkdir(parents=True)
    (run_dir / "tmp" / "vapo-engine-1" / "tmpabcdefgh").write_text("left by a killed launcher")
    d, note = engine_tmp_dir(run_dir, "engine-1")
    assert d == run_dir / "tmp" / "vapo-engine-1" and note == ""
    assert d.is_dir() and list(d.iterdir()) == []


def test_the_next_start_ends_what_a_killed_launchers_engine_left_running(tmp_path: Path) -> None:
    """Stand-ins for an SGLang scheduler orphaned during its start (the run's engine TMPDIR in its environment):
    ended, and named, when the run starts again; another engine's and another run's processes are left alone."""
    run_dir = tmp_path / "r"
    mine, other_engine, other_run = (
        subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                         env=dict(os.environ, TMPDIR=str(d)))
        for d in (run_dir / "tmp" / "vapo-engine-0", run_dir / "tmp" / "vapo-engine-1",
                  tmp_path / "r2" / "tmp" / "vapo-engine-0"))
    try:
        # Between fork and exec /proc shows this process's environment: wait for the child's own.
        wait_for(lambda: all(b"TMPDIR=" + str(tmp_path).encode() in Path(f"/proc/{p.pid}/environ").read_bytes()
                             for p in (mine, other_engine, other_run)), 10, "the stand-ins to exec")
        d, note = engine_tmp_dir(run_dir, "engine-0")
        assert mine.wait(10) == -signal.SIGKILL
        assert "ended 1 process(es)" in note and f"pids {mine.pid};" in note
        assert other_engine.poll() is None and other_run.poll() is None
        assert engine_tmp_dir(run_dir, "engine-0")[1] == ""  # nothing left: nothing said
    finally:
        for p in (mine, other_engine, other_run):
            p.kill()
            p.wait()


def test_a_run_directory_too_deep_for_a_socket_path_gets_one_in_the_system_temporary_directory(tmp_path: Path) -> None:
    # 107 bytes of a socket path: the run directory's own path is already longer than that.
    deep = tmp_path / ("d" * (UNIX_SOCKET_PATH_MAX - len(str(tmp_path))))
    d, note = engine_tmp_dir(deep, "engine-0")
    try:
        assert d.parent == Path(tempfile.gettempdir()) and d.name.startswith("vapo-engine-0-") and d.is_dir()
        assert "too long a directory for SGLang's socket paths" in note and str(deep / "tmp" / "vapo-engine-0") in note
        assert not (deep / "tmp").exists()
    finally:
        d.rmdir()
    # The bound itself: "/tmp" and 8 random characters after the directory.
    assert SGLANG_SOCKET_NAME_LEN == 12


def test_the_launcher_gives_a_local_sglang_engine_its_run_directorys_tmp_and_removes_it(tmp_path: Path) -> None:
    """The environment vapo starts SGLang with (nothing is started): TMPDIR under the run directory, so its
    ipc sockets and Prometheus multiprocess directory land there; removed, with tmp/, when the run stops."""
    cfg = load_config(ROOT / "ops" / "configs" / "sglang-cpu.yaml", [f"run.root={tmp_path}", "run.name=e",
                                                                    "metrics.prometheus=false"])
    launcher = launch.Launcher(cfg, save_config(cfg).resolve(), False)
    engine = launcher.child("engine-0")
    tmp = Path(engine.env["TMPDIR"])
    assert tmp == (tmp_path / "e" / "tmp" / "vapo-engine-0").resolve() and tmp.is_dir()
    assert "sglang.launch_server" in engine.cmd
    # Torch's compile cache stays where it was (not in tmp): set for the child, or inherited when already set
    # here (a test run earlier in the session, or the user, may have set it).
    cache = engine.env.get("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    assert cache and not cache.startswith(str(tmp))
    (tmp / "tmpabcdefgh").write_text("")  # what SGLang leaves
    launcher.stop_all()  # no child was started: only the temporary files go
    assert not tmp.exists() and not (tmp_path / "e" / "tmp").exists()
    assert (tmp_path / "e" / "config.yaml").is_file()  # the rest of the run directory stays


def test_prometheus_scrapes_every_component_and_each_local_engine(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [f"run.root={tmp_path}", "actors.num_actors=2"])
    launch.write_prometheus_config(cfg, tmp_path / "prometheus.yml")
    jobs = {j["job_name"]: j["static_configs"][0]["targets"]
            for j in yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]}
    host, port = cfg.metrics.host, cfg.engine.base_port
    assert jobs["vapo_engines"] == [f"{cfg.engine.host}:{port}", f"{cfg.engine.host}:{port + 1}"]
    assert jobs["vapo_actors"] == [f"{host}:{cfg.actors.metrics_base_port}", f"{host}:{cfg.actors.metrics_base_port + 1}"]
    assert set(jobs) == {"vapo_buffer", "vapo_learner", "vapo_actors", "vapo_launcher", "vapo_engines"}
