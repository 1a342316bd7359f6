"""Write the small example prompt set of docs/DATA.md: a parquet file in verl's layout with chat prompts.

    python -m ops.make_example_data runs/data/addition.parquet [--rows 64] [--max-digits 3] [--seed 0]

Each row is an addition question in the embedded task's prompt shape (``Q:<a>+<b>\\n``) as one user chat
message, so the shipped base ``ops/bases/addition-tiny`` can answer it; the columns are verl's:
``prompt`` (a list of ``{"role", "content"}`` messages), ``reward_model`` (``{"ground_truth", "style"}``),
``data_source``, ``ability`` and ``extra_info`` (a dict). Everything is generated from ``--seed``; nothing is
downloaded. Prints the path and the row count.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "addition_example"


def example_rows(n: int, max_digits: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` addition rows in verl's layout (distinct questions while the operand space allows)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    hi = 10**max_digits - 1
    for _ in range(n * 50):
        if len(rows) == n:
            break
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"Q:{a}+{b}\n"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": len(rows), "split": "train", "a": a, "b": b},
        })
    return rows


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.make_example_data",
                                 description="Write a small addition prompt set in verl's parquet layout (chat prompts).")
    ap.add_argument("out", help="the .parquet file to write")
    ap.add_argument("--rows", type=int, default=64, help="number of rows (default 64)")
    ap.add_argument("--max-digits", type=int, default=3, help="most digits per operand (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.max_digits < 1:
        print("make_example_data: --rows and --max-digits must be >= 1", file=sys.stderr)
        return 2
    rows = example_rows(args.rows, args.max_digits, args.seed)
    print(f"{write_parquet(Path(args.out), rows)}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
