"""Does a trained critic's value fall at the first mistake of a long failed response?

    .venv/bin/python -m ops.bench.probes.value_curve RUN_DIR [--bucket long] [--k 8] [--plot PNG]

Loads a finished run's final policy (its newest published weights, ``RUN_DIR/weights/v*``) and critic (its
newest checkpoint, ``RUN_DIR/checkpoints/v*/critic``), samples ``--k`` responses at temperature
``actors.temperature`` to the held-out prompts of one length bucket, and runs the critic over them. For
every failed response that leaves the teacher's correct trace (the task's ``teacher_response`` with no
slips) at some token ``j`` before its end, it aligns V(s_t) at ``j``: ``V(s_t)`` is the value of the state
before token ``t`` is generated, so the mistake can show first at ``t = j + 1``.

Prints one JSON line: the number of failed responses checked, the mean value on the tokens before the first
mistake and after it (to the end), the mean one-token change at the mistake (``V(s_{j+1}) - V(s_j)``) and
the share of responses where it is negative, the mean absolute one-token change elsewhere (the noise floor),
and the mean curve from 2 lines before to 4 lines after. The same numbers for the correct responses of the
bucket give the reference: their value should stay high to the end.

Credit, from the same values: the actor's advantages the learner would form over this batch (GAE with the
run's λ_actor, length-adaptive by α, whitened over the batch), and of each failed response's Σ|A_t| the share
on the tokens of the line holding its first mistake, beside the share a group baseline gives that line (the
same advantage on every token: the line's length over the response's). A critic that assigns credit puts
several times the uniform share there; the mean advantage before that line, on it and after it show where
the penalty of a failed response lands (with λ_actor near 1 the correct steps before the mistake carry it).
The same figures before whitening (``raw_*``) separate the critic's credit from whitening's shift: whitening
subtracts the batch's mean advantage, so a token the critic gives no credit to (raw A = 0) is pushed down or
up with every token of the batch.

Deviation: the paper shows no such probe; it is how this repo checks that the critic assigns credit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, SupportsFloat

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from common import protocol
from common.config import Config, load_config
from common.modeling import load_tokenizer, pad_token_id
from common.tasks import Prompt, Task, decode_response, encode_prompt, get_task
from learner.advantages import gae, length_adaptive_lambda, terminal_rewards
from learner.batch import collate
from learner.evaluate import generate
from learner.forwards import compute_values
from learner.losses import masked_whiten
from learner.models import load_critic_module, load_policy_module

BEFORE, AFTER = 18, 36  # tokens shown around the first mistake (2 and 4 lines of the chain task)


def newest(d: Path) -> Path:
    """The ``v<N>`` entry of ``d`` with the largest N."""
    vs = [p for p in d.glob("v*") if p.name[1:].isdigit()]
    if not vs:
        raise FileNotFoundError(f"no v<N> entries under {d}")
    return max(vs, key=lambda p: int(p.name[1:]))


def first_mistake(task: Task, prompt: Prompt, tokens: list[str]) -> int | None:
    """Index of the first response token (``tokens``: the decoded text of each) that leaves the correct
    trace; None when none does before the last token (the response is correct, or only its answer or its
    stopping point is wrong)."""
    want = task.teacher_response(prompt)
    j = 0
    for i, tok in enumerate(tokens):
        if want[j : j + len(tok)] != tok:
            return i if i < len(tokens) - 1 else None
        j += len(tok)
    return None


class _Engine(torch.nn.Module):
    """The attribute ``learner.update`` reads the device from (``.module``) around a bare critic."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> torch.Tensor:
        return self.module(*args)


def load_critic(cfg: Config, run_dir: Path) -> torch.nn.Module:
    critic = load_critic_module(cfg)
    state_file = newest(run_dir / "checkpoints") / "critic" / "state" / "mp_rank_00_model_states.pt"
    # Our own checkpoint on local disk (DeepSpeed writes it with torch.save; it holds non-tensor entries).
    state = torch.load(state_file, map_location="cpu", weights_only=False)["module"]
    critic.load_state_dict(state)
    return _Engine(critic.eval())


def actor_advantages(values: torch.Tensor, batch: Any, algo: Any) -> np.ndarray:
    """``[B, T]`` the actor's advantages as the learner forms them from these values, before whitening: GAE
    with λ_actor (length-adaptive: 1 − 1/(α·l), Eq. 7) over the terminal score."""
    lam = length_adaptive_lambda(batch.lengths, algo.alpha) if algo.length_adaptive else algo.lambda_actor
    adv, _ = gae(terminal_rewards(batch.scores, batch.mask), values, batch.mask, algo.gamma, lam)
    return adv.numpy()


def as_trained(adv: np.ndarray, batch: Any, algo: Any) -> np.ndarray:
    """``adv`` whitened over the batch's real tokens when ``algo.whiten_advantages``, as the learner does (the
    probe's batch stands in for a training batch); unchanged otherwise."""
    if not algo.whiten_advantages:
        return adv
    return (masked_whiten(torch.from_numpy(adv), batch.mask) * batch.mask).numpy()


def line_span(text: list[str], j: int) -> tuple[int, int]:
    """``[start, end)`` of the response line that holds token ``j`` (a line ends with its newline token)."""
    start = max((i + 1 for i in range(j) if "\n" in text[i]), default=0)
    end = next((i + 1 for i in range(j, len(text)) if "\n" in text[i]), len(text))
    return start, end


def credit_on_line(adv: np.ndarray, span: tuple[int, int]) -> dict[str, float]:
    """Of one response's advantage magnitude Σ|A_t|, the share on the tokens of ``span`` (the mistake's line),
    beside the share a per-response advantage (group baseline: the same A on every token) puts there."""
    a, (lo, hi) = np.abs(adv), span
    return {"share": float(a[lo:hi].sum() / max(a.sum(), 1e-12)), "uniform": (hi - lo) / len(adv),
            "line_mean": float(adv[lo:hi].mean()), "before_mean": float(adv[:lo].mean()) if lo else float("nan"),
            "after_mean": float(adv[hi:].mean()) if hi < len(adv) else float("nan")}


def measure(cfg: Config, run_dir: Path, bucket: str, k: int, seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    task = get_task(cfg.task)
    weights = newest(run_dir / "weights")
    tok = load_tokenizer(weights)
    policy = load_policy_module(weights).eval()
    prompts = [p for p in task.eval_prompts() if p.bucket == bucket]
    if not prompts:
        raise ValueError(f"no held-out prompts in bucket {bucket!r}")
    ids = [encode_prompt(tok, p) for p in prompts]
    out = generate(policy, ids, k, cfg.actors.max_new_tokens, cfg.actors.temperature, [tok.eos_token_id],
                   batch_size=256, seed=seed)
    groups: list[protocol.SampleGroup] = []
    rows: list[dict[str, Any]] = []  # one JSON-like record per response, as measure returns them
    for p, pid, resp in zip(prompts, ids, out, strict=True):
        samples = []
        for r in resp:
            r = r or [tok.eos_token_id]
            reward = task.verify(p, decode_response(tok, r)).reward
            samples.append(protocol.Sample(prompt_ids=np.asarray(pid, np.int32), output_ids=np.asarray(r, np.int32),
                                           output_logprobs=np.zeros(len(r), np.float32), reward=reward,
                                           finish_reason="stop", weight_version=0, response_length=len(r)))
            text = [decode_response(tok, [t]) for t in r if t != tok.eos_token_id]
            rows.append({"prompt": p.text.strip(), "reward": reward, "n": len(r), "text": text,
                         "first_mistake": first_mistake(task, p, text)})
        groups.append(protocol.SampleGroup(group_id=p.prompt_id, prompt_id=p.prompt_id, task=task.name, actor_id=0,
                                           samples=samples, created_at=0.0))
    critic = load_critic(cfg, run_dir)
    batch = collate(groups, pad_token_id(tok))
    with torch.no_grad():
        values_t = compute_values(critic, batch, torch.arange(batch.size), cfg.learner.micro_batch_size)
    values, raw_advantages = values_t.numpy(), actor_advantages(values_t, batch, cfg.algo)
    advantages = as_trained(raw_advantages, batch, cfg.algo)
    before, after, drops, noise, credit, raw_credit = [], [], [], [], [], []
    curves = []
    for i, row in enumerate(rows):
        v = values[i, : row["n"]]
        row["values"] = v
        j = row["first_mistake"]
        if row["reward"] >= 1 or j is None or not 0 < j < row["n"] - 1:
            continue
        before.append(float(v[: j + 1].mean()))
        after.append(float(v[j + 1 :].mean()))
        drops.append(float(v[j + 1] - v[j]))
        span = line_span(row["text"], j)
        credit.append(credit_on_line(advantages[i, : row["n"]], span))
        raw_credit.append(credit_on_line(raw_advantages[i, : row["n"]], span))
        diffs = np.abs(np.diff(v))
        noise.append(float(np.delete(diffs, j).mean()))
        curve = np.full(BEFORE + AFTER, np.nan)
        lo = max(0, j + 1 - BEFORE)
        seg = v[lo : j + 1 + AFTER]
        curve[BEFORE - (j + 1 - lo) : BEFORE - (j + 1 - lo) + len(seg)] = seg
        curves.append(curve)
    ok = [row["values"] for row in rows if row["reward"] >= 1]
    report: dict[str, Any] = {
        "bench": "value_curve", "run": str(run_dir), "weights": weights.name, "bucket": bucket,
        "responses": len(rows), "correct": len(ok), "failed_checked": len(drops),
        "value_before_first_mistake": _r(np.mean(before)) if before else None,
        "value_after_first_mistake": _r(np.mean(after)) if after else None,
        "value_change_at_mistake": _r(np.mean(drops)) if drops else None,
        "fraction_dropping": _r(np.mean(np.asarray(drops) < 0)) if drops else None,
        "mean_abs_change_elsewhere": _r(np.mean(noise)) if noise else None,
        **_credit_summary(credit), **_credit_summary(raw_credit, "raw_"),
        "value_correct_first_half": _r(np.mean([v[: len(v) // 2].mean() for v in ok])) if ok else None,
        "value_correct_second_half": _r(np.mean([v[len(v) // 2 :].mean() for v in ok])) if ok else None,
        "aligned_curve": {"first_token_offset": -BEFORE + 1,
                          "mean": [_r(x) for x in np.nanmean(np.stack(curves), 0)] if curves else []},
    }
    return report, rows


def _r(x: SupportsFloat) -> float:
    return round(float(x), 4)


def _credit_summary(credit: list[dict[str, float]], prefix: str = "") -> dict[str, float | None]:
    """Means over the checked failed responses of ``credit_on_line``'s figures (names led by ``prefix``)."""
    keys = {"share": "advantage_share_on_mistake_line", "uniform": "uniform_share_on_mistake_line",
            "line_mean": "advantage_on_mistake_line", "before_mean": "advantage_before_mistake_line",
            "after_mean": "advantage_after_mistake_line"}
    return {prefix + name: (_r(np.nanmean([c[k] for c in credit])) if credit and not all(np.isnan(c[k]) for c in credit)
                            else None) for k, name in keys.items() if not (prefix and k == "uniform")}


def plot(path: Path, report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    import matplotlib  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.6), dpi=100)
    mean = report["aligned_curve"]["mean"]
    if mean:
        xs = range(report["aligned_curve"]["first_token_offset"], report["aligned_curve"]["first_token_offset"] + len(mean))
        a1.plot(list(xs), mean, color="tab:red")
        a1.axvline(0.5, color="k", ls="--", lw=0.8)
    a1.set_title(f"mean V(s_t) around the first mistake ({report['failed_checked']} failed, bucket {report['bucket']})", fontsize=9)
    a1.set_xlabel("tokens after the first wrong token")
    a1.set_ylim(-0.1, 1.1)
    fails = sorted([r for r in rows if r["reward"] < 1 and r["first_mistake"] is not None], key=lambda r: -r["n"])[:3]
    wins = sorted([r for r in rows if r["reward"] >= 1], key=lambda r: -r["n"])[:2]
    for r in fails + wins:
        (line,) = a2.plot(r["values"], color="tab:red" if r["reward"] < 1 else "tab:green", lw=0.9)
        if r["reward"] < 1:
            a2.axvline(r["first_mistake"] + 0.5, color=line.get_color(), ls=":", lw=0.8)
    a2.set_title("V(s_t) along the longest failed (red; dotted: first mistake) and correct (green) responses", fontsize=9)
    a2.set_xlabel("response token")
    a2.set_ylim(-0.1, 1.1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a finished run's directory (holds config.yaml, weights/ and checkpoints/)")
    ap.add_argument("--bucket", default="long", help="held-out length bucket to sample (default long)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--plot", default=None, help="PNG of the aligned mean curve and a few single responses")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        ap.error(f"{run_dir} has no config.yaml; pass a run directory")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    cfg = load_config(str(run_dir / "config.yaml"), [])
    if cfg.algo.advantage != "gae":
        ap.error(f"{run_dir} trained without a critic (algo.advantage={cfg.algo.advantage})")
    report, rows = measure(cfg, run_dir, args.bucket, args.k, args.seed)
    if args.plot:
        plot(Path(args.plot), report, rows)
        report["plot"] = args.plot
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
