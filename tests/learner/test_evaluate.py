"""learner.evaluate: report fields, accounting against scripted models, KV-cache sampling, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.config import TaskConfig
from common.modeling import build_char_tokenizer, load_model, load_tokenizer
from common.tasks import encode_prompt, get_task
from common.tasks.addition import AdditionTask, teacher_response
from learner.evaluate import evaluate, main, sample_batch, score

REPO = Path(__file__).resolve().parents[2]


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: reads each row's prompt and emits a fixed script for it, token by token.

    ``wrong`` makes it answer one too high, to check that the accounting sees failures too.
    """

    def __init__(self, tokenizer: Any, wrong: bool = False) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.wrong = tokenizer, wrong
        self.scripts: list[list[int]] = []
        self.done: list[int] = []

    def _script(self, prompt_ids: list[int]) -> list[int]:
        text = self.tok.decode(prompt_ids, skip_special_tokens=True)
        a, b = (int(x) for x in text[2:].strip().split("+"))
        answer = a + b + (1 if self.wrong else 0)
        resp = teacher_response(SimpleNamespace(text=text))  # type: ignore[arg-type]
        resp = resp[: resp.rindex("A:")] + f"A:{answer}"
        return self.tok.encode(resp, add_special_tokens=False) + [self.tok.eos_token_id]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, **kw: Any) -> SimpleNamespace:
        if cache is None:  # prefill: remember each row's script
            assert attention_mask is not None
            self.scripts = [self._script(row[m.bool()].tolist()) for row, m in zip(input_ids, attention_mask, strict=True)]
            self.done = [0] * len(self.scripts)
        else:
            self.done = [d + 1 for d in self.done]
        logits = torch.full((input_ids.shape[0], 1, len(self.tok)), -1e4)
        for i, (script, d) in enumerate(zip(self.scripts, self.done, strict=True)):
            logits[i, 0, script[min(d, len(script) - 1)]] = 1e4
        return SimpleNamespace(logits=logits, cache="scripted")


def _task(n: int = 24) -> AdditionTask:
    task = get_task(TaskConfig(eval_size=n))
    assert isinstance(task, AdditionTask)
    return task


def test_always_correct_model_scores_one_and_wrong_model_zero() -> None:
    tok, task = build_char_tokenizer(), _task()
    rep = evaluate(ScriptedModel(tok), tok, task, k=4, max_new_tokens=96, batch_size=10)
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

    bad = evaluate(ScriptedModel(tok, wrong=True), tok, task, k=2, max_new_tokens=96)
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
    """Greedy decoding with left padding + KV cache equals step-by-step argmax over full, unpadded forwards."""
    tok, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    model.eval()
    prompts = [encode_prompt(tok, p) for p in _task(6).eval_prompts()]
    assert len({len(p) for p in prompts}) > 1
    got = sample_batch(model, prompts, 12, 0.0, [tok.eos_token_id], tok.pad_token_id)
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
