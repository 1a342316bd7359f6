"""actors.rollout_server's guards: the admin API key on control endpoints, pauses visible in /health and
/ready, bounds checked on the raw body before it is parsed, weights read only from regular files of a
float dtype, one log line per malformed request, SIGTERM honoured. Real subprocesses, real HTTP."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from actors.rollout_server.process import ADMIN_KEY_ENV
from tests.actors.http_fixtures import call, message
from tests.actors.servers import start_rollout_server
from tests.polling import wait_for

KEY = "k3y-for-this-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _admin_server(model_dir: Path, log_dir: Path, *extra: str):
    os.environ[ADMIN_KEY_ENV] = KEY  # how a worker passes it: never on the command line
    try:
        return start_rollout_server(model_dir, log_dir, "--weight-version", "0", *extra)
    finally:
        del os.environ[ADMIN_KEY_ENV]


def test_control_endpoints_need_the_admin_key_and_a_pause_shows_in_health(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = _admin_server(tiny_model_dir, tmp_path)
    try:
        assert KEY not in Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().decode()
        for path, body in (("/pause_generation", {"mode": "abort"}), ("/abort_request", {"abort_all": True}),
                           ("/update_weights_from_disk", {"model_path": str(tiny_model_dir)}),
                           ("/continue_generation", {}), ("/flush_cache", {})):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                status, answer = call(srv.url, path, body, headers=headers)
                assert (status, answer) == (401, {"error": "Unauthorized"}), (path, headers)
        # open endpoints: generation, model info, health, metrics
        assert call(srv.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})[0] == 200
        assert call(srv.url, "/model_info")[0] == 200 and call(srv.url, "/health")[0] == 200
        assert call(srv.url, "/ready")[0] == 200
        assert call(srv.url, "/pause_generation", {"mode": "in_place"}, headers=AUTH)[0] == 200
        status, text = call(srv.url, "/health")
        assert status == 503 and "paused (mode=in_place)" in text
        assert call(srv.url, "/ready")[0] == 503
        assert call(srv.url, "/continue_generation", {}, headers=AUTH)[0] == 200
        assert call(srv.url, "/health")[0] == 200 and call(srv.url, "/ready")[0] == 200
        metrics = call(srv.url, "/metrics")[1]
        assert 'vapo_engine_control_requests_total{endpoint="pause_generation",status="unauthorized"} 3.0' in metrics
        assert 'vapo_engine_control_requests_total{endpoint="pause_generation",status="ok"} 1.0' in metrics
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert log.count("/abort_request unauthorized from 127.0.0.1") == 3


def test_seven_million_one_token_prompts_are_refused_before_parsing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A 26.7 MiB body of 7,000,000 one-token prompts: 400 in under a second, RSS up by < 100 MB, and /health
    answering all along (parsed first, it took 48 s and 4 GB)."""
    srv = start_rollout_server(tiny_model_dir, tmp_path, "--weight-version", "0")
    n = 7_000_000
    body = b'{"input_ids":[' + b"[1]," * (n - 1) + b'[1]],"sampling_params":{"max_new_tokens":0}}'
    assert 26 << 20 < len(body) < 32 << 20
    pid = srv.proc.pid
    try:
        assert call(srv.url, "/health")[0] == 200
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak-RSS mark
        base_kib = _status_kib(pid, "VmRSS")
        worst_health = [0.0]
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                t = time.monotonic()
                assert call(srv.url, "/health", timeout=10)[0] == 200
                worst_health[0] = max(worst_health[0], time.monotonic() - t)

        prober = threading.Thread(target=probe)
        prober.start()
        t0 = time.monotonic()
        status, answer = call(srv.url, "/generate", raw=body, timeout=120)
        took = time.monotonic() - t0
        stop.set()
        prober.join(30)
        peak_kib = _status_kib(pid, "VmHWM")
    finally:
        srv.stop()
    assert status == 400 and "--max-prompts-per-request" in message(answer), answer
    assert took < 1.0, took
    assert (peak_kib - base_kib) / 1024 < 100, (base_kib, peak_kib)
    assert worst_health[0] < 1.0


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key}")


def test_many_values_in_one_prompt_are_refused_before_parsing(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_rollout_server(tiny_model_dir, tmp_path, "--weight-version", "0", "--max-queued-tokens", "1000")
    try:
        body = b'{"input_ids":[' + b"1," * 5000 + b'1],"sampling_params":{"max_new_tokens":0}}'
        status, answer = call(srv.url, "/generate", raw=body)
        assert status == 400 and "--max-queued-tokens" in message(answer)
        # commas and brackets inside strings count for nothing
        ok = {"input_ids": [5, 6], "rid": "[,]" * 3000, "sampling_params": {"max_new_tokens": 1}}
        assert call(srv.url, "/generate", ok)[0] == 200
    finally:
        srv.stop()


def _weights_dir(base: Path, out: Path, change: dict[str, torch.Tensor] | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    if change:
        f = next(out.glob("*.safetensors"))
        sd = load_file(str(f))
        sd.update(change)
        save_file(sd, str(f), metadata={"format": "pt"})
    return out


def test_integer_and_bool_weights_are_refused_half_precision_is_cast(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    name = next(k for k in sd if k.endswith("weight") and sd[k].dim() == 2)
    srv = start_rollout_server(tiny_model_dir, tmp_path, "--weight-version", "0")
    try:
        for dtype in (torch.int64, torch.bool):
            d = _weights_dir(tiny_model_dir, tmp_path / str(dtype), {name: sd[name].to(dtype)})
            status, answer = call(srv.url, "/update_weights_from_disk", {"model_path": str(d), "weight_version": "9"})
            assert status == 400 and not answer["success"], answer
            assert f"dtype {str(dtype).split('.')[1]}" in answer["message"] and "floating point" in answer["message"]
        half = _weights_dir(tiny_model_dir, tmp_path / "half", {k: v.half() for k, v in sd.items()})
        status, answer = call(srv.url, "/update_weights_from_disk", {"model_path": str(half), "weight_version": "2"})
        assert status == 200 and answer["success"], answer
        assert call(srv.url, "/get_weight_version")[1]["weight_version"] == "2"
    finally:
        srv.stop()


def test_a_cast_that_overflows_the_served_dtype_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from common.generation.weights import LiveWeights, WeightLoadError
    from common.modeling import load_model

    model = load_model(str(tiny_model_dir)).half()
    from safetensors.torch import load_file

    sd = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    name = next(iter(sd))
    d = _weights_dir(tiny_model_dir, tmp_path / "big", {name: torch.full_like(sd[name], 1e6)})
    with pytest.raises(WeightLoadError, match=f"non-finite values in {name} \\(as float16\\)"):
        LiveWeights(model).read(d)


def test_weights_swapped_for_a_fifo_never_freeze_the_server_and_sigterm_stops_it(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """A flipper renames a FIFO and the real checkpoint over each other while updates arrive: a read
    that opened the FIFO once blocked the whole interpreter (no timeout, no SIGTERM)."""
    srv = start_rollout_server(tiny_model_dir, tmp_path, "--weight-version", "0", "--weight-load-timeout-s", "5")
    d = _weights_dir(tiny_model_dir, tmp_path / "flip")
    target = next(d.glob("*.safetensors"))
    regular, fifo = d / "regular.bin", d / "fifo.bin"
    stop = threading.Event()

    def flipper() -> None:
        while not stop.is_set():
            shutil.copy(target, regular)
            os.mkfifo(fifo)
            os.rename(fifo, target)  # the checkpoint's name is a FIFO now
            os.rename(regular, target)  # and a regular file again

    t = threading.Thread(target=flipper, daemon=True)
    try:
        t.start()
        statuses = []
        for i in range(40):
            status, _ = call(srv.url, "/update_weights_from_disk", {"model_path": str(d), "weight_version": str(i)},
                             timeout=10)
            statuses.append(status)
            assert call(srv.url, "/health", timeout=5)[0] == 200
        assert set(statuses) <= {200, 400} and 200 in statuses, statuses
    finally:
        stop.set()
        t.join(10)
        srv.proc.send_signal(signal.SIGTERM)
        try:
            rc = srv.proc.wait(timeout=20)
        finally:
            srv.stop()
    assert rc == 0


def test_a_malformed_request_is_one_log_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_rollout_server(tiny_model_dir, tmp_path, "--weight-version", "0")
    host, port = srv.url.removeprefix("http://").split(":")
    try:
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
                     b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(junk)
                assert s.recv(100).split(b" ")[1] == b"400"
        wait_for(lambda: srv.log_path.read_text().count("rejected a malformed request") == 2, 10, "two log lines")
        assert call(srv.url, "/health")[0] == 200
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert "Traceback" not in log and "Error handling request" not in log, log[-2000:]


def test_admin_key_reaches_a_workers_engine_only_through_its_environment(tmp_path: Path) -> None:
    """The worker's own engine command line carries no key (a command line is world-readable)."""
    from actors.rollout_server.process import rollout_server_command
    from common.config import load_config

    cfg = load_config(None, [f"run.root={tmp_path}"])
    assert not any("key" in a for a in rollout_server_command(cfg, 0, "m", 0))
    out = subprocess.run([sys.executable, "-m", "actors.rollout_server", "--help"], capture_output=True, text=True,
                         env={**os.environ, "VAPO_ENGINE_ADMIN_API_KEY": "secret-in-env"}, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and "--admin-api-key" in out.stdout and "secret-in-env" not in out.stdout
