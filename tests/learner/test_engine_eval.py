"""Held-out evaluation at scale: dealt over every engine.

Before, a multi-rank learner evaluated on one engine (engine 0), synchronously between steps, under one
deadline (learner.eval_timeout_s, 3600 s): at paper.yaml's size that evaluation could never finish and was
logged as failed, while training stood still. Now the prompts are dealt round-robin to every engine
(``evaluate_on_engines``), limits derive from the work's size, and each record names the versions it evaluated;
the background thread that keeps it off the training path is tested in test_eval_worker.py. Real
``actors.rollout_server`` engines serve the tiny base (the ``engines`` fixture, tests/learner/conftest.py).
"""
from __future__ import annotations

from pathlib import Path

from common.config import load_config

SMALL = ["task.eval_size=4", "learner.eval_k=2", "actors.max_new_tokens=6", "metrics.prometheus=false"]


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
