"""common.tasks.eval_sets and the task.eval_sets config: set files read into eval prompts, the sets one
evaluation covers, entries validated at load, missing files named by the preflight. Real files in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

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
        {"problem": "Q:40+2\n", "solution": 42, "extra_info": {"id": 7}},
    ])
    ps = load_eval_set(str(f), "mini", TaskConfig())
    assert [p.text for p in ps] == ["Q:1+2\n" + INSTRUCTION, "Q:40+2\n" + INSTRUCTION]
    assert [p.answer for p in ps] == ["3", "42"]
    assert [p.data_source for p in ps] == ["easy", "mini"]  # no data_source: the set's name
    assert {p.split for p in ps} == {"eval"} and {p.bucket for p in ps} == {"mini"}
    assert [p.index for p in ps] == [0, 1] and len({p.prompt_id for p in ps}) == 2
    assert ps[0].extra_info == "" and json.loads(ps[1].extra_info) == {"id": 7}


@pytest.mark.parametrize(("rows", "message"), [
    (["{not json"], "s.jsonl:1: invalid JSON"),
    ([{"question": "q"}], "s.jsonl:1: need an object with 'question'"),
    ([{"answer": "1"}], "s.jsonl:1: need an object with 'question'"),
    ([[1, 2]], "s.jsonl:1: need an object"),
    ([""], "has no items"),
])
def test_a_bad_set_file_is_refused_naming_file_and_line(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_eval_set(str(_write(tmp_path / "s.jsonl", rows)), "s", TaskConfig())


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
    ("[{name: a}]", r"task.eval_sets\[0\].path: must name the set's jsonl file"),
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
