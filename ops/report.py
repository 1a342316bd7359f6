"""End-of-run report: summary table and PNG plots from ``runs/<name>/metrics.jsonl``.

    .venv/bin/python -m ops.report runs/<name>        # re-make the summary and plots of any run

Called by ``ops/launch.py`` when a run finishes. Plots (``runs/<name>/plots/``): reward, held-out
accuracy, value explained variance, response length, staleness, throughput, and with ``task.eval_sets``
avg@k per set (``eval_sets.png``; the summary then has ``eval_sets`` and a table per set and data_source);
``summary.json`` beside them,
with ``provenance`` (commit, base checksum, CPU, versions, threads) from the metrics.jsonl ``header`` record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from common.provenance import describe, for_config
from learner.eval_record import record_sets


def read_records(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (none when it does not exist yet), only ``kind``'s if given."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash, or still being written
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """A run's records with the rates the summary and plots use."""
    return with_rates(read_records(run_dir / "metrics.jsonl"))


def version_of(r: dict[str, Any]) -> int:
    """The weight version a record belongs to (learner records carry weight_version and step)."""
    for key in ("weight_version", "version", "step"):
        if isinstance(r.get(key), int | float):
            return int(r[key])
    return 0


def with_rates(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds samples_per_second to learner step records from consecutive timestamps."""
    prev_t = None
    for r in records:
        if r.get("kind") != "learner_step" or not isinstance(r.get("time"), int | float):
            continue
        if prev_t is not None and r["time"] > prev_t and "samples_per_second" not in r:
            r["samples_per_second"] = r.get("samples", 0) / (r["time"] - prev_t)
        prev_t = r["time"]
    return records


def eval_points(records: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(step, eval dict) for every evaluation, whether logged on its own or inside a step record."""
    pts = []
    for r in records:
        if r.get("kind") == "eval":
            pts.append((version_of(r), r))
        elif isinstance(r.get("eval"), dict):
            pts.append((version_of(r), r["eval"]))
    return pts


def eval_acc(e: dict[str, Any]) -> float | None:
    for key in ("avg_at_k", "eval/avg@k", "accuracy"):
        if isinstance(e.get(key), int | float):
            return float(e[key])
    return None


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get("kind") != "learner_step":
            continue
        v = r.get(key)
        if isinstance(v, int | float):
            xs.append(version_of(r))
            ys.append(float(v))
    return xs, ys


def summarize(run_dir: Path, wall_s: float | None = None) -> dict[str, Any]:
    records = load_records(run_dir)
    steps = [r for r in records if r.get("kind") == "learner_step"]
    evals = [(s, eval_acc(e)) for s, e in eval_points(records)]
    evals = [(s, a) for s, a in evals if a is not None]
    greedy = [(s, e.get("greedy_accuracy")) for s, e in eval_points(records)]
    out: dict[str, Any] = {
        "run": run_dir.name,
        "steps": max((version_of(r) for r in steps), default=0),
        "samples": int(sum(r.get("samples", 0) for r in steps)),
        "base_accuracy": evals[0][1] if evals and evals[0][0] == 0 else None,
        "final_accuracy": evals[-1][1] if evals else None,
        "final_greedy_accuracy": greedy[-1][1] if greedy else None,
        "evals": evals,
        "wall_seconds": round(wall_s, 1) if wall_s is not None else None,
    }
    sets = eval_sets_summary(records)
    if sets:
        out["eval_sets"] = sets
    out.update(provenance_of(records))
    vp = [r for r in records if r.get("kind") == "value_pretrain"]
    if vp:
        # The critic RL starts from is the best on the held-out groups (learner.value_pretrain).
        out["value_pretrain_explained_variance"] = vp[-1].get("best_explained_variance", vp[-1].get("explained_variance"))
    return out


def eval_sets_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per evaluation set (``task.eval_sets``; empty for a run of the held-out slice alone): its k, prompts,
    base (step 0) and final avg@k, final pass@k and the final per-data_source figures."""
    pts = [(s, e) for s, e in eval_points(records) if isinstance(e.get("sets"), dict)]
    out: dict[str, dict[str, Any]] = {}
    for step, e in pts:
        for name, fig in record_sets(e).items():
            row = out.setdefault(name, {"base_avg_at_k": None})
            if step == 0:
                row["base_avg_at_k"] = fig.get("avg_at_k")
            row.update({"k": fig.get("k"), "n_prompts": fig.get("n_prompts"), "final_step": step,
                        "final_avg_at_k": fig.get("avg_at_k"), "final_pass_at_k": fig.get("pass_at_k"),
                        "final_by_data_source": fig.get("by_data_source", {})})
    return out


def provenance_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``provenance``: the first metrics.jsonl header (what produced the run), or None for runs written
    before headers existed; ``provenance_resumes``: later headers (a resumed run), when there are any."""
    heads = [{k: v for k, v in r.items() if k != "kind"} for r in records if r.get("kind") == "header"]
    out: dict[str, Any] = {"provenance": heads[0] if heads else None}
    if len(heads) > 1:
        out["provenance_resumes"] = heads[1:]
    return out


PLOTS = {
    "reward": ("reward_mean", "batch reward mean"),
    "explained_variance": ("value_explained_variance", "critic explained variance"),
    "response_length": ("response_length_mean", "response length (tokens)"),
    "staleness": ("staleness_mean", "staleness (versions)"),
    "throughput": ("samples_per_second", "samples / s"),
}


def plot(run_dir: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    records = load_records(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(name: str, xs: list[int], ys: list[float], ylabel: str) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_xlabel("learner step (weight version)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{run_dir.name}: {ylabel}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    for name, (key, label) in PLOTS.items():
        xs, ys = series(records, key)
        if name == "throughput" and not ys:
            xs, ys = series(records, "tokens_per_second")
            label = "trained tokens / s"
        save(name, xs, ys, label)
    pts = [(s, a) for s, e in eval_points(records) if (a := eval_acc(e)) is not None]
    save("heldout_accuracy", [s for s, _ in pts], [a for _, a in pts], "held-out avg@k accuracy")
    sets = [(s, e) for s, e in eval_points(records) if isinstance(e.get("sets"), dict)]
    if sets:  # task.eval_sets: avg@k of every set, one line each
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in dict.fromkeys(n for _, e in sets for n in e["sets"]):
            xy = [(s, e["sets"][name].get("avg_at_k")) for s, e in sets if name in e["sets"]]
            ax.plot([x for x, y in xy if y is not None], [y for _, y in xy if y is not None], marker=".", label=name)
        ax.set_xlabel("learner step (weight version)")
        ax.set_ylabel("avg@k")
        ax.set_title(f"{run_dir.name}: evaluation sets")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "eval_sets.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / "eval_sets.png")
    return written


def print_table(summary: dict[str, Any]) -> None:
    t = Table(title=f"vapo run '{summary['run']}'")
    t.add_column("metric")
    t.add_column("value", justify="right")

    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))

    base, final = summary.get("base_accuracy"), summary.get("final_accuracy")
    t.add_row("held-out accuracy, base (avg@k)", fmt(base))
    t.add_row("held-out accuracy, final (avg@k)", fmt(final))
    if isinstance(base, float) and isinstance(final, float):
        t.add_row("change (points)", f"{100 * (final - base):+.1f}")
    t.add_row("final greedy accuracy", fmt(summary.get("final_greedy_accuracy")))
    if "value_pretrain_explained_variance" in summary:
        t.add_row("critic explained variance after pretraining", fmt(summary["value_pretrain_explained_variance"]))
    t.add_row("learner steps", fmt(summary["steps"]))
    t.add_row("samples trained on", fmt(summary["samples"]))
    t.add_row("wall time (s)", fmt(summary.get("wall_seconds")))
    if "auto_resumes" in summary:
        t.add_row("automatic resumes", fmt(summary["auto_resumes"]))
        t.add_row("time lost to them (s)", fmt(summary["resume_lost_seconds"]))
    Console().print(t)
    if summary.get("eval_sets"):
        Console().print(_sets_table(summary["eval_sets"], fmt))

    Console().print(f"produced by: {describe(summary.get('provenance'))}", soft_wrap=True)


def _sets_table(sets: dict[str, dict[str, Any]], fmt: Any) -> Table:
    """One row per evaluation set, and one per data_source of a set that has several."""
    t = Table(title="evaluation sets")
    for col in ("set", "data_source", "k", "prompts", "base avg@k", "final avg@k", "final pass@k"):
        t.add_column(col, justify="left" if col in ("set", "data_source") else "right")
    for name, row in sets.items():
        t.add_row(name, "all", fmt(row.get("k")), fmt(row.get("n_prompts")), fmt(row.get("base_avg_at_k")),
                  fmt(row.get("final_avg_at_k")), fmt(row.get("final_pass_at_k")))
        by_source = row.get("final_by_data_source") or {}
        for source, fig in by_source.items() if len(by_source) > 1 else ():
            t.add_row(name, source, fmt(row.get("k")), fmt(fig.get("n_prompts")), "",
                      fmt(fig.get("avg_at_k")), fmt(fig.get("pass_at_k")))
    return t


def finish(cfg: Any, run_dir: Path, wall_s: float, resumes: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json and the table; ``resumes``: the launch's automatic resumes (``ops.launch_resume``)."""
    summary = summarize(run_dir, wall_s)
    summary.update(resumes or {})
    if summary["provenance"] is None:  # metrics.jsonl=false, or a learner that never started: this machine

        summary["provenance"] = {"source": "launcher at the end of the run", **for_config(cfg)}
    if getattr(cfg.metrics, "plots", True):
        summary["plots"] = [str(p) for p in plot(run_dir)]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)
    return summary


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    run_dir = Path(argv[0])
    summary = summarize(run_dir)
    summary["plots"] = [str(p) for p in plot(run_dir)]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
