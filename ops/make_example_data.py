"""Write the worked example of docs/DATA.md: a user's own prompts, reward function and evaluation sets.

    python -m ops.make_example_data runs/example-data [--rows 64] [--max-digits 3] [--seed 0]
    ops/launch.sh ops/configs/example_data.yaml          # trains the shipped base on them (reads runs/example-data)

Writes into the directory: ``train.parquet`` (addition questions in verl's layout: ``prompt`` a list of
``{"role", "content"}`` chat messages in the embedded task's shape ``Q:<a>+<b>\\n`` so the shipped base
``ops/bases/addition-tiny`` can answer, ``reward_model`` ``{"ground_truth", "style"}``, ``data_source``,
``ability``, ``extra_info``), ``train_saved/`` (the same rows through HF ``datasets``' ``save_to_disk``),
``reward.py`` (a ``compute_score`` with verl's signature: 1 when the response's last line is
``A:<ground truth>``, with the response's line count as an extra figure), and two evaluation sets:
``eval_small.jsonl`` (one- and two-digit sums, question/answer lines, data_source per digit count) and
``eval_large.parquet`` (three-digit sums, verl's layout). Everything comes from ``--seed``; nothing is
downloaded; the evaluation questions are never training questions. Prints one line per file.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "addition_example"


REWARD = '''"""The worked example's reward (verl's signature): 1.0 when the last line is A:<ground truth>."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    lines = solution_str.rstrip().split("\\n")
    last = lines[-1].strip() if lines else ""
    right = last.startswith("A:") and last[2:].strip() == str(ground_truth).strip()
    return {"score": 1.0 if right else 0.0, "lines": float(len(lines))}
'''


def example_rows(n: int, max_digits: int = 3, seed: int = 0, min_digits: int = 1,
                 avoid: set[tuple[int, int]] | None = None, split: str = "train") -> list[dict[str, Any]]:
    """``n`` addition rows in verl's layout (distinct questions while the operand space allows, none of
    ``avoid``, whose pairs it extends with its own)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen = avoid if avoid is not None else set()
    hi, lo = 10**max_digits - 1, (10 ** (min_digits - 1) if min_digits > 1 else 0)
    for _ in range(n * 50):
        if len(rows) == n:
            break
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"Q:{a}+{b}\n"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": len(rows), "split": split, "a": a, "b": b},
        })
    return rows


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_example(out: Path, rows: int, max_digits: int, seed: int) -> list[Path]:
    """Every file of the worked example in ``out`` (see the module docstring); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    train = example_rows(rows, max_digits, seed, avoid=seen)
    small = [{"question": r["prompt"][0]["content"], "answer": r["reward_model"]["ground_truth"],
              "data_source": f"{d}_digit"} for d in (1, 2)
             for r in example_rows(4, d, seed + 100 + d, min_digits=d, avoid=seen)]
    large = example_rows(6, 3, seed + 200, min_digits=3, avoid=seen, split="test")
    for r in large:
        r["data_source"] = "three_digit"
    datasets.disable_progress_bars()
    saved = out / "train_saved"
    shutil.rmtree(saved, ignore_errors=True)
    datasets.Dataset.from_list(train).save_to_disk(str(saved))
    (out / "reward.py").write_text(REWARD)
    (out / "eval_small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in small))
    return [write_parquet(out / "train.parquet", train), saved, out / "reward.py", out / "eval_small.jsonl",
            write_parquet(out / "eval_large.parquet", large)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.make_example_data",
                                 description="Write docs/DATA.md's worked example: prompts, a reward file, evaluation sets.")
    ap.add_argument("out", help="the directory to write (ops/configs/example_data.yaml reads runs/example-data)")
    ap.add_argument("--rows", type=int, default=64, help="training rows (default 64)")
    ap.add_argument("--max-digits", type=int, default=3, help="most digits per training operand (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.max_digits < 1:
        print("make_example_data: --rows and --max-digits must be >= 1", file=sys.stderr)
        return 2
    for path in write_example(Path(args.out), args.rows, args.max_digits, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
