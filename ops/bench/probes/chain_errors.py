"""What kind of mistake ends a chain-task response? Counts the first mistake of each held-out response by kind.

    .venv/bin/python -m ops.bench.probes.chain_errors MODEL_DIR [MODEL_DIR ...] [--temperature 1.0] [--k 4]

For every held-out prompt of ``ops/configs/long.yaml`` it samples ``--k`` responses (``--temperature 0``:
one greedy response) and compares each with the correct trace. The first differing character decides the
kind: ``slip`` (a result one too high: the mistake the SFT teacher makes), ``wrong sum`` (any other wrong
result), ``counter`` (the steps-left counter), ``copy`` (the copied value or increment), ``stopped early``,
``did not stop``, ``answer line``, ``format``. Prints one JSON line per model: the counts, overall and per
length bucket. RL that only sharpens the base removes slips; wrong sums are the base's own arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

from common.config import load_config
from common.tasks import decode_response, encode_prompt, get_task

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[3]


def first_mistake_kind(response: str, want: str) -> str:
    """The kind of the first character where ``response`` leaves the correct trace ``want`` ("ok" if none)."""
    if response == want:
        return "ok"
    j = next((i for i, (a, b) in enumerate(zip(response, want, strict=False)) if a != b), min(len(response), len(want)))
    if j >= len(response):
        return "stopped early"
    if j >= len(want):
        return "did not stop"
    start = want.rfind("\n", 0, j) + 1
    if want.startswith("A:", start):
        return "answer line"
    col = j - start  # "kk:x+i=y": counter 0-1, copies 3 and 5, result 7
    if col in (0, 1):
        return "counter"
    if col in (3, 5):
        return "copy"
    if col == 7:
        got, right = response[j], want[j]
        return "slip" if got.isdigit() and (int(got) - int(right)) % 10 == 1 else "wrong sum"
    return "format"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="HF model directories (a run's weights/v<N>, or the base)")
    ap.add_argument("--config", default=str(REPO / "ops/configs/long.yaml"), help="config with the chain task")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (one response per prompt)")
    ap.add_argument("--k", type=int, default=4, help="samples per prompt when sampling (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    from common.modeling import load_tokenizer  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it
    from learner.evaluate import generate  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it
    from learner.models import load_policy_module  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    task = get_task(cfg.task)
    if task.name != "chain":
        ap.error(f"{args.config} does not use the chain task")
    prompts = task.eval_prompts()
    k = 1 if args.temperature == 0 else args.k
    for path in args.models:
        tok = load_tokenizer(path)
        model = load_policy_module(path).eval()
        ids = [encode_prompt(tok, p) for p in prompts]
        out = generate(model, ids, k, cfg.actors.max_new_tokens, args.temperature, [tok.eos_token_id],
                       batch_size=256, seed=args.seed)
        total: Counter[str] = Counter()
        by: dict[str, Counter[str]] = {}
        for p, responses in zip(prompts, out, strict=True):
            for r in responses:
                kind = first_mistake_kind(decode_response(tok, r), task.teacher_response(p))
                total[kind] += 1
                by.setdefault(p.bucket, Counter())[kind] += 1
        print(json.dumps({"bench": "chain_errors", "model": path, "temperature": args.temperature, "k": k,
                          "responses": sum(total.values()), "kinds": dict(total.most_common()),
                          "by_bucket": {b: dict(c.most_common()) for b, c in by.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
