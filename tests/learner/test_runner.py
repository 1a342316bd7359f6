"""The learner process loop: metrics.jsonl records, Prometheus gauges, periodic held-out evaluation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from common.config import load_config
from learner.data import BufferSource, ListSource
from learner.runner import Runner, source_totals
from learner.synthetic import synth_groups
from tests.learner.synth import child_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def test_runner_logs_metrics_and_evaluates(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.total_steps=2", "learner.batch_groups=2", "learner.eval_every=2",
                             "learner.eval_k=1", "task.eval_size=4", "task.max_digits=2", "actors.max_new_tokens=12",
                             "metrics.prometheus=false", "learner.checkpoint_every=0",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    runner = Runner(cfg, ListSource(synth_groups(4, 3, 60, seed=6))).start()
    learner = runner.run()
    assert learner.version == 2  # v0 (the base policy), v1 and v2 were published
    done = json.loads((tmp_path / "r" / "learner_done.json").read_text())  # what the launcher trusts, not exit 0
    assert done["version"] == 2 and done["reason"] == "total_steps"
    all_recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in all_recs] == [("eval", 0), ("learner_step", 1), ("learner_step", 2)]
    base = all_recs[0]  # the base policy is evaluated before the first step
    assert base["weight_version"] == 0 and 0.0 <= base["avg_at_k"] <= 1.0
    recs = all_recs[1:]
    for key in ("critic_loss", "value_explained_variance", "policy_loss", "nll_loss", "clip_fraction_low",
                "clip_fraction_high", "approx_kl", "entropy", "actor_grad_norm", "critic_grad_norm",
                "lambda_actor_mean", "reward_mean", "positives_fraction", "response_length_mean", "tokens_per_second",
                "mfu", "phase_mfu", "peak_tflops_measured"):
        assert key in recs[0], key
    # Cumulative data accounting (generated-sample counts for experiments): what the source reports.
    assert [r["groups_consumed_total"] for r in recs] == [2, 4] and "filtered_total" not in recs[0]
    assert "eval" not in recs[0] and 0.0 <= recs[1]["eval"]["avg_at_k"] <= 1.0
    assert recs[1]["eval"]["n_prompts"] == 4
    # Accuracy by task bucket and by response length are part of the record (the long-horizon report
    # reads them); their sample counts add up to the evaluation's.
    for e in (base, recs[1]["eval"]):
        assert sum(b["n_prompts"] for b in e["by_bucket"].values()) == 4
        assert sum(b["n_samples"] for b in e["by_response_length"].values()) == 4
    text = generate_latest(learner.metrics.registry).decode()
    for name in ("vapo_learner_step 2.0", "vapo_learner_weight_version 2.0", 'vapo_learner_phase_seconds{phase="actor_update"}',
                 'vapo_learner_eval_accuracy{metric="avg_at_k"}', "vapo_learner_staleness_bucket",
                 'vapo_learner_grad_norm{model="critic"}', "vapo_learner_weights_published_total 3.0",
                 'vapo_learner_mfu{phase="step"}', 'vapo_learner_tflops_per_rank{phase="actor_update"}'):
        assert name in text, name


def test_resume_republishes_the_checkpoint_weights_when_newer_ones_were_published(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from learner.weights import complete_versions, latest_update

    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.total_steps=3", "learner.batch_groups=2", "learner.checkpoint_every=2",
                             "learner.eval_every=0", "learner.keep_weights=10", "metrics.prometheus=false",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    groups = synth_groups(10, 2, 60, seed=4)
    Runner(cfg, ListSource(groups)).start().run()  # publishes v0..v3, checkpoints v2 and (final) v3
    # A phase is timed only in a step it ran in: the checkpoint at v2 (checkpoint_every=2), not at v1 or v3
    # (the final v3 checkpoint comes after the last step's record); a publish every step (weights_every=1).
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [("checkpoint" in r["phase_seconds"], "publish" in r["phase_seconds"], "eval" in r["phase_seconds"])
            for r in recs] == [(False, True, False), (True, True, False), (False, True, False)]
    # A crash after v3 was published but before its checkpoint was complete: resume finds checkpoint v2.
    (tmp_path / "r" / "checkpoints" / "v3" / "COMPLETE").unlink()
    weights = tmp_path / "r" / "weights"
    stable_v3 = (weights / "v3" / "STABLE").read_text()

    def tensors(v: int) -> dict:
        return load_file(str(weights / f"v{v}" / "model.safetensors"))

    cfg.learner.total_steps = 5
    r = Runner(cfg, ListSource(groups))
    # Constructing loads nothing, binds nothing, publishes nothing; run() without start() refuses.
    assert r.learner.version == 0 and r.publisher is None and r.endpoints is None
    assert latest_update(weights).version == 3 and complete_versions(weights) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="start"):
        r.run()
    assert r.start() is r
    # The actors serve v3 (trained past the checkpoint): the learner must not continue as v3 with v2's
    # weights. It publishes what it holds, v2's weights, under the fresh number v4.
    assert r.learner.version == 4
    assert complete_versions(weights) == [0, 1, 2, 3, 4]
    assert r.publisher is not None and r.publisher.latest is not None and r.publisher.latest.version == 4
    assert latest_update(weights).version == 4  # what a (re)connecting actor's WeightQuery gets
    v2, v3, v4 = tensors(2), tensors(3), tensors(4)
    assert all(torch.equal(v2[k], v4[k]) for k in v2)
    assert any(not torch.equal(v3[k], v4[k]) for k in v3)  # v3 really held other weights
    assert (weights / "v3" / "STABLE").read_text() == stable_v3  # never rewritten
    # A second crash before any update: v4 was checkpointed, so the next resume continues at v4 and
    # does not skip yet another number (each skip moves the version further past the buffer's batches).
    r.publisher.close()
    r = Runner(cfg, ListSource(groups)).start()
    assert r.learner.version == 4 and complete_versions(weights) == [0, 1, 2, 3, 4]
    learner = r.run()
    assert learner.version == 5 and complete_versions(weights)[-1] == 5
    steps = [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 5]  # v4 is a republication, not an update


def test_distributed_transport_writes_in_background_and_never_reuses_a_pushed_version(tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    """With learner.weight_transport=distributed and no engine in the group yet, every version still lands
    on disk (the background durable writer), and a learner resumed behind a version that was broadcast but
    never made it to disk (a crash between the push and its write) numbers past it."""
    from learner.weights import complete_versions

    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.total_steps=2", "learner.batch_groups=2", "learner.checkpoint_every=2",
                             "learner.eval_every=0", "learner.keep_weights=10", "metrics.prometheus=false",
                             "learner.weight_transport=distributed", "learner.push_addr=tcp://127.0.0.1:0",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    groups = synth_groups(10, 2, 60, seed=4)
    learner = Runner(cfg, ListSource(groups)).start().run()
    weights = tmp_path / "r" / "weights"
    assert learner.version == 2 and complete_versions(weights) == [0, 1, 2]
    text = generate_latest(learner.metrics.registry).decode()
    assert 'vapo_learner_weight_pushes_total{outcome="no_group"} 3.0' in text
    assert "vapo_learner_weights_published_total 3.0" in text
    (weights / "PUSHED").write_text(json.dumps({"version": 3}))  # v3 reached engines; its disk copy did not
    cfg.learner.total_steps = 5
    r = Runner(cfg, ListSource(groups)).start()
    assert r.learner.version == 4  # v2's weights (the checkpoint) republished under a fresh number
    r.push.close()
    r.publisher.close()
    assert complete_versions(weights) == [0, 1, 2, 4]


def test_each_step_record_carries_the_counts_its_source_keeps() -> None:
    """Dropped groups were generated (paid for) but never trained on: the buffer's source counts them, a
    list source counts only what it served, and no source (ranks other than 0) gives no totals."""
    buffered = BufferSource("tcp://127.0.0.1:1", 1, client=object())  # the client is never asked here
    buffered.groups_consumed, buffered.stale_dropped, buffered.filtered = 5, 2, 1
    assert source_totals(buffered) == {"groups_consumed_total": 5, "stale_dropped_total": 2, "filtered_total": 1}
    listed = ListSource(synth_groups(2, 2, 10, seed=1))
    listed.get_batch(0, 3)
    assert source_totals(listed) == {"groups_consumed_total": 3}
    assert source_totals(None) == {}


# learner.runner.main in a process of its own (it ends with the process group torn down, and DeepSpeed's
# module-level state would keep the destroyed group for every later learner built in this pytest process),
# with value pretraining replaced by a probe: whether something already listens on push_addr's port (the
# push coordinator) when pretraining starts. argv: a JSON list of [push_addr, [main's args]] cases, run in
# turn (one interpreter start for all); prints one JSON line: per case, the probe's answers and how main ended.
MAIN_PROBE = textwrap.dedent("""
    import json, socket, sys
    import learner.runner
    from common.config import ConfigError
    from learner.runner import main

    class Stop(Exception):
        pass

    def run(push_addr, args):
        host, port = push_addr.removeprefix("tcp://").rsplit(":", 1)
        bound = []

        def probe(*a, **kw):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, int(port)))
                    bound.append(False)
                except OSError:
                    bound.append(True)
            raise Stop

        learner.runner.pretrain_critic = probe
        try:
            main(args)
            ended = "returned"
        except Stop:
            ended = "pretraining"
        except ConfigError as e:
            ended = "ConfigError: " + str(e)
        return {{"bound": bound, "ended": ended}}

    print(json.dumps([run(addr, args) for addr, args in json.loads(sys.argv[1])]))
""")


def _main_until_pretraining(tmp_path: Path, tiny_model_dir: Path, cases: list[tuple[str, list[str]]]) -> list[dict]:
    """Run ``learner.runner.main`` once per ``(push_addr, extra args)`` case, in one subprocess, until value
    pretraining would begin (``MAIN_PROBE``)."""
    harness = tmp_path / "main_probe.py"
    harness.write_text(MAIN_PROBE.format())
    runs = []
    for i, (push_addr, extra) in enumerate(cases):
        runs.append([push_addr, [f"run.root={tmp_path}", f"run.name=r{i}", f"model.path={tiny_model_dir}",
                                 "metrics.prometheus=false", "learner.weight_transport=distributed",
                                 f"learner.push_addr={push_addr}", f"learner.publish_addr=tcp://127.0.0.1:{free_port()}",
                                 f"learner.query_addr=tcp://127.0.0.1:{free_port()}",
                                 f"buffer.serve_addr=tcp://127.0.0.1:{free_port()}", *extra]])
    p = subprocess.run([sys.executable, str(harness), json.dumps(runs)], env=child_env(), capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_push_socket_is_bound_before_value_pretraining(tiny_model_dir: Path, tmp_path: Path) -> None:
    """paper.yaml's value pretraining takes hours: learner rank 0 used to bind learner.push_addr only after it."""
    out = _main_until_pretraining(tmp_path, tiny_model_dir, [(f"tcp://127.0.0.1:{free_port()}", [])])
    assert out == [{"bound": [True], "ended": "pretraining"}]


# Each case: the key named, extra overrides, the refusal expected. An address of another host (a placeholder
# left in the config): the learner stops at once, naming the key, instead of after value pretraining with
# "Cannot assign requested address".
FOREIGN_ADDRESS_CASES = {
    "learner.push_addr": ([], "learner.push_addr: cannot bind tcp://198.51.100.7"),
    "learner.push_master_address": (["learner.push_master_address=198.51.100.7", "learner.push_master_port=29501",
                                     "placement.store_protection=private_network"],
                                    "learner.push_master_address / push_master_port: the weight group's store cannot "
                                    "listen on 198.51.100.7:29501: Cannot assign requested address"),
    "learner.push_master_port": (["learner.push_master_address=198.51.100.7"], "learner.push_master_port: 0"),
}


@pytest.fixture(scope="module")
def foreign_address_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The three cases of ``FOREIGN_ADDRESS_CASES`` in one subprocess (one torch/DeepSpeed import for all)."""
    from common.security import generate_run_keys

    tmp = tmp_path_factory.mktemp("foreign")
    keys = generate_run_keys(tmp / "keys")  # a non-loopback bind needs them (refused earlier without)
    cases = []
    for key, (extra, _) in FOREIGN_ADDRESS_CASES.items():
        addr = "tcp://198.51.100.7:5559" if key == "learner.push_addr" else f"tcp://127.0.0.1:{free_port()}"
        cases.append((addr, [f"buffer.curve.keys_dir={keys}", *extra]))
    return dict(zip(FOREIGN_ADDRESS_CASES, _main_until_pretraining(tmp, tiny_model_dir, cases), strict=True))


@pytest.mark.parametrize("key", list(FOREIGN_ADDRESS_CASES))
def test_a_push_address_this_host_lacks_fails_before_value_pretraining(foreign_address_runs: dict[str, dict],
                                                                        key: str) -> None:
    """An address of another host: refused naming ``key`` before value pretraining, nothing bound."""
    out, match = foreign_address_runs[key], FOREIGN_ADDRESS_CASES[key][1]
    assert out["bound"] == [] and out["ended"].startswith("ConfigError: ") and match in out["ended"], out
