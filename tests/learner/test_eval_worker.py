"""learner.eval_worker: rank 0's background evaluation on the engines, off the training path: ``submit`` returns at
once, a version still waiting is replaced by a newer one (recorded as skipped), a failed evaluation is a record,
and every evaluation set is covered with its own k and response limit. Real ``actors.rollout_server`` engines
serve the tiny base (the ``engines`` fixture, tests/learner/conftest.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.config import Config, load_config
from common.modeling import load_tokenizer
from common.tasks import Task, get_task
from learner.eval_worker import BackgroundEval
from tests.polling import wait_for

SMALL = ["task.eval_size=4", "learner.eval_k=2", "actors.max_new_tokens=6", "metrics.prometheus=false"]


def _parts(model: Path) -> tuple[Config, object, Task]:
    cfg = load_config(None, [f"model.path={model}", *SMALL])
    return cfg, load_tokenizer(str(model)), get_task(cfg.task)


def test_background_evaluation_returns_at_once_skips_stale_versions_and_records(
        tiny_model_dir: Path, engines: list[str]) -> None:
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
