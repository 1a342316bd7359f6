"""The chaos run's invariant checker on hand-made histories (each check can fail) and its reader on a real
buffer directory and run directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

from buffer.store import BufferStore, GroupRecord
from common.protocol import SampleGroup, encode
from ops.chaos.history import History, check, published_versions, read_history
from tests.buffer.fixtures import make_group


def record(g: SampleGroup) -> GroupRecord:
    return GroupRecord(g.group_id, encode(g), g.weight_version, len(g.samples), [])


def good() -> History:
    """Four groups acked; two served at learner version 1, one dropped stale at 2, one still waiting."""
    return History(
        stored={(0, 0), (1, 1), (1, 2), (2, 3)}, waiting={(2, 3)},
        takes=[{"learner_version": 1, "min_version": 0, "served": [(0, 0), (1, 1)], "dropped": []},
               {"learner_version": 3, "min_version": 2, "served": [], "dropped": [(1, 2)]}],
        max_staleness=1, published=[1, 2, 3], engine_versions={"actor-0": 3, "actor-1": 3}, total_steps=3,
        learner_done=True, accuracy=0.70, reference_accuracy=0.72, tolerance=0.05)


def failing(h: History) -> set[str]:
    return {name for name, v in check(h).items() if not v["pass"]}


def test_a_good_history_passes_every_invariant() -> None:
    verdicts = check(good())
    assert all(v["pass"] for v in verdicts.values()), verdicts
    assert len(verdicts) == 8
    assert verdicts["none_served_twice"]["served"] == 2


def test_a_lost_group_fails() -> None:
    h = good()
    h.stored.add((2, 4))  # acknowledged, never served, not waiting, not dropped
    assert failing(h) == {"no_acked_group_lost"}
    assert check(h)["no_acked_group_lost"]["examples"] == [(2, 4)]


def test_a_group_served_twice_fails() -> None:
    h = good()
    h.takes.append({"learner_version": 2, "min_version": 1, "served": [(1, 1)], "dropped": []})
    assert failing(h) == {"none_served_twice"}
    h = good()
    h.waiting.add((0, 0))  # served and still stored: it could be served again
    assert failing(h) == {"none_served_twice"}


def test_a_served_group_never_acknowledged_fails() -> None:
    h = good()
    h.takes[0]["served"].append((0, 9))
    assert "no_acked_group_lost" in failing(h)


def test_a_stale_serve_fails() -> None:
    h = good()
    h.stored.add((0, 5))
    h.takes.append({"learner_version": 3, "min_version": 0, "served": [(0, 5)], "dropped": []})
    assert failing(h) == {"served_within_staleness"}
    assert check(h)["served_within_staleness"]["worst"] == 3


def test_versions_going_backwards_or_reused_fail() -> None:
    for published in ([1, 3, 2, 3], [1, 2, 2, 3]):
        h = good()
        h.published = published
        assert failing(h) == {"versions_strictly_increasing"}, published


def test_an_engine_behind_the_final_version_fails() -> None:
    h = good()
    h.engine_versions["actor-1"] = 2
    assert failing(h) == {"engines_on_final_version"}


def test_a_short_run_low_accuracy_and_leftovers_fail() -> None:
    h = good()
    h.published, h.engine_versions = [1, 2], {"actor-0": 2}
    assert failing(h) == {"reached_total_steps"}
    h = good()
    h.accuracy = 0.66
    assert failing(h) == {"accuracy_within_tolerance"}
    h = good()
    h.leftovers = ["process 123: python -m buffer"]
    assert failing(h) == {"nothing_left_behind"}


def test_read_history_from_a_buffer_and_a_run_directory(tmp_path: Path) -> None:
    buf, run = tmp_path / "buffer", tmp_path / "run"
    st = BufferStore(buf, record_served=True)
    st.put_groups([record(make_group(f"g{i}", version=v)) for i, v in enumerate([0, 1, 1, 2])])
    st.set_learner_version(1)
    assert len(st.take_groups(2, min_version=0)[0]) == 2
    st.set_learner_version(3)
    assert st.take_groups(1, min_version=2)[1] == 1  # g2 (version 1) dropped, g3 served
    st.close()
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "learner_step", "weight_version": v, "time": 10.0 + v})
                                               + "\n" for v in (1, 2, 4)))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(12)) + ",500"  # logging's local time
    (run / "logs" / "learner.log").write_text(
        f"{stamp} learner[0] WARNING weights v2 exist beyond checkpoint v1; republishing the "
        "checkpoint's weights as v3\n")
    assert published_versions(run) == [1, 2, 3, 4]  # the republished v3 between the steps, by time
    # Across hosts pdsh puts "<host>: " before each line, and every rank logs the republish: rank 0's counts, once.
    (run / "logs" / "learner.log").write_text("".join(
        f"h{r}: {stamp} learner[{r}] WARNING weights v2 exist beyond checkpoint v1; republishing the "
        "checkpoint's weights as v3\n" for r in (0, 1)))
    assert published_versions(run) == [1, 2, 3, 4]
    (run / "logs" / "actor-0.log").write_text("actor 0: serving weights v2 (0.1 s after publish)\n"
                                              'ACTOR DONE {"weight_version": 4}\n')
    (run / "learner_done.json").write_text("{}")
    (run / "summary.json").write_text(json.dumps({"final_accuracy": 0.7, "base_accuracy": 0.5}))
    h = read_history(run, buf, max_staleness=1, total_steps=4)
    assert h.stored == {(0, 0), (1, 1), (1, 2), (2, 3)} and h.waiting == set()
    assert [t["served"] for t in h.takes] == [[(0, 0), (1, 1)], [(2, 3)]]
    assert h.takes[1]["dropped"] == [(1, 2)]
    assert h.engine_versions == {"actor-0": 4} and h.learner_done and h.reference_accuracy == 0.5
    assert all(v["pass"] for v in check(h).values()), check(h)
