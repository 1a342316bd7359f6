"""ops/launch.sh end to end on the smoke config: real buffer, engine, actor and learner processes.

One smoke run (module fixture, two engines with one restart each) is watched by a real Prometheus when the
binary is available (``.ci/run`` installs Debian's ``prometheus``), has actor-0 killed once mid-run
(restarted) and actor-1 killed twice (given up: the run finishes on actor-0), and is then inspected. A
second run is interrupted with SIGINT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ops import launch
from tests.ops.process_fixtures import processes_mentioning
from tests.polling import wait_for
from tests.ports import free_port, port_overrides

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "ops" / "launch.sh"


def smoke_overrides(root: Path, name: str) -> list[str]:
    return [f"run.root={root}", f"run.name={name}", *port_overrides()]


def promql_range(port: int, expr: str, start: float, end: float) -> list:
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query_range?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("runs")
    name = "smoke-e2e"
    # Two engines, one restart each: actor-0 is killed once (restarted), actor-1 twice (given up), and the
    # run finishes on actor-0 alone.
    # The learner also feeds TensorBoard (metrics.trackers), read back below against metrics.jsonl.
    # Two named evaluation sets (addition questions), scraped apart below: set and data_source labels.
    for set_name, questions in (("sums", ["3+4", "12+30", "5+5"]), ("more", ["101+22", "7+7"])):
        (root / f"{set_name}.jsonl").write_text("".join(
            json.dumps({"question": f"Q:{q}\n", "answer": str(sum(map(int, q.split("+")))), "data_source": f"{set_name}_src"}) + "\n"
            for q in questions))
    overrides = [*smoke_overrides(root, name), "actors.num_actors=2", "engine.max_restarts=1",
                 "metrics.trackers=[tensorboard]",
                 f"task.eval_sets=[{{name: sums, path: {root / 'sums.jsonl'}}}, {{name: more, path: {root / 'more.jsonl'}}}]"]
    run_dir = root / name
    prom = None
    prom_port = None
    if shutil.which("prometheus"):
        # Prometheus scrapes the run's own generated config; write it first by resolving the same config.
        from common.config import load_config

        sys_cfg = load_config(ROOT / "ops/configs/smoke.yaml", overrides)
        prom_cfg = root / "prometheus.yml"
        launch.write_prometheus_config(sys_cfg, prom_cfg)
        prom_port = free_port()
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={prom_cfg}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        # A Prometheus still opening its TSDB when the learner's short life ends would record nothing.
        wait_for(lambda: launch.http_ok(f"http://127.0.0.1:{prom_port}/-/ready"), 60, "prometheus to be ready")
    proc = subprocess.Popen([str(LAUNCH), "ops/configs/smoke.yaml", *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    actor1_kills: list[int] = []
    killer = threading.Thread(target=_kill_twice, args=(run_dir, "1", actor1_kills), daemon=True)
    killer.start()
    lines: list[str] = []
    killed_actor = False
    t0 = time.time()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        # Kill the actor once, after the learner has made progress (its restart must be counted).
        if not killed_actor and ("step 1/" in line or "value pretraining step 1" in line):
            for entry in processes_mentioning("-m actors "):
                if str(run_dir) in entry and "--actor-id 0" in entry:
                    os.kill(int(entry.split(":")[0]), signal.SIGKILL)
                    killed_actor = True
                    break
    rc = proc.wait(timeout=60)
    wall = time.time() - t0
    killer.join(timeout=5)
    yield {"rc": rc, "out": "".join(lines), "run_dir": run_dir, "wall": wall, "t0": t0, "killed_actor": killed_actor,
           "prom_port": prom_port, "actor1_kills": actor1_kills}
    if prom is not None:
        os.killpg(prom.pid, signal.SIGTERM)
        prom.wait(timeout=10)


def _actor_pid(run_dir: Path, actor_id: str) -> int | None:
    for entry in processes_mentioning("-m actors "):
        if str(run_dir) in entry and f"--actor-id {actor_id}" in entry:
            return int(entry.split(":")[0])
    return None


def _kill_twice(run_dir: Path, actor_id: str, killed: list[int]) -> None:
    """SIGKILL the actor as soon as it runs, then its restarted process: one more death than
    engine.max_restarts=1 allows."""
    for _ in range(2):
        try:
            pid = wait_for(lambda: (p := _actor_pid(run_dir, actor_id)) not in (None, *killed) and p, 240,
                           f"actor-{actor_id} to run")
        except AssertionError:
            return  # the fixture's assertions say what is missing
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)


def test_smoke_run_completes_and_writes_the_run_dir(smoke_run) -> None:
    assert smoke_run["rc"] == 0, smoke_run["out"][-4000:]
    run_dir: Path = smoke_run["run_dir"]
    assert (run_dir / "config.yaml").is_file()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "learner_step"]
    assert len(steps) >= 3
    assert any(isinstance(r.get("eval"), dict) for r in records), "one evaluation"
    assert any((run_dir / "checkpoints").iterdir())
    assert any((run_dir / "weights").glob("v*"))
    pngs = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    for expected in ("reward.png", "heldout_accuracy.png", "explained_variance.png", "response_length.png", "staleness.png", "throughput.png"):
        assert expected in pngs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] >= 3
    assert list(summary["eval_sets"]) == ["heldout", "sums", "more"]  # the named sets, apart
    assert list(next(r["eval"] for r in records if isinstance(r.get("eval"), dict))["sets"]) == ["heldout", "sums", "more"]
    # What produced the run: the learner's header first, copied into the summary with the base's checksum.
    from common.checksum import weights_sha256
    from common.config import load_config

    assert records[0]["kind"] == "header" and summary["provenance"]["commit"] == records[0]["commit"]
    base = load_config(ROOT / "ops/configs/smoke.yaml").model.path
    assert summary["provenance"]["base"]["sha256"] == weights_sha256(ROOT / base)
    assert "held-out accuracy" in smoke_run["out"]


def test_smoke_run_feeds_tensorboard_every_metrics_jsonl_record(smoke_run) -> None:
    """``metrics.trackers=[tensorboard]`` through the real learner process: the event file holds the metric
    names of metrics.jsonl's step records (and value pretraining's, evaluations'), each step at its version."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.trackers import scalars

    assert smoke_run["rc"] == 0, smoke_run["out"][-4000:]
    run_dir: Path = smoke_run["run_dir"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "learner_step"]
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    step_names = set().union(*(scalars(r) for r in steps))
    assert {"reward_mean", "critic_loss", "policy_loss", "phase_seconds/actor_update"} <= step_names <= tags
    assert tags == set().union(*(scalars(r) for r in records if r["kind"] != "header"))
    assert any(t.startswith("value_pretrain/") for t in tags)  # value pretraining's records went there too
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in steps]
    assert {"config/text_summary", "header/text_summary"} <= set(acc.Tags()["tensors"])


def test_smoke_run_leaves_no_process_behind(smoke_run) -> None:
    assert processes_mentioning(str(smoke_run["run_dir"])) == []


def test_killed_actor_is_restarted_and_counted(smoke_run) -> None:
    assert smoke_run["killed_actor"], "the test did not find the actor process to kill"
    assert "actor-0 exited" in smoke_run["out"] and "restarting (1/" in smoke_run["out"]


def test_an_actor_dying_past_its_restarts_is_given_up_and_the_run_finishes_on_the_other(smoke_run) -> None:
    """Before elastic engines the launcher stopped the whole run here ("exited ... and was restarted 1
    times", exit code 1)."""
    out = smoke_run["out"]
    assert len(smoke_run["actor1_kills"]) == 2, out[-3000:]
    assert "actor-1 exited with code -9; restarting (1/1)" in out
    assert "GIVING UP actor-1" in out and "the run goes on on 1/2 engine(s)" in out, out[-3000:]
    assert "engines 1/2" in out  # the step lines say the run is degraded
    assert smoke_run["rc"] == 0 and "learner finished" in out, out[-3000:]


def test_every_grafana_panel_query_returns_data(smoke_run) -> None:
    if smoke_run["prom_port"] is None:
        pytest.skip("prometheus binary not installed (.ci/run installs Debian's prometheus)")
    dash = json.loads((ROOT / "ops/grafana/vapo.json").read_text())
    # Over the whole run (the processes are gone now, so an instant query would see stale series).
    start, end = smoke_run["t0"], smoke_run["t0"] + smoke_run["wall"] + 5
    empty = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            if not promql_range(smoke_run["prom_port"], target["expr"], start, end):
                empty.append(f"{panel['title']}: {target['expr']}")
    # Value pretraining runs before the RL steps, in the same process: its gauges must carry real values
    # (a registry nobody serves would leave the served gauge at its initial 0).
    # The named evaluation sets reach Prometheus apart, each in total and by its data_source.
    for expr in ("vapo_learner_value_pretrain_loss > 0", "vapo_learner_weight_version >= 3",
                 'vapo_learner_eval_avg_at_k{set="sums",data_source="all"}',
                 'vapo_learner_eval_pass_at_k{set="more",data_source="more_src"}',
                 'vapo_learner_eval_avg_at_k{set="heldout",data_source="all"}'):
        if not promql_range(smoke_run["prom_port"], expr, start, end):
            empty.append(expr)
    if empty:
        with urllib.request.urlopen(f"http://127.0.0.1:{smoke_run['prom_port']}/api/v1/targets", timeout=10) as r:
            targets = [(t["labels"].get("job"), t["health"], t.get("lastError"), t.get("lastScrape"))
                       for t in json.loads(r.read())["data"]["activeTargets"]]
        pytest.fail(f"no data for {empty}\ntargets: {targets}\n{smoke_run['out'][-3000:]}")


def _as_if_started_in_background_by_a_script() -> None:
    # What bash does to `cmd &` without job control (scripts, CI jobs): SIGINT and SIGQUIT arrive ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def test_sigint_stops_every_child_within_ten_seconds(tmp_path: Path) -> None:
    """Even when the launcher inherited SIGINT as ignored (a fresh-clone CI run started with `&` failed here
    when the launcher relied on Python's default handler, which an inherited SIG_IGN switches off)."""
    overrides = smoke_overrides(tmp_path, "smoke-sigint")
    proc = subprocess.Popen([str(LAUNCH), "ops/configs/smoke.yaml", *overrides, "learner.total_steps=1000"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_as_if_started_in_background_by_a_script)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "actor(s) started" in line:
            break
    run_dir = tmp_path / "smoke-sigint"
    wait_for(lambda: len(processes_mentioning(str(run_dir))) >= 3, 60, "buffer, learner and actor processes")
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=15)
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 10 - min(time.time() - t0, 9), "every child to stop")
    assert time.time() - t0 <= 10.5
    assert proc.returncode == 130


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_stop_signals_and_nohup(inherited: str) -> None:
    """SIGINT and SIGTERM always stop the launcher; SIGHUP does unless it arrived ignored (``nohup``: the run
    must survive the terminal closing)."""
    def start() -> None:
        # Set both ways explicitly: the test runner itself may run under nohup or as a script's `cmd &`.
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL)

    # A child process: handlers are process-wide, and pytest's own SIGINT handler must stay.
    probe = ("import signal; from ops import launch; launch.install_stop_handlers(); "
             "print([signal.getsignal(s) is launch._stop for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         preexec_fn=start).stdout.strip()
    assert out == str([True, True, inherited == "default"])


def test_launcher_health_check_uses_the_configured_curve_client_keys(tmp_path: Path) -> None:
    import zmq

    from common.config import load_config
    from common.security import generate_keypair
    server_pub, _ = generate_keypair(tmp_path, "server")
    _, client_secret = generate_keypair(tmp_path, "client")
    cfg = load_config(None, [f"buffer.curve.server_public_key={server_pub}", f"buffer.curve.client_secret_key={client_secret}"])
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        launch._apply_client_curve(sock, cfg)
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
    finally:
        sock.close(0)


def _bare_launcher(tmp_path: Path, *overrides: str) -> launch.Launcher:
    from common.config import load_config, save_config

    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [f"run.root={tmp_path}", "run.name=links", *overrides])
    return launch.Launcher(cfg, save_config(cfg).resolve(), False)


def test_launcher_stops_the_run_when_a_learner_host_is_lost(tmp_path: Path) -> None:
    """pdsh reports a learner rank's lost host (ssh exit 255): that stops the run in order, not a crash to
    restart. (An engine host's loss does not: tests/ops/test_launch_supervise.py.)"""
    launcher = _bare_launcher(tmp_path)
    # An ordinary exit of a remote process is left to the restart logic.
    launcher.children = {"actor-1": launch.Child("actor-1", ["sh", "-c", "exit 3"], tmp_path / "a.log", 3, via="ssh")}
    launcher.children["actor-1"].start()
    wait_for(lambda: not launcher.children["actor-1"].alive(), 10, "the process to exit")
    launcher.check_links()
    # Learner ranks behind pdsh: its report in the learner log, only what this run appended.
    log = tmp_path / "learner.log"
    log.write_text("pdsh@h0: h3: ssh exited with exit code 255\n")  # an earlier run's
    script = "echo 'pdsh@h0: h1: ssh exited with exit code 255'; sleep 30"
    learner = launch.Child("learner", ["sh", "-c", script], log, 0, via="pdsh")
    launcher.children = {"learner": learner}
    launcher._pdsh_offset = log.stat().st_size
    learner.start()
    try:
        # The report itself (a line of its own), not the launcher's header line that quotes the command.
        wait_for(lambda: "\npdsh@h0: h1:" in log.read_text(), 10, "pdsh's report")
        with pytest.raises(launch.LaunchError, match="learner ranks on h1 ended: host lost"):
            launcher.check_links()
    finally:
        launcher.stop_all()


def test_launcher_heartbeat_keeps_a_guarded_process_and_its_stop_ends_it(tmp_path: Path) -> None:
    """The launcher's side of the ssh link: heartbeats keep the remote guard's process running past the
    guard's timeout; stop_all closes the link and the guarded process ends within the stop grace."""
    import threading
    launcher = _bare_launcher(tmp_path, "placement.ssh_alive_interval_s=1", "placement.ssh_alive_count_max=2")
    marker = tmp_path / "guarded-child-marker"
    guarded = [sys.executable, "-m", "common.remote", "--timeout", "2", "--", sys.executable, "-c",
               f"import time; open({str(marker)!r}, 'w').close(); time.sleep(600)"]
    c = launch.Child("actor-1", guarded, tmp_path / "actor-1.log", 0, via="ssh", host="h2")
    launcher.children = {"actor-1": c}
    threading.Thread(target=launcher._heartbeat, daemon=True).start()
    c.start()
    wait_for(marker.exists, 20, "the guarded process to start")
    t_start = time.time()
    wait_for(lambda: time.time() - t_start > 5 or not c.alive(), 10, "5 s (2.5 guard timeouts) to pass")
    assert c.alive(), c.tail()
    t0 = time.time()
    launcher.stop_all()
    assert not c.alive() and time.time() - t0 < launch.STOP_GRACE_S
    assert processes_mentioning(str(marker)) == []


def test_buffer_probe_reports_a_missing_key_file_at_once(tmp_path: Path) -> None:
    """A probe that cannot work (its client key file does not exist) says why at once, instead of waiting out
    its deadline and reporting the buffer "not healthy"."""
    from common.config import load_config
    from common.security import generate_keypair
    server_pub, _ = generate_keypair(tmp_path, "server")
    cfg = load_config(None, [f"buffer.curve.server_public_key={server_pub}",
                             f"buffer.curve.client_secret_key={tmp_path / 'client-0.key_secret'}"])
    t0 = time.time()
    with pytest.raises(launch.LaunchError, match="client-0.key_secret not found"):
        launch.wait_until("buffer", lambda: launch.buffer_healthy(cfg), None, 10)
    assert time.time() - t0 < 3


def test_prometheus_config_scrapes_sglang_engines(tmp_path: Path) -> None:
    """SGLang engines serve sglang:* on their HTTP port's /metrics: the generated prometheus.yml scrapes them,
    on host 0 by the bind address, on other hosts by the host's name when they bind a routable address."""
    import yaml

    from common.config import load_config
    from common.placement import build_plan
    from tests.common.placement_fixtures import QWEN_7B, QWEN_32B
    cfg = load_config(ROOT / "ops" / "configs" / "gpu-node8.yaml")
    plan = build_plan(cfg, tmp_path / "config.yaml", sys.executable, ROOT, tmp_path, hf_config=QWEN_7B)
    launch.write_prometheus_config(cfg, tmp_path / "prometheus.yml", plan)
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in
            yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs["vapo_sglang"] == [f"127.0.0.1:{cfg.engine.base_port}", f"127.0.0.1:{cfg.engine.base_port + 1}"]
    # paper.yaml: engine 0 on host 0, engines 1-3 on node6/node7, reachable when bound to a routable address.
    env = {"PATH": os.environ.get("PATH", "") + ":" + str(tmp_path)}
    (tmp_path / "pdsh").write_text("#!/bin/sh\n")
    (tmp_path / "pdsh").chmod(0o755)
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml", ["engine.host=0.0.0.0",
                                                                 "engine.bind_protection=private_network"])
    plan = build_plan(cfg, tmp_path / "config.yaml", sys.executable, ROOT, tmp_path, hf_config=QWEN_32B, environ=env)
    port = cfg.engine.base_port
    assert launch.engine_targets(cfg, plan) == [f"0.0.0.0:{port}", f"node6:{port + 1}", f"node7:{port + 2}",
                                             f"node7:{port + 3}"]


def test_a_run_across_hosts_keeps_its_buffer_off_the_shared_run_directory(tmp_path: Path) -> None:
    """runs/ of a multi-host run is on a network filesystem, where LMDB's memory map and locks are unsafe: the
    buffer defaults to buffer.local_root on host 0; a leftover buffer of the same name makes a new run name."""
    from common.config import load_config

    one = load_config(ROOT / "ops" / "configs" / "smoke.yaml", [f"run.root={tmp_path}", "run.name=r"])
    assert one.buffer_path == tmp_path / "r" / "buffer"  # one host: unchanged
    multi = [f"run.root={tmp_path}", "run.name=r", "placement.hosts=[h0,h1]", f"buffer.local_root={tmp_path / 'local'}"]
    cfg = load_config(ROOT / "ops" / "configs" / "smoke.yaml", multi)
    assert cfg.buffer_path == tmp_path / "local" / "r" / "buffer"
    assert load_config(ROOT / "ops" / "configs" / "smoke.yaml", [*multi, "buffer.path=/x/b"]).buffer_path == Path("/x/b")
    (tmp_path / "local" / "r" / "buffer").mkdir(parents=True)
    (tmp_path / "local" / "r" / "buffer" / "data.mdb").write_bytes(b"")
    cfg, _ = launch.resolve_run(str(ROOT / "ops" / "configs" / "smoke.yaml"), multi, False)
    assert cfg.run.name.startswith("r-") and not cfg.buffer_path.exists()


def test_learner_exit_zero_without_its_done_file_is_a_failure(tmp_path: Path) -> None:
    """DeepSpeed's multi-node runner exits 0 when pdsh dies of a signal, so a learner killed part-way exits 0:
    only the done file that rank 0 writes after its last step says the run finished."""
    launcher = _bare_launcher(tmp_path)
    launcher.progress = None

    def learner_exits_0(script: str) -> None:
        child = launch.Child("learner", ["sh", "-c", script], tmp_path / "learner.log", 0)
        launcher.children = {"learner": child}
        child.start()
        wait_for(lambda: not child.alive(), 10, "the learner stand-in to exit")

    learner_exits_0("echo 'step 1 of 3'; exit 0")
    with pytest.raises(launch.LaunchError, match="exited with code 0 but never wrote learner_done.json"):
        launcher.supervise()
    learner_exits_0(f"echo '{{}}' > {launcher.run_dir / 'learner_done.json'}; exit 0")
    launcher.supervise()  # returns: finished
