"""actors.groups: a group's responses are scored together by the task's reward (a real reward pool, off the
event loop), and its errors and extra figures reach the actor's counters and metrics."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import pytest

from actors.groups import GroupMaker
from actors.samples import engine_sample
from common.config import load_config
from common.metrics import Metrics
from common.modeling import build_char_tokenizer
from common.protocol import IngestAck, SampleGroup
from common.sglang_client import GenerateOutput
from common.tasks import Prompt, get_task

USER = textwrap.dedent('''
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "boom":
            raise RuntimeError("boom")
        if solution_str == "slow":
            time.sleep(0.5)
        return {"score": float(solution_str == ground_truth), "chars": len(solution_str)}
''')


class _Unused:
    """The engine link of a maker whose scoring alone is tested: nothing is generated, so nothing is asked."""

    gate, client, version, owned = asyncio.Event(), None, 0, True

    def report_trouble(self) -> None:
        raise AssertionError("scoring does not talk to the engine")


def _output(tok, text: str) -> GenerateOutput:
    ids = tok.encode(text, add_special_tokens=False)
    return GenerateOutput(ids, [-0.5] * len(ids), "stop", None, "0", "0", 3, len(ids))


def test_a_group_is_scored_off_the_loop_with_errors_and_extras_counted(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(USER)
    cfg = load_config(None, [f"task.reward_by_source={json.dumps({'s': f'file:{tmp_path}/r.py:compute_score'})}"])
    task, metrics = get_task(cfg.task), Metrics("actor")
    tok = build_char_tokenizer()
    maker = GroupMaker(cfg, 0, task, _Unused(), tok,
                       lambda name, **labels: getattr(metrics, name).labels(actor="0", **labels), generate_timeout_s=10.0)
    prompt = Prompt("p", "q", "12", data_source="s")
    outs = [_output(tok, t) for t in ("12", "13", "boom", "slow")]

    async def score_while_ticking() -> tuple[list, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            return await maker._score(prompt, outs), ticks
        finally:
            ticker.cancel()

    try:
        task.verify_batch(prompt, ["12"])  # the pool starts before the timed part
        t0 = time.monotonic()
        verdicts, ticks = asyncio.run(score_while_ticking())
        took = time.monotonic() - t0
    finally:
        task.close()
    assert [(v.reward, v.error) for v in verdicts] == [(1.0, ""), (0.0, ""), (0.0, "exception"), (0.0, "")]
    assert took >= 0.5 and ticks >= 10, "the loop kept running while the pool scored the slow response"
    assert maker.counts.reward_errors == 1
    assert metrics.reward_errors.labels(actor="0", kind="exception")._value.get() == 1
    assert metrics.reward_extra.labels(actor="0", figure="chars")._value.get() == (2 + 2 + 4) / 3


def test_scored_groups_are_counted_per_data_source_with_a_bounded_label_set() -> None:
    cfg = load_config(None, ["buffer.positive_reward=1.0"])
    task, metrics = get_task(cfg.task), Metrics("actor")
    maker = GroupMaker(cfg, 0, task, _Unused(), build_char_tokenizer(),
                       lambda name, **labels: getattr(metrics, name).labels(actor="0", **labels), generate_timeout_s=10.0)

    def value(name: str, source: str) -> float:
        return getattr(metrics, name).labels(actor="0", data_source=source)._value.get()

    maker._by_source(Prompt("a", "q", "1", data_source="gsm8k"), [1.0, 0.0, 1.0, 1.0])
    maker._by_source(Prompt("b", "q", "1", data_source="gsm8k"), [0.0, 0.0, 0.0, 1.0])
    maker._by_source(Prompt("c", "q", "1"), [0.5, 0.5])  # no data_source: the task's name
    assert (value("source_samples", "gsm8k"), value("source_positives", "gsm8k")) == (8, 4)
    assert value("source_reward_mean", "gsm8k") == 0.25  # the last group's
    assert (value("source_samples", "addition"), value("source_positives", "addition")) == (2, 0)
    for i in range(40):  # a label per source up to 32, then "other"
        maker._by_source(Prompt(f"s{i}", "q", "1", data_source=f"src{i}"), [1.0])
    assert maker.sources == {"gsm8k", "addition", *(f"src{i}" for i in range(30)), "other"}
    assert value("source_samples", "other") == 10 and value("source_samples", "src29") == 1


def test_an_acknowledged_group_is_counted_in_the_makers_counts_and_metrics() -> None:
    cfg = load_config(None, ["buffer.positive_reward=1.0"])
    metrics, tok = Metrics("actor"), build_char_tokenizer()
    maker = GroupMaker(cfg, 0, get_task(cfg.task), _Unused(), tok,
                       lambda name, **labels: getattr(metrics, name).labels(actor="0", **labels), generate_timeout_s=10.0)
    samples = [engine_sample([1, 2], _output(tok, text), 0, reward)
               for text, reward in (("12", 1.0), ("3", 0.0), ("456", 1.0))]
    group = SampleGroup(group_id="a0-p0", prompt_id="p", task="addition", actor_id=0, samples=samples, created_at=0.0)
    maker.record(group, IngestAck(group_id="a0-p0", committed=True, duplicate=True, error="stale"), resent=2)
    c = maker.counts
    assert (c.groups, c.samples, c.tokens, c.positives, c.duplicates, c.not_served) == (1, 3, 2 + 1 + 3, 2, 1, 1)

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(f"vapo_actor_{name}", {"actor": "0", **labels})

    assert value("groups_not_served_total", reason="stale") == 1 and value("groups_resent_total") == 2
    assert value("reward_mean") == value("positives_rate") == 2 / 3 and value("tokens_total") == 6
    maker.record(group, IngestAck(group_id="a0-p1", committed=True, duplicate=False, error=""), resent=0)
    assert (c.groups, c.duplicates, c.not_served, value("groups_resent_total")) == (2, 1, 1, 2)


@pytest.mark.parametrize(("threshold", "expected"), [(0.5, 3), (1.0, 1)])
def test_positives_are_counted_at_buffer_positive_reward(threshold: float, expected: int) -> None:
    """One setting decides what a positive is: the actor's positives count and rate follow
    buffer.positive_reward, as the buffer's positives store, the learner's NLL mask and its replay count do."""
    cfg = load_config(None, [f"buffer.positive_reward={threshold}"])
    metrics, tok = Metrics("actor"), build_char_tokenizer()
    maker = GroupMaker(cfg, 0, get_task(cfg.task), _Unused(), tok,
                       lambda name, **labels: getattr(metrics, name).labels(actor="0", **labels), generate_timeout_s=10.0)
    samples = [engine_sample([1], _output(tok, "7"), 0, r) for r in (0.0, 0.5, 0.75, 1.0)]
    group = SampleGroup(group_id="a0-p0", prompt_id="p", task="addition", actor_id=0, samples=samples, created_at=0.0)
    maker.record(group, IngestAck(group_id="a0-p0", committed=True, duplicate=False, error=""), resent=0)
    assert maker.counts.positives == expected
    assert metrics.positives_rate.labels(actor="0")._value.get() == expected / 4
