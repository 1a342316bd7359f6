"""learner.evaluate: report fields, accounting against scripted generations, KV-cache sampling, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import learner.evaluate
from common.config import TaskConfig
from common.modeling import build_char_tokenizer, load_model, load_tokenizer
from common.tasks import encode_prompt, get_task
from common.tasks.addition import AdditionTask, teacher_response
from learner.evaluate import evaluate, generate, main, score

REPO = Path(__file__).resolve().parents[2]


def scripted(tokenizer: Any, wrong: bool = False) -> Any:
    """Stands in for generation: each prompt's response is the teacher's worked answer (``wrong``: one too
    high, to check that the accounting sees failures too) plus EOS, for every sample of every pass."""

    def script(prompt_ids: list[int]) -> list[int]:
        text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        a, b = (int(x) for x in text[2:].strip().split("+"))
        resp = teacher_response(SimpleNamespace(text=text))  # type: ignore[arg-type]
        resp = resp[: resp.rindex("A:")] + f"A:{a + b + (1 if wrong else 0)}"
        return tokenizer.encode(resp, add_special_tokens=False) + [tokenizer.eos_token_id]

    def fake(model: Any, prompt_ids: Any, passes: Any, *args: Any) -> list[list[list[list[int]]]]:
        return [[[script(list(p)) for _ in range(n)] for p in prompt_ids] for n, _ in passes]

    return fake


def _task(n: int = 24) -> AdditionTask:
    task = get_task(TaskConfig(eval_size=n))
    assert isinstance(task, AdditionTask)
    return task


def test_always_correct_model_scores_one_and_wrong_model_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    tok, task = build_char_tokenizer(), _task()
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(learner.evaluate, "_generate", scripted(tok))
    rep = evaluate(model, tok, task, k=4, max_new_tokens=96, batch_size=10)
    for key in ("task", "n_prompts", "k", "avg_at_k", "pass_at_k", "greedy_accuracy", "mean_response_length",
                "min_response_length", "max_response_length", "truncated_fraction", "by_bucket",
                "by_response_length", "seconds"):
        assert key in rep, key
    assert rep["n_prompts"] == 24 and rep["k"] == 4
    assert rep["avg_at_k"] == 1.0 and rep["greedy_accuracy"] == 1.0 and rep["pass_at_k"] == 1.0
    assert rep["truncated_fraction"] == 0.0
    expected = [len(tok.encode(teacher_response(p), add_special_tokens=False)) + 1 for p in task.eval_prompts()]
    assert rep["mean_response_length"] == sum(expected) / len(expected)
    assert rep["min_response_length"] == min(expected) and rep["max_response_length"] == max(expected)
    assert sum(b["n_prompts"] for b in rep["by_bucket"].values()) == 24
    assert all(b["avg_at_k"] == 1.0 for b in rep["by_bucket"].values())
    assert sum(b["n_samples"] for b in rep["by_response_length"].values()) == 24 * 4
    json.dumps(rep)

    monkeypatch.setattr(learner.evaluate, "_generate", scripted(tok, wrong=True))
    bad = evaluate(model, tok, task, k=2, max_new_tokens=96)
    assert bad["avg_at_k"] == 0.0 and bad["greedy_accuracy"] == 0.0 and bad["pass_at_k"] == 0.0


def test_score_accounting_mixed() -> None:
    tok, task = build_char_tokenizer(), _task(4)
    prompts = task.eval_prompts()

    def ids(text: str, eos: bool = True) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])

    right = [ids(teacher_response(p)) for p in prompts]
    wrong = [ids("A:0") for _ in prompts]
    sampled = [[right[0], right[0]], [right[1], wrong[1]], [wrong[2], wrong[2]], [wrong[3], ids(teacher_response(prompts[3]), eos=False)]]
    rep = score(task, tok, prompts, sampled, [right[0], wrong[1], wrong[2], right[3]], [tok.eos_token_id])
    assert rep["avg_at_k"] == (2 + 1 + 0 + 1) / 8
    assert rep["pass_at_k"] == 3 / 4
    assert rep["greedy_accuracy"] == 2 / 4
    assert rep["truncated_fraction"] == 1 / 8  # the response without EOS (still verified on its text)


def test_random_model_scores_about_zero(tiny_model_dir: Path) -> None:
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    rep = evaluate(model, tok, _task(16), k=2, max_new_tokens=80)
    assert rep["avg_at_k"] <= 0.05 and rep["greedy_accuracy"] <= 0.05
    assert model.training is False or model.training is True  # mode restored (no exception)
    again = evaluate(model, tok, _task(16), k=2, max_new_tokens=80, greedy=False)
    assert again["mean_response_length"] == rep["mean_response_length"]  # same seed, same samples


def test_batched_kv_sampling_matches_unbatched_full_forward(tiny_model_dir: Path) -> None:
    """Greedy decoding of mixed-length prompts through the scheduler's KV cache equals step-by-step argmax
    over full, unpadded forwards, and leaves the model's parameters where they were."""
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    model.eval()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    prompts = [encode_prompt(tok, p) for p in _task(6).eval_prompts()]
    assert len({len(p) for p in prompts}) > 1
    got = [g[0] for g in generate(model, prompts, 1, 12, 0.0, [tok.eos_token_id], batch_size=4)]
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
    for p, out in zip(prompts, got, strict=True):
        seq = list(p)
        ref: list[int] = []
        with torch.no_grad():
            for _ in range(len(out)):
                nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                ref.append(nxt)
                seq.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        assert out == ref


def test_cli_prints_json(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "learner.evaluate", "--model", str(tiny_model_dir), "--k", "2", "--n-prompts", "4",
         "--max-new-tokens", "16", "task.eval_size=4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["n_prompts"] == 4 and rep["k"] == 2 and "greedy_accuracy" in rep and rep["model"] == str(tiny_model_dir)


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "/no/such/model"]) == 2
    assert "cannot load model" in capsys.readouterr().err
    assert main(["--model", "/no/such/model", "--task", "nope"]) == 2
    assert "unknown task" in capsys.readouterr().err
