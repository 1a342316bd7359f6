"""End-to-end tests of ``python -m actors``: real rollout_server engines, real buffer, real sockets."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import load_config
from common.modeling import load_model, load_tokenizer
from common.tasks import decode_response, encode_prompt, get_task
from learner.publisher import WeightPublisher
from tests.actors.actor_harness import Stack, make_weights, metric, read_tagged, scrape, terminate
from tests.polling import wait_for
from tests.ports import free_port


@pytest.fixture
def stack(tmp_path: Path, tiny_model_dir: Path):
    stacks: list[Stack] = []

    def make(*extra: str) -> Stack:
        s = Stack(tmp_path, tiny_model_dir, list(extra))
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.cleanup()


def _hf_logprobs(model: torch.nn.Module, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    ids = torch.tensor(np.concatenate([prompt, output]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp.gather(1, torch.tensor(output.astype(np.int64))[:, None])[:, 0].numpy()


def _check_groups(groups: list, models: dict[int, Path], overrides: list[str], group_size: int, max_new: int) -> None:
    """G samples each; prompt ids, rewards and behaviour logprobs as the task, verifier and the model say."""
    cfg = load_config(None, overrides)
    task, tok = get_task(cfg.task), load_tokenizer(next(iter(models.values())))
    hf = {v: load_model(path).eval() for v, path in models.items()}
    for g in groups:
        prompt = task.train_prompt(int(g.group_id.split("-p")[1]))
        assert g.prompt_id == prompt.prompt_id and g.task == task.name and len(g.samples) == group_size
        for smp in g.samples:
            assert smp.prompt_ids.tolist() == encode_prompt(tok, prompt)
            assert smp.response_length == len(smp.output_ids) > 0
            assert smp.finish_reason in ("stop", "length")
            if smp.finish_reason == "length":
                assert smp.response_length == max_new
            assert smp.reward == task.verify(prompt, decode_response(tok, smp.output_ids.tolist())).reward
            # the engine's behaviour logprobs are the served weights' log_softmax: v1 groups prove v1 was loaded
            ref = _hf_logprobs(hf[smp.weight_version], smp.prompt_ids, smp.output_ids)
            np.testing.assert_allclose(smp.output_logprobs, ref, atol=2e-4)


@pytest.mark.slow  # the two-worker test below checks the same properties on v0 and v1 groups
def test_groups_have_g_samples_engine_logprobs_and_verifier_rewards(stack, tiny_model_dir: Path) -> None:
    G, M = 4, 5
    s = stack(f"actors.group_size={G}", f"actors.max_prompts={M}", "actors.max_new_tokens=12",
              "actors.prompts_in_flight=3")
    s.start_buffer()
    with contextlib.closing(WeightPublisher(s.publish, s.query)):  # no weights published: the base model serves as version 0
        p = s.start_actors("--actor-id", "0")
        ready = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        assert ready["weight_version"] == 0
        done = read_tagged(p, "ACTOR DONE", 120, s.tmp / "actors.log")
        assert p.wait(timeout=30) == 0
    assert done["groups"] == M and done["fatal"] is None
    groups = sorted(s.groups(M), key=lambda g: int(g.group_id.split("-p")[1]))
    assert [g.group_id for g in groups] == [f"a0-p{i}" for i in range(M)]
    assert all(g.actor_id == 0 and g.weight_version == 0 for g in groups)
    _check_groups(groups, {0: tiny_model_dir}, s.overrides, G, 12)
    # sampling, not one response copied G times
    assert any(len({tuple(x.output_ids.tolist()) for x in g.samples}) > 1 for g in groups)


def test_a_scraped_worker_stays_for_one_last_scrape_after_it_stops(stack) -> None:
    # Prometheus pulls: a group scored after the last scrape sets the reward gauges, and a worker that exited
    # at once on SIGTERM would take them with it (a short run's Grafana panel stayed empty). A scraped worker
    # stops its engine, then waits for one more scrape, and that scrape ends the wait.
    s = stack("actors.group_size=2", "actors.max_new_tokens=8", "metrics.final_scrape_wait_s=120")
    s.start_buffer()
    with contextlib.closing(WeightPublisher(s.publish, s.query)):
        p = s.start_actors("--actor-id", "0")
        port = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")["metrics_port"]
        wait_for(lambda: (metric(scrape(port), "vapo_actor_groups_sent_total", actor="0") or 0) >= 1, 60,
                 "a scored group")
        p.send_signal(signal.SIGTERM)
        read_tagged(p, "ACTOR DONE", 60, s.tmp / "actors.log")  # its engine has stopped
        with pytest.raises(subprocess.TimeoutExpired):  # waiting for the scrape (up to 120 s), not gone
            p.wait(timeout=5)
        bodies = []
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < 60:  # scrape back to back, as Prometheus would
            with contextlib.suppress(OSError):
                bodies.append(scrape(port))
        assert p.wait(timeout=5) == 0  # a scrape ended the wait, well before final_scrape_wait_s
    # The exit may cut a scrape that began after the one it waited for: look for the whole one.
    assert any("vapo_actor_source_reward_mean{" in b and (metric(b, "vapo_actor_groups_sent_total", actor="0") or 0) >= 1
               for b in bodies), [len(b) for b in bodies]


def test_an_unscraped_worker_exits_at_once_when_stopped(stack) -> None:
    s = stack("actors.group_size=2", "actors.max_new_tokens=8", "metrics.final_scrape_wait_s=120")
    s.start_buffer()
    with contextlib.closing(WeightPublisher(s.publish, s.query)):
        p = s.start_actors("--actor-id", "0")
        read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        wait_for(lambda: s.cursor(0)["next"] >= 1, 60, "a prompt done")
        p.send_signal(signal.SIGTERM)
        read_tagged(p, "ACTOR DONE", 60, s.tmp / "actors.log")
        assert p.wait(timeout=60) == 0  # well under the 120 s it would wait if it had ever been scraped


@pytest.mark.parametrize("policy", ["abort", pytest.param("wait", marks=pytest.mark.slow)])
def test_weight_update_reaches_every_worker_and_bad_checksum_is_refused(stack, tmp_path: Path, tiny_model_dir: Path,
                                                                        policy: str) -> None:
    s = stack("actors.num_actors=2", "actors.group_size=2", "actors.max_new_tokens=8", "actors.prompts_in_flight=2",
              f"actors.weight_sync={policy}")
    s.start_buffer()
    learner = WeightPublisher(s.publish, s.query)
    try:
        p = s.start_actors()  # no --actor-id: both workers as children of one process
        ready = [read_tagged(p, "ACTOR READY", 150, s.tmp / "actors.log") for _ in range(2)]
        ports = {r["actor_id"]: r["metrics_port"] for r in ready}
        urls = {r["actor_id"]: r["engine_url"] for r in ready}
        assert sorted(ports) == [0, 1]

        def sent(a: int) -> float:
            return metric(scrape(ports[a]), "vapo_actor_groups_sent_total", actor=str(a)) or 0.0

        wait_for(lambda: all(sent(a) >= 1 for a in ports), 60, "a v0 group from each worker")
        v1 = make_weights(tiny_model_dir, tmp_path / "weights" / "v1", 0.9, 1)
        t_pub = time.time()
        learner.publish(v1)
        wait_for(lambda: all(metric(scrape(ports[a]), "vapo_actor_weight_version", actor=str(a)) == 1 for a in ports),
                 60, "both workers on v1")
        after_v1 = {a: sent(a) for a in ports}
        wait_for(lambda: all(sent(a) >= after_v1[a] + 2 for a in ports), 60, "two more groups from each worker")
        for a in ports:
            text = scrape(ports[a])
            assert metric(text, "vapo_actor_weight_sync_seconds_count", actor=str(a)) == 1
            latency = metric(text, "vapo_actor_weight_sync_seconds_sum", actor=str(a))
            assert latency is not None and 0 <= latency <= time.time() - t_pub + 1

        # v2 announced with a checksum that does not match its files: refused, v1 keeps serving
        v2 = make_weights(tiny_model_dir, tmp_path / "weights" / "v2", 1.1, 2)
        v2 = dataclasses.replace(v2, sha256="0" * 64)
        learner.publish(v2)
        wait_for(lambda: all(metric(scrape(ports[a]), "vapo_actor_weight_sync_failures_total", actor=str(a),
                                    reason="checksum") == 1 for a in ports), 60, "both workers refusing v2")
        before = {a: sent(a) for a in ports}
        wait_for(lambda: all(sent(a) >= before[a] + 1 for a in ports), 60, "groups after the refusal")
        for a in ports:
            assert metric(scrape(ports[a]), "vapo_actor_weight_version", actor=str(a)) == 1
            with urllib.request.urlopen(urls[a] + "/get_model_info", timeout=5) as r:
                import json

                assert str(json.loads(r.read())["weight_version"]) == "1"
        assert terminate(p) == 0
    finally:
        learner.close()
    n = int(s.buffer_stats()["depth_groups"])
    groups = s.groups(n)
    for a in (0, 1):
        mine = sorted((g for g in groups if g.actor_id == a), key=lambda g: g.created_at)
        versions = [g.weight_version for g in mine]
        assert 0 in versions and versions.count(1) >= 2, versions
        assert max(versions) == 1 and mine[-1].weight_version == 1
        assert all(g.group_id.startswith(f"a{a}-p") for g in mine)
        # actor a's shard: prompt indices a, a + 2, a + 4, ... (num_actors = 2)
        assert all(int(g.group_id.split("-p")[1]) % 2 == a for g in mine)
    assert len({g.group_id for g in groups}) == len(groups)
    _check_groups(groups, {0: tiny_model_dir, 1: tmp_path / "weights" / "v1"}, s.overrides, 2, 8)


def test_killed_engine_is_restarted_with_newest_weights_and_no_prompt_is_lost_or_repeated(
        stack, tmp_path: Path, tiny_model_dir: Path) -> None:
    M = 10
    # Admission of 6 groups (max_staleness 1 x batch_groups 6): the worker cannot finish before the test drains
    # the buffer, so the kill always lands mid-run however fast the engine is.
    s = stack("actors.group_size=2", "actors.max_new_tokens=8", "actors.prompts_in_flight=3", f"actors.max_prompts={M}",
              "actors.weight_sync=wait", "engine.max_restarts=2", "learner.batch_groups=6", "buffer.max_staleness=1")
    s.start_buffer()
    v1_dir = tmp_path / "weights" / "v1"
    with contextlib.closing(WeightPublisher(s.publish, s.query)) as learner:
        learner.publish(make_weights(tiny_model_dir, v1_dir, 0.9, 1))  # published before the worker starts
        p = s.start_actors("--actor-id", "0")
        ready = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        assert ready["weight_version"] == 1  # a late worker starts its engine on the newest weights
        first_engine = ready["engine_pid"]
        wait_for(lambda: s.cursor(0)["next"] >= 3, 60, "three prompts done")
        os.kill(first_engine, signal.SIGKILL)
        wait_for(lambda: s.worker_state(0).get("engine_pid") not in (None, first_engine), 120, "a new engine")
        groups = s.drain_until(lambda: p.poll() is not None, 150)
        done = read_tagged(p, "ACTOR DONE", 30, s.tmp / "actors.log")
        assert p.wait(timeout=30) == 0
    assert done["fatal"] is None and done["engine_restarts"] == 1 and done["weight_version"] == 1
    assert done["prompts_done"] == M and done["engine_pid"] != first_engine
    starts = [ln for ln in (s.run_dir / "logs" / "engine-0.log").read_text().splitlines() if ln.startswith("=== ")]
    assert len(starts) == 2 and all(f"--model-path {v1_dir} " in ln and "--weight-version 1 " in ln for ln in starts)
    _check_shard_once(s, groups, M, version=1)


def test_engine_that_stops_answering_health_is_killed_and_restarted(stack, tmp_path: Path) -> None:
    """A live engine process that no longer answers (here SIGSTOPped; a hung scheduler looks the same) is
    found by /health, not by its exit, and restarted; its prompts are generated again, none lost."""
    M = 8
    s = stack("actors.group_size=2", "actors.max_new_tokens=8", "actors.prompts_in_flight=2", f"actors.max_prompts={M}",
              "engine.health_interval_s=0.3", "engine.health_timeout_s=1", "engine.health_failures=3",
              "learner.batch_groups=4", "buffer.max_staleness=1")  # the run cannot end before the test drains
    s.start_buffer()
    with contextlib.closing(WeightPublisher(s.publish, s.query)):
        p = s.start_actors("--actor-id", "0")
        ready = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        hung = ready["engine_pid"]
        try:
            wait_for(lambda: s.cursor(0)["next"] >= 2, 60, "two prompts taken")
            os.kill(hung, signal.SIGSTOP)
            wait_for(lambda: s.worker_state(0).get("engine_pid") not in (None, hung), 60, "a new engine")
            wait_for(lambda: not Path(f"/proc/{hung}").exists() or "Z" in Path(f"/proc/{hung}/stat").read_text().split()[2],
                     30, "the hung engine gone")
            groups = s.drain_until(lambda: p.poll() is not None, 150)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
        done = read_tagged(p, "ACTOR DONE", 30, s.tmp / "actors.log")
        assert p.wait(timeout=30) == 0
    assert done["fatal"] is None and done["engine_restarts"] == 1 and done["prompts_done"] == M
    assert "failed 3 /health probes in a row" in (s.tmp / "actors.log").read_text()
    _check_shard_once(s, groups, M, version=0)


def test_hung_engine_with_a_weight_sync_pending_is_restarted_within_the_health_bound(
        stack, tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGSTOPped engine, then a new version published: the sync's update request hangs on it. Probes go on
    during the sync, so the engine is killed within health_failures x health_interval_s + health_timeout_s
    (plus scheduling slack) and restarted on the new weights (it used to wait for ever)."""
    interval, timeout, failures = 0.5, 1.0, 3
    bound = failures * interval + timeout
    s = stack("actors.group_size=2", "actors.max_new_tokens=8", "actors.prompts_in_flight=2", "actors.max_prompts=6",
              "actors.weight_sync=wait", f"engine.health_interval_s={interval}", f"engine.health_timeout_s={timeout}",
              f"engine.health_failures={failures}", "learner.batch_groups=4", "buffer.max_staleness=1")
    s.start_buffer()
    with contextlib.closing(WeightPublisher(s.publish, s.query)) as learner:
        p = s.start_actors("--actor-id", "0")
        ready = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        hung = ready["engine_pid"]
        try:
            wait_for(lambda: s.cursor(0)["next"] >= 1, 60, "a prompt taken")
            v1 = make_weights(tiny_model_dir, tmp_path / "weights" / "v1", 0.9, 1)
            os.kill(hung, signal.SIGSTOP)
            t_stop = time.monotonic()
            learner.publish(v1)
            wait_for(lambda: not Path(f"/proc/{hung}").exists() or "Z" in Path(f"/proc/{hung}/stat").read_text().split()[2],
                     bound + 30, "the hung engine killed")
            killed_after = time.monotonic() - t_stop
            wait_for(lambda: s.worker_state(0).get("engine_pid") not in (None, hung), 60, "a new engine")
            wait_for(lambda: s.worker_state(0).get("weight_version") == 1, 60, "the new engine on v1")
            s.drain_until(lambda: p.poll() is not None, 150)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
        done = read_tagged(p, "ACTOR DONE", 30, s.tmp / "actors.log")
        assert p.wait(timeout=30) == 0
    assert killed_after < bound + 5, (killed_after, bound)
    assert done["fatal"] is None and done["engine_restarts"] == 1 and done["weight_version"] == 1
    assert "health probes during a weight sync in a row; killing it" in (s.tmp / "actors.log").read_text()


def _check_shard_once(s: Stack, groups: list, m: int, version: int) -> None:
    ids = sorted(int(g.group_id.split("-p")[1]) for g in groups)
    assert ids == list(range(m))  # every prompt of the shard exactly once
    task = get_task(load_config(None, s.overrides).task)
    assert all(g.prompt_id == task.train_prompt(int(g.group_id.split("-p")[1])).prompt_id for g in groups)
    assert all(g.weight_version == version and len(g.samples) == 2 for g in groups)


@pytest.mark.slow
def test_killed_worker_resumes_its_cursor_without_repeating_or_skipping(stack, tmp_path: Path) -> None:
    M = 12
    s = stack("actors.group_size=2", "actors.max_new_tokens=8", "actors.prompts_in_flight=4", f"actors.max_prompts={M}",
              "learner.batch_groups=7", "buffer.max_staleness=1")  # at most 7 groups before the test drains
    s.start_buffer()
    with contextlib.closing(WeightPublisher(s.publish, s.query)):
        p = s.start_actors("--actor-id", "0")
        read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        wait_for(lambda: s.cursor(0)["next"] >= 4, 60, "four prompts done")
        p.send_signal(signal.SIGKILL)  # in-flight prompts and possibly acked-but-unrecorded groups are lost
        p.wait(timeout=30)
        orphan = s.worker_state(0)["engine_pid"]
        wait_for(lambda: not _alive(orphan), 30, "the engine to exit with its killed worker")
        p2 = s.start_actors("--actor-id", "0", log_name="actors2.log")
        groups = s.drain_until(lambda: p2.poll() is not None, 150)
        done = read_tagged(p2, "ACTOR DONE", 30, s.tmp / "actors2.log")
        assert p2.wait(timeout=30) == 0
    assert done["fatal"] is None and done["prompts_done"] == M
    _check_shard_once(s, groups, M, version=0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): look at its state
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_external_engine_restarted_underneath_is_resynced_and_samples_stay_honest(
        stack, tmp_path: Path, tiny_model_dir: Path) -> None:
    """engine.kind=external/sglang: vapo does not own the engine; the launcher restarts it on base weights."""
    import subprocess

    from tests.actors.actor_harness import REPO, env

    port, M = free_port(), 12
    cmd = [sys.executable, "-m", "actors.rollout_server", "--model-path", str(tiny_model_dir), "--port", str(port),
           "--skip-tokenizer-init", "--threads", "1", "--weight-version", "0", "--log-level", "warning"]

    def start_engine() -> subprocess.Popen:
        p = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        s.procs.append(p)
        return p

    s = stack("engine.kind=external", f"engine.urls=[http://127.0.0.1:{port}]", "actors.group_size=2",
              "actors.max_new_tokens=8", "actors.prompts_in_flight=3", f"actors.max_prompts={M}",
              "learner.batch_groups=6", "buffer.max_staleness=1")  # the run cannot end before the test drains
    s.start_buffer()
    engine = start_engine()
    v1_dir = tmp_path / "weights" / "v1"
    with contextlib.closing(WeightPublisher(s.publish, s.query)) as learner:
        learner.publish(make_weights(tiny_model_dir, v1_dir, 0.9, 1))
        p = s.start_actors("--actor-id", "0")
        ready = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
        assert ready["weight_version"] == 1  # synced before its first request
        wait_for(lambda: s.cursor(0)["next"] >= 3, 60, "three prompts done")
        engine.kill()
        engine.wait()
        start_engine()  # back on the base weights, as a restarted sglang server would be
        groups = s.drain_until(lambda: p.poll() is not None, 150)
        done = read_tagged(p, "ACTOR DONE", 30, s.tmp / "actors.log")
        assert p.wait(timeout=30) == 0
    assert done["fatal"] is None and done["engine_restarts"] == 1 and done["weight_version"] == 1
    assert done["weight_loads"] == 2
    assert sorted(int(g.group_id.split("-p")[1]) for g in groups) == list(range(M))
    # whatever raced the re-sync is stamped with the weights that really produced it
    _check_groups(groups, {0: tiny_model_dir, 1: v1_dir}, s.overrides, 2, 8)
    assert sum(g.weight_version == 1 for g in groups) >= M - 3


def test_grant_that_overtakes_its_weight_update_waits_for_those_weights(stack, tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    """Synchronous mode (max_staleness = 0): the learner publishes v1, then asks for the v1 batch. The
    buffer's grant (learner_version = 1) reaches the actor before the WeightUpdate does (here: the PUB
    message is never sent and the next poll is a minute away). The actor must ask for the weights and
    generate on v1; generating on v0 would make groups the buffer drops as stale."""
    from buffer.client import BatchClient

    s = stack("buffer.max_staleness=0", "actors.group_size=2", "actors.max_new_tokens=8", "actors.prompts_in_flight=2",
              "actors.weight_poll_s=60")
    s.start_buffer()
    learner = WeightPublisher(s.publish, s.query)
    try:
        p = s.start_actors("--actor-id", "0")
        ready = read_tagged(p, "ACTOR READY", 150, s.tmp / "actors.log")
        assert ready["weight_version"] == 0
        with BatchClient(s.serve) as c:
            first = c.get_batch(0, 2, timeout_s=60).groups
            assert [g.weight_version for g in first] == [0, 0]
            # v1 is announced by a restarted learner on no PUB message: only a WeightQuery finds it, and the
            # next periodic one is a minute away.
            v1 = make_weights(tiny_model_dir, tmp_path / "weights" / "v1", 0.9, 1)
            learner.close()
            learner = WeightPublisher(s.publish, s.query, latest=v1)
            t0 = time.monotonic()
            second = c.get_batch(1, 2, timeout_s=60).groups
            stats = c.stats()
        assert [g.weight_version for g in second] == [1, 1]
        assert stats["stale_dropped"] == 0
        assert time.monotonic() - t0 < 50  # asked at once, not at the next poll (actors.weight_poll_s=60)
        waited = metric(scrape(ready["metrics_port"]), "vapo_actor_weight_wait_seconds_total", actor="0")
        assert waited is not None and waited > 0
        assert terminate(p) == 0
    finally:
        learner.close()
