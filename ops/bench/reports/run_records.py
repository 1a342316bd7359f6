"""What a finished suite run recorded, read back from its run directory (``summary.json``, ``metrics.jsonl``,
``config.yaml``): the evaluation curve against samples and wall time, the learner steps, value pretraining's
cost, and the base's bootstrap time; and the small formatters and the curve plot the reports share.
``ops/bench/suites/experiments.py`` and its suites build their reports from it.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ops.report import read_records  # the one metrics.jsonl reader; the suites take it from here

REPO = Path(__file__).resolve().parents[3]

TARGET = 0.70  # the stated held-out avg@8 for samples-to-accuracy (base 0.451)


@dataclass
class Run:
    name: str
    group_size: int
    bootstrap_seconds: float | None
    points: list[dict[str, Any]] = field(default_factory=list)  # one per eval: step, samples, gen, t, acc (gen, len may be None)
    steps: list[dict[str, Any]] = field(default_factory=list)
    pretrain_ev: float | None = None
    pretrain_samples: int = 0
    launch_to: dict[int, float] = field(default_factory=dict)  # step -> seconds from launch (+ bootstrap)
    wall_seconds: float | None = None

    @property
    def base(self) -> float:
        return self.points[0]["acc"]

    def at_step(self, step: int) -> dict[str, Any] | None:
        return next((p for p in self.points if p["step"] == step), None)

    def final(self, step: int | None = None) -> dict[str, Any]:
        return (self.at_step(step) if step is not None else None) or self.points[-1]

    def crossing(self, target: float, key: str) -> float | None:
        """``key`` (``cost`` samples or ``t`` seconds) at which held-out accuracy first reaches ``target``, linearly
        interpolated between evaluations; None if it never does."""
        prev = None
        for p in self.points:
            if p["acc"] >= target:
                if prev is None:
                    return p[key]
                f = (target - prev["acc"]) / max(p["acc"] - prev["acc"], 1e-12)
                return prev[key] + f * (p[key] - prev[key])
            prev = p
        return None

    def throughput(self, upto: int) -> float:
        """Trained samples per second of learner wall time (net of evaluation) from RL start to step ``upto``."""
        s = [r for r in self.steps if r["step"] <= upto]
        return s[-1]["samples"] / max(s[-1]["t"], 1e-9) if s else float("nan")

    def stale_share(self, upto: int) -> float | None:
        """Share of the groups that reached the learner which it dropped as too stale (None: not recorded)."""
        s = [r for r in self.steps if r["step"] <= upto]
        if not s or s[-1]["gen"] is None:
            return None
        return s[-1]["stale_groups"] * self.group_size / max(s[-1]["gen"], 1)


def bootstrap_seconds(info: Path) -> float:
    """SFT seconds recorded with a base model (0 when there is none)."""
    try:
        return float(json.loads(info.read_text())["bootstrap"]["sft_seconds"])
    except (OSError, KeyError, ValueError, TypeError):
        return 0.0


def load_run(d: Path) -> Run | None:
    if not (d / "summary.json").exists() or not (d / "metrics.jsonl").exists():
        return None
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    g = int(cfg["actors"]["group_size"])
    recs = read_records(d / "metrics.jsonl")
    base = next((r for r in recs if r.get("kind") == "eval"), None)
    if base is None:
        return None
    # RL starts at the base evaluation (after value pretraining): t counts learner time from there, the
    # same starting line for every method; value pretraining is reported separately.
    t0 = base["time"]
    run = Run(d.name, g, None)
    # Samples a method pays for: trained on, spent on value pretraining (its batches and held-out groups),
    # or generated and discarded by DAPO's dynamic sampling. Stale drops are a property of the async system,
    # not of the method; they are reported in the staleness table (runs before the learner logged them lack it).
    n_vp = sum(1 for r in recs if r.get("kind") == "value_pretrain")
    vp = cfg.get("value_pretrain", {})
    pretrain = (n_vp * int(vp.get("batch_groups", 0)) + int(vp.get("eval_groups", 0))) * g if n_vp else 0
    run.pretrain_samples = pretrain
    summary = json.loads((d / "summary.json").read_text())
    run.pretrain_ev = summary.get("value_pretrain_explained_variance")
    run.wall_seconds = summary.get("wall_seconds")
    run.points.append({"step": 0, "samples": 0, "cost": pretrain, "gen": None, "t": 0.0, "acc": base["avg_at_k"],
                       "greedy": base.get("greedy_accuracy", float("nan")), "len": base.get("mean_response_length")})
    trained = 0
    for r in recs:
        if r.get("kind") != "learner_step":
            continue
        trained += int(r.get("samples", 0))
        cost = trained + pretrain + g * int(r.get("filtered_total", 0))
        gen = (g * (r["groups_consumed_total"] + r.get("stale_dropped_total", 0) + r.get("filtered_total", 0))
               if "groups_consumed_total" in r else None)
        # Held-out evaluation time is excluded: it is the same for every method and not training.
        phases = r.get("phase_seconds") or {}
        ev_s = phases.get("eval", 0.0)
        row = {"step": r["step"], "samples": trained, "cost": cost, "gen": gen, "t": r["time"] - t0, "eval_s": ev_s,
               "stale_groups": r.get("stale_dropped_total", 0), "fetch_s": phases.get("fetch", 0.0),
               "busy_s": sum(v for k, v in phases.items() if k not in ("fetch", "eval")),
               "ev": r.get("value_explained_variance"), "len": r.get("response_length_mean"),
               "entropy": r.get("entropy"), "staleness": r.get("staleness_mean"), "reward": r.get("reward_mean")}
        run.steps.append(row)
        if isinstance(r.get("eval"), dict):
            e = r["eval"]
            run.points.append({"step": r["step"], "samples": trained, "cost": cost, "gen": gen, "t": r["time"] - t0,
                               "acc": e["avg_at_k"], "greedy": e.get("greedy_accuracy", float("nan")),
                               "len": e.get("mean_response_length")})
    # Seconds from the launch (config.yaml is written first) to each step, bootstrap included: measured when
    # this launch built the base; none for a shipped base (ops/bases/), which no user builds; else (a base
    # an earlier launch bootstrapped) a measured bootstrap is added.
    t_launch = (d / "config.yaml").stat().st_mtime
    base_info = REPO / cfg["model"]["path"] / "vapo_info.json"
    built_here = base_info.exists() and base_info.stat().st_mtime > t_launch
    shipped = (REPO / cfg["model"]["path"]).resolve().parent == REPO / "ops" / "bases"
    if not built_here and not shipped:
        # The suite's own bootstrap (built by a launch under the same conditions) is preferred to the
        # base's record, which may come from a differently loaded machine.
        suite_base = d.parent / "_base" / Path(cfg["model"]["path"]).name / "vapo_info.json"
        run.bootstrap_seconds = bootstrap_seconds(suite_base) or bootstrap_seconds(base_info)
    for r in recs:
        if r.get("kind") == "learner_step":
            run.launch_to[r["step"]] = r["time"] - t_launch + (run.bootstrap_seconds or 0.0)
    # Wall time net of evaluations so far (eval pauses the learner, and the eval cadence is not the method).
    ev_cum = 0.0
    for row in run.steps:
        ev_cum += row["eval_s"]
        row["t"] -= ev_cum
        for p in run.points:
            if p["step"] == row["step"]:
                p["t"] = row["t"]
    return run


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def mean_if_all(xs: list[float | None]) -> float | None:
    """The mean of ``xs`` when none is None (every run reached the mark), else None; like fmean, it raises on no
    ``xs`` (the callers only ask with runs in hand)."""
    known = [x for x in xs if x is not None]
    return statistics.fmean(known) if len(known) == len(xs) else None


def fmt(x: float | None, nd: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def fmt_k(x: float | None) -> str:
    return "not reached" if x is None else f"{x / 1000:.1f}k"


def plot_curves(path: Path, series: dict[str, list[Run]], xkey: str, xlabel: str, title: str,
                upto_step: int | None = None, target: float = TARGET) -> None:
    import matplotlib  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, runs in series.items():
        if not runs:
            continue
        steps = sorted({p["step"] for p in runs[0].points if upto_step is None or p["step"] <= upto_step})
        xs, ys, lo, hi = [], [], [], []
        for s in steps:
            pts = [p for r in runs if (p := r.at_step(s)) is not None]
            if len(pts) != len(runs):
                continue
            xs.append(statistics.fmean(p[xkey] for p in pts) / (1000 if xkey in ("cost", "samples") else 1))
            acc = [p["acc"] for p in pts]
            ys.append(statistics.fmean(acc))
            lo.append(min(acc))
            hi.append(max(acc))
        (line,) = ax.plot(xs, ys, marker="o", ms=3, label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})")
        if len(runs) > 1:
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out avg@8 (sampled)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def port_overrides(slot: int) -> list[str]:
    """Every listening port of one run, shifted by slot so parallel runs never collide (slot 0 = defaults)."""
    if slot == 0:
        return []
    d = 20 * slot
    return [f"engine.base_port={30000 + d}", f"actors.metrics_base_port={9300 + d}",
            f"buffer.ingest_addr=tcp://127.0.0.1:{5555 + d}", f"buffer.serve_addr=tcp://127.0.0.1:{5556 + d}",
            f"buffer.metrics_port={9200 + d}", f"learner.publish_addr=tcp://127.0.0.1:{5557 + d}",
            f"learner.query_addr=tcp://127.0.0.1:{5558 + d}", f"learner.metrics_port={9100 + d}",
            f"metrics.launcher_port={9400 + d}"]


def splice(text: str, block: str, begin: str, end: str) -> str:
    """``text`` with its part from ``begin`` to ``end`` replaced by ``block`` (appended when it has none)."""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block.rstrip("\n") + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block


def keep_block(old: str, new: str, begin: str, end: str) -> str:
    """``new`` (a re-made report) with the block from ``begin`` to ``end`` carried over from ``old``, if it has one."""
    if begin in old and end in old:
        return splice(new, begin + old.split(begin, 1)[1].split(end, 1)[0] + end + "\n", begin, end)
    return new
