"""Evaluation sets end to end: ``ops/launch.sh`` on the smoke config (its tiny addition base; about 25 s), with
two set files written here (addition questions; one set with two data sources). Both sets and the held-out
slice are evaluated in process at the base and after the last step, each with its own k, and show up apart
in metrics.jsonl, the launcher's eval lines and the end-of-run summary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]


def _set_file(path: Path, rows: list[tuple[str, str | None]]) -> Path:
    lines = []
    for q, source in rows:
        a, b = (int(x) for x in q.split("+"))
        lines.append(json.dumps({"question": f"Q:{q}\n", "answer": str(a + b), **({"data_source": source} if source else {})}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow  # a launched run (~16 s); the smoke run in tests/ops/test_launch.py carries two evaluation sets by default
def test_two_eval_sets_are_reported_apart_in_the_records_and_the_summary(tmp_path: Path) -> None:
    sums = _set_file(tmp_path / "sums.jsonl", [("3+4", "one_digit"), ("5+2", "one_digit"), ("12+34", "two_digit"),
                                                ("51+8", "two_digit"), ("27+45", "two_digit")])
    more = _set_file(tmp_path / "more.jsonl", [("101+22", None), ("7+7", None)])
    sets = f"task.eval_sets=[{{name: sums, path: {sums}, k: 3}}, {{name: more, path: {more}, max_new_tokens: 40}}]"
    proc = subprocess.run(
        ["ops/launch.sh", "ops/configs/smoke.yaml", f"run.root={tmp_path}", "run.name=sets", *port_overrides(),
         "metrics.prometheus=false", sets],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "sets"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r if r["kind"] == "eval" else r["eval"] for r in records if r["kind"] == "eval" or "eval" in r]
    assert len(evals) == 2, evals  # the base policy's and the last step's (smoke: eval_every = total_steps = 3)
    for e in evals:
        assert list(e["sets"]) == ["heldout", "sums", "more"]
        assert isinstance(e["avg_at_k"], float) and e["n_prompts"] == 32  # the held-out slice, at the top level as before
        for name, s in e["sets"].items():
            assert 0.0 <= s["avg_at_k"] <= s["pass_at_k"] <= 1.0, (name, s)
        heldout, s1, s2 = e["sets"]["heldout"], e["sets"]["sums"], e["sets"]["more"]
        assert (heldout["k"], s1["k"], s2["k"]) == (2, 3, 2)  # learner.eval_k = 2 unless the set says
        assert (s1["max_new_tokens"], s2["max_new_tokens"]) == (48, 40)
        assert (s1["n_prompts"], s2["n_prompts"]) == (5, 2)
        assert {k: v["n_prompts"] for k, v in s1["by_data_source"].items()} == {"one_digit": 2, "two_digit": 3}
        assert list(s2["by_data_source"]) == ["more"]
        for fig in s1["by_data_source"].values():
            assert 0.0 <= fig["avg_at_k"] <= fig["pass_at_k"] <= 1.0
    assert "eval heldout avg@2 " in out and "| eval sums avg@3 " in out and "| eval more avg@2 " in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["eval_sets"]) == ["heldout", "sums", "more"]
    assert summary["eval_sets"]["sums"]["final_step"] == 3 and summary["eval_sets"]["sums"]["base_avg_at_k"] is not None
    assert set(summary["eval_sets"]["sums"]["final_by_data_source"]) == {"one_digit", "two_digit"}
    assert "evaluation sets" in out and "two_digit" in out  # the summary's table, one row per data_source
    assert (run_dir / "plots" / "eval_sets.png").is_file()
