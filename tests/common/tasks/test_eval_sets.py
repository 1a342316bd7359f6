"""common.tasks.eval_sets and the task.eval_sets config: set files read into eval prompts, the sets one
evaluation covers, entries validated at load, missing files named by the preflight. Real files in tmp_path."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import ConfigError, TaskConfig, load_config, save_config
from common.preflight import missing_files
from common.tasks import get_task
from common.tasks.eval_sets import HELDOUT, eval_sets, load_eval_set
from common.tasks.jsonl_task import INSTRUCTION


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_set_file_becomes_eval_prompts_with_the_instruction_and_data_sources(tmp_path: Path) -> None:
    f = _write(tmp_path / "s.jsonl", [
        {"question": "Q:1+2\n", "answer": "3", "data_source": "easy"},
        "",  # blank lines are skipped
        {"question": "Q:40+2\n", "answer": 42, "extra_info": {"id": 7}},
    ])
    ps = load_eval_set(str(f), "mini", TaskConfig(name=f"jsonl:{f}"))
    assert [p.text for p in ps] == ["Q:1+2\n" + INSTRUCTION, "Q:40+2\n" + INSTRUCTION]  # as a jsonl task asks
    assert [p.answer for p in ps] == ["3", "42"]
    assert [p.data_source for p in ps] == ["easy", "mini"]  # no data_source: the set's name
    assert {p.split for p in ps} == {"eval"} and {p.bucket for p in ps} == {"mini"}
    assert [p.index for p in ps] == [0, 1] and len({p.prompt_id for p in ps}) == 2
    assert ps[0].extra_info == "" and json.loads(ps[1].extra_info) == {"id": 7}
    # The training task's instruction: none for the addition task, task.instruction when set.
    assert [p.text for p in load_eval_set(str(f), "mini", TaskConfig())] == ["Q:1+2\n", "Q:40+2\n"]
    assert load_eval_set(str(f), "mini", TaskConfig(instruction=" Go."))[0].text == "Q:1+2\n Go."
    # problem/solution columns, as the jsonl task reads them
    g = _write(tmp_path / "p.jsonl", [{"problem": "Q:3+4\n", "solution": "7"}])
    assert [(p.text, p.answer) for p in load_eval_set(str(g), "p", TaskConfig())] == [("Q:3+4\n", "7")]


def test_a_set_in_verls_parquet_layout_and_as_a_saved_dataset_reads_as_its_jsonl(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"Q:{i}+1\n"}], "reward_model": {"ground_truth": str(i + 1)},
             "data_source": "aime" if i % 2 else "amc", "extra_info": {"i": i}} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    jsonl = _write(tmp_path / "s.jsonl", rows)
    # A training config naming other columns: a set without them is read by the recognised ones.
    cfg = TaskConfig(prompt_key="query", answer_key="gold")
    want = load_eval_set(str(jsonl), "s", cfg)
    assert [p.messages for p in want] == [(("user", f"Q:{i}+1\n"),) for i in range(6)]
    assert [p.data_source for p in want] == ["amc", "aime"] * 3 and want[5].answer == "6"
    for path in (tmp_path / "s.parquet", tmp_path / "saved"):
        assert load_eval_set(str(path), "s", cfg) == want


@pytest.mark.parametrize(("rows", "message"), [
    (["{not json"], "s.jsonl:1: invalid JSON"),
    ([[1, 2]], "s.jsonl:1: a line must be a JSON object"),
    ([{"answer": "1"}], "no prompt column"),
    ([""], "has no rows"),
    ([{"question": "q"}], "no answer column"),
    ([{"question": "q", "answer": " "}], r"no usable rows \(1 bad row of 1: 1 without an answer \(row 0\)\)"),
])
def test_a_bad_set_file_is_refused_naming_the_set_and_what_is_wrong(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(ValueError, match=r"eval set 's'.*" + message):
        load_eval_set(str(_write(tmp_path / "s.jsonl", rows)), "s", TaskConfig())


def test_a_sets_bad_rows_are_skipped_and_reported_or_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = _write(tmp_path / "s.jsonl", [{"question": "Q:1+1\n", "answer": "2"}, {"question": "Q:2+2\n", "answer": ""}])
    with caplog.at_level(logging.WARNING, logger="vapo.tasks"):
        assert [p.answer for p in load_eval_set(str(f), "s", TaskConfig())] == ["2"]
    assert "1 bad row of 2: 1 without an answer (row 1); skipped" in caplog.text
    with pytest.raises(ValueError, match=r"1 without an answer \(row 1\).*task.bad_rows=error"):
        load_eval_set(str(f), "s", TaskConfig(bad_rows="error"))


def test_a_missing_set_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eval set 'gone': file not found"):
        load_eval_set(str(tmp_path / "gone.jsonl"), "gone", TaskConfig())


def test_the_sets_of_an_evaluation_resolve_k_and_the_response_limit(tmp_path: Path) -> None:
    f = _write(tmp_path / "s.jsonl", [{"question": "Q:1+1\n", "answer": "2"}])
    base = ["task.eval_size=5", "learner.eval_k=3", "actors.max_new_tokens=40"]
    cfg = load_config(None, base)
    task = get_task(cfg.task)
    only = eval_sets(cfg, task)  # nothing configured: the held-out slice, as always
    assert [(s.name, len(s.prompts), s.k, s.max_new_tokens) for s in only] == [(HELDOUT, 5, 3, 40)]
    assert list(only[0].prompts) == task.eval_prompts()
    sets = f"task.eval_sets=[{{name: a, path: {f}}}, {{name: b, path: {f}, k: 7, max_new_tokens: 9}}]"
    cfg = load_config(None, [*base, sets])
    assert [(s.name, len(s.prompts), s.k, s.max_new_tokens) for s in eval_sets(cfg, task)] == [
        (HELDOUT, 5, 3, 40), ("a", 1, 3, 40), ("b", 1, 7, 9)]
    cfg = load_config(None, [*base, sets, "task.eval_heldout=false"])
    assert [s.name for s in eval_sets(cfg, task)] == ["a", "b"]


@pytest.mark.parametrize(("entries", "message"), [
    ("[{name: a, path: x.jsonl, kk: 4}]", r"task.eval_sets\[0\].kk: unknown field; an entry takes name, path, k, max_new_tokens"),
    ("[{name: a, path: x.jsonl}, {name: a, path: y.jsonl}]", "task.eval_sets: set names must be unique; repeated: a"),
    ("[{name: 'a b', path: x.jsonl}]", r"task.eval_sets\[0\].name: 'a b': needs 1-64 of"),
    ("[{name: heldout, path: x.jsonl}]", r"task.eval_sets\[0\].name: 'heldout'"),
    ("[{name: a}]", r"task.eval_sets\[0\].path: must name the set's file"),
    ("[{name: a, path: x.jsonl, k: -1}]", r"task.eval_sets\[0\].k: must be >= 0"),
    ("[{name: a, path: x.jsonl, max_new_tokens: -1}]", r"task.eval_sets\[0\].max_new_tokens: must be >= 0"),
    ("[{name: a, path: x.jsonl, k: two}]", r"task.eval_sets\[0\].k: expected an int"),
    ("[aime]", r"task.eval_sets\[0\]: expected a mapping with name, path, k, max_new_tokens"),
])
def test_a_bad_entry_is_a_config_error_naming_it(entries: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"task.eval_sets={entries}"])


def test_eval_sets_from_yaml_survive_the_saved_config(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("task:\n  eval_sets:\n    - {name: aime24, path: data/aime.jsonl, k: 32}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.task.eval_sets[0].name == "aime24" and cfg.task.eval_sets[0].k == 32
    assert load_config(save_config(cfg, tmp_path / "saved.yaml")).task.eval_sets == cfg.task.eval_sets


def test_the_preflight_names_a_missing_set_file(tmp_path: Path) -> None:
    cfg = load_config(None, ["task.eval_sets=[{name: a, path: data/a.jsonl}, {name: b, path: data/b.jsonl}]"])
    (tmp_path / "data").mkdir()
    _write(tmp_path / "data" / "a.jsonl", [{"question": "q", "answer": "1"}])
    assert missing_files(cfg, tmp_path) == [f"task.eval_sets[1].path (b): file {tmp_path / 'data' / 'b.jsonl'} does not exist"]
