"""actors.cursor: the durable prompt cursor survives restarts without repeating or skipping prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from actors.cursor import CursorError, PromptCursor, group_id_for


def test_shard_indices_and_out_of_order_completion_persist(tmp_path: Path) -> None:
    path = tmp_path / "cursor-1.json"
    c = PromptCursor(path, actor_id=1, num_actors=3)
    ks = [c.take() for _ in range(5)]
    assert ks == [0, 1, 2, 3, 4]
    assert [c.index(k) for k in ks] == [1, 4, 7, 10, 13]
    for k in (3, 1, 0):
        c.complete(k)
    assert json.loads(path.read_text()) == {"actor_id": 1, "num_actors": 3, "next": 2, "done": [3]}
    # a restart (2 and 4 were in flight and are lost) resumes at 2, skips 3, continues at 4, 5, ...
    r = PromptCursor(path, actor_id=1, num_actors=3)
    assert r.completed == 3
    assert [r.take() for _ in range(3)] == [2, 4, 5]


def test_random_crashes_never_skip_or_repeat_an_acknowledged_prompt(tmp_path: Path) -> None:
    rng = random.Random(0)
    path = tmp_path / "c.json"
    acked: list[int] = []
    limit = 200
    c = PromptCursor(path, 0, 1, limit=limit)
    while not c.finished():
        in_flight = [k for k in (c.take() for _ in range(rng.randint(1, 8))) if k is not None]
        rng.shuffle(in_flight)
        for k in in_flight[: rng.randint(0, len(in_flight))]:
            c.complete(k)
            acked.append(k)
        if rng.random() < 0.3:  # crash: everything not completed is forgotten
            c = PromptCursor(path, 0, 1, limit=limit)
    assert sorted(acked) == list(range(limit))  # each prompt acknowledged exactly once, none skipped
    assert c.take() is None and c.exhausted()


def test_release_reissues_before_newer_prompts(tmp_path: Path) -> None:
    c = PromptCursor(tmp_path / "c.json", 0, 2)
    assert [c.take(), c.take(), c.take()] == [0, 1, 2]
    c.release(1)
    assert c.take() == 1 and c.take() == 3


def test_refuses_a_cursor_of_another_sharding_and_garbage(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    c = PromptCursor(path, 0, 2)
    c.complete(c.take())
    with pytest.raises(CursorError, match="num_actors"):
        PromptCursor(path, 0, 4)
    path.write_text("{not json")
    with pytest.raises(CursorError, match="cannot read"):
        PromptCursor(path, 0, 2)
    with pytest.raises(ValueError):
        PromptCursor(tmp_path / "x.json", 2, 2)


def test_group_ids_are_deterministic_and_distinct() -> None:
    assert group_id_for(3, 17) == group_id_for(3, 17) == "a3-p17"
    assert len({group_id_for(a, i) for a in range(4) for i in range(50)}) == 200
