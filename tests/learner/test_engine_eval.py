"""Held-out evaluation at scale: dealt over every engine, and off the training path.

Before, a multi-rank learner evaluated on one engine (engine 0), synchronously between steps, under one
deadline (learner.eval_timeout_s, 3600 s): at paper.yaml's size that evaluation could never finish and was
logged as failed, while training stood still. Now the prompts are dealt round-robin to every engine
(``evaluate_on_engines``) and rank 0 runs the evaluation in a background thread (``BackgroundEval``): submit
returns at once, limits derive from the work's size, and each record names the versions it evaluated.
Real ``actors.rollout_server`` engines serve the tiny base.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.config import load_config
from tests.learner.synth import child_env
from tests.polling import wait_for
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SMALL = ["task.eval_size=4", "learner.eval_k=2", "actors.max_new_tokens=6", "metrics.prometheus=false"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[list[str]]:
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            p = subprocess.Popen(
                [sys.executable, "-m", "actors.rollout_server", "--model-path", str(tiny_model_dir),
                 "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--weight-version", "0",
                 "--threads", "1"], cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True)
            procs.append(p)
            urls.append(f"http://127.0.0.1:{port}")
        for p in procs:
            ready = p.stdout.readline()  # type: ignore[union-attr]  # blocks until the ready line (or EOF)
            assert "ready" in ready, (ready, p.poll())
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def _parts(model: Path) -> tuple:
    from common.modeling import load_tokenizer
    from common.tasks import get_task

    cfg = load_config(None, [f"model.path={model}", *SMALL])
    return cfg, load_tokenizer(str(model)), get_task(cfg.task)


def test_the_prompts_are_dealt_over_every_engine(tiny_model_dir: Path, engines: list[str]) -> None:
    from learner.engine_eval import evaluate_on_engines

    cfg, tok, task = _parts(tiny_model_dir)
    two = evaluate_on_engines(engines, tok, task, version=0, k=2, max_new_tokens=6)
    one = evaluate_on_engines(engines[:1], tok, task, version=0, k=2, max_new_tokens=6)
    assert two["engine_urls"] == engines and two["prompts_per_engine"] == [2, 2] and two["n_prompts"] == 4
    assert two["weight_versions_evaluated"] == [0, 0]
    # Greedy answers do not depend on which engine generated them: the report puts each back in its place.
    assert two["greedy_accuracy"] == one["greedy_accuracy"]
    assert {b: v["greedy_accuracy"] for b, v in two["by_bucket"].items()} == \
        {b: v["greedy_accuracy"] for b, v in one["by_bucket"].items()}


def test_engine_urls_default_to_every_engine_of_a_one_host_run() -> None:
    from learner.engine_eval import eval_engine_urls

    cfg = load_config(None, ["actors.num_actors=3", "engine.base_port=31000"])
    assert eval_engine_urls(cfg) == [f"http://127.0.0.1:{31000 + i}" for i in range(3)]
    cfg = load_config(None, ["actors.num_actors=3", "engine.base_port=31000", "learner.eval_engine_url=http://h:1/"])
    assert eval_engine_urls(cfg) == ["http://h:1"]
    cfg = load_config(None, ["learner.eval_engine_urls=[http://a:1,http://b:2]"])
    assert eval_engine_urls(cfg) == ["http://a:1", "http://b:2"]


def test_background_evaluation_returns_at_once_skips_stale_versions_and_records(
        tiny_model_dir: Path, engines: list[str]) -> None:
    from learner.eval_worker import BackgroundEval

    cfg, tok, task = _parts(tiny_model_dir)
    cfg.engine.weight_load_timeout_s, cfg.engine.health_timeout_s = 2.0, 0.5
    records: list[dict] = []
    evals = BackgroundEval(cfg, tok, task, records.append, urls=engines)
    t0 = time.monotonic()
    evals.submit(5)  # the engines serve version 0: this one waits for weights that never come, then fails
    assert time.monotonic() - t0 < 0.5  # training is not held up
    wait_for(lambda: evals._running == 5, 10.0, "the evaluation of v5 to start")
    evals.submit(0)
    evals.submit(0)  # replaces the v0 still waiting: at most one evaluation queues behind the running one
    assert evals.finish(120.0)
    kinds = [(r["weight_version"], "skipped" if r.get("skipped") else "error" if "error" in r else "ok") for r in records]
    assert kinds == [(0, "skipped"), (5, "error"), (0, "ok")], kinds
    done = records[-1]
    assert done["kind"] == "eval" and done["n_prompts"] == 4 and done["weight_versions_evaluated"] == [0, 0]
    assert done["prompts_per_engine"] == [2, 2] and 0.0 <= done["avg_at_k"] <= 1.0
    json.dumps(records)  # every record is a metrics.jsonl line


def test_background_evaluation_covers_every_set_with_its_own_k(tiny_model_dir: Path, engines: list[str],
                                                               tmp_path: Path) -> None:
    from learner.eval_worker import BackgroundEval

    f = tmp_path / "two.jsonl"
    f.write_text('{"question": "Q:1+2\\n", "answer": "3", "data_source": "a"}\n'
                 '{"question": "Q:4+4\\n", "answer": "8", "data_source": "b"}\n'
                 '{"question": "Q:5+1\\n", "answer": "6", "data_source": "b"}\n')
    cfg, tok, task = _parts(tiny_model_dir)
    cfg.task.eval_sets = load_config(None, [f"task.eval_sets=[{{name: two, path: {f}, k: 3, max_new_tokens: 4}}]"]).task.eval_sets
    records: list[dict] = []
    evals = BackgroundEval(cfg, tok, task, records.append, urls=engines)
    evals.submit(0)
    assert evals.finish(120.0)
    (rec,) = records
    assert "error" not in rec, rec
    assert rec["n_prompts"] == 4 and rec["k"] == 2  # the held-out slice at the top level, as before
    two = rec["sets"]["two"]
    assert (two["n_prompts"], two["k"], two["max_new_tokens"]) == (3, 3, 4)
    assert set(two["by_data_source"]) == {"a", "b"} and two["by_data_source"]["b"]["n_prompts"] == 2
    assert 0.0 <= two["avg_at_k"] <= two["pass_at_k"] <= 1.0
    assert two["mean_response_length"] <= 4  # this set's response limit, not actors.max_new_tokens
    assert rec["weight_versions_evaluated"] == [0, 0]
    json.dumps(rec)
