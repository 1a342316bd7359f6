"""What produced a result: code commit, base model checksum, machine (CPU model and SIMD flags), library
versions and thread counts, collected the same way for every record that states a figure.

Used by the learner's ``metrics.jsonl`` header, ``ops/report.py``'s ``summary.json``, ``learner.sft``'s base
manifest and the results tables of ``ops/bench``. Floating-point kernels differ between CPU types (AVX2 vs
AVX-512 reductions round differently), so two runs of the same code and seed agree only on the same
``cpu.torch_capability`` with the same thread counts: a figure without these fields cannot be compared.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from common.checksum import weights_sha256
from common.config import Config

ROOT = Path(__file__).resolve().parents[1]

# The CPU flags that choose floating-point kernels (vector width, fused multiply-add, bf16/int8 units);
# /proc/cpuinfo lists ~150 flags, the rest do not change results.
SIMD_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx")


def cpu() -> dict[str, Any]:
    """CPU model, SIMD flags, torch's kernel level (DEFAULT/AVX2/AVX512...) and logical CPU count."""
    model: str | None = None
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = sorted(f for f in value.split() if f.startswith(SIMD_PREFIXES))
    except OSError:
        pass  # not Linux: the model from platform only
    out: dict[str, Any] = {"model": model or platform.processor() or platform.machine(), "machine": platform.machine(), "logical_cpus": os.cpu_count(),
                           "simd_flags": flags}
    try:
        import torch  # noqa: PLC0415 - ops/launch.py, a CLI without torch, reads the machine through this module

        out["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        out["torch_capability"] = None
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of Python and of the libraries whose kernels or defaults change numbers."""
    return {"python": platform.python_version(), "torch": _version("torch"), "deepspeed": _version("deepspeed"),
            "transformers": _version("transformers")}


# What the experiment suites write while they run (ledger, report plots): a suite's second run in a frozen
# checkout would otherwise be recorded as made by modified code.
RESULTS_DIR = "docs/results"


def commit(root: Path = ROOT) -> dict[str, Any]:
    """The checkout's commit and whether tracked files other than ``RESULTS_DIR``'s differ from it (None when it
    is not a git checkout)."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS_DIR}")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def base_checksum(model_path: str | Path) -> str | None:
    """``common.checksum.weights_sha256`` of the base model directory (None: not a local safetensors dir)."""
    try:
        return weights_sha256(model_path)
    except FileNotFoundError:
        return None


def verify_base(model_path: str | Path) -> str | None:
    """A base that carries a ``manifest.json`` (the shipped ones, or one ``learner.sft`` built) must still hold
    the weights the manifest names: the reason it does not, else None (also when there is no manifest)."""
    m = Path(model_path) / "manifest.json"
    if not m.is_file():
        return None
    try:
        want = json.loads(m.read_text()).get("sha256")
    except (OSError, ValueError) as e:
        return f"{m} is unreadable ({e})"
    have = base_checksum(model_path)
    if have != want:
        return (f"base model {model_path} is not the one its manifest.json describes (weights sha256 {have}, "
                f"manifest {want}): it was modified or replaced")
    return None


def threads() -> dict[str, Any]:
    """This process's torch thread count and the OpenMP settings that change it or its speed."""
    out: dict[str, Any] = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}
    if "torch" in sys.modules:  # importing torch only to ask would cost seconds in a process without it
        out["torch"] = sys.modules["torch"].get_num_threads()
    return out


def load() -> float | None:
    """1-minute load average: a busy machine changes timings (not results); recorded beside them."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def collect(model_path: str | Path | None = None, configured_threads: dict[str, int] | None = None) -> dict[str, Any]:
    """Everything above as one JSON-ready dict; ``configured_threads`` names the thread settings that apply
    (e.g. learner, engine), ``model_path`` the base whose checksum is recorded."""
    out: dict[str, Any] = {"commit": commit(), "cpu": cpu(), "versions": versions(),
                           "threads": {**threads(), **(configured_threads or {})}, "load_1m": load()}
    if model_path is not None:
        out["base"] = {"path": str(model_path), "sha256": base_checksum(model_path)}
    return out


def for_config(cfg: Config) -> dict[str, Any]:
    """``collect`` for a run's config: its base model (and the critic's, when it has its own), and the thread
    settings of each role."""
    out = collect(cfg.model.path, {"learner": cfg.learner.threads, "engine": cfg.engine.threads,
                                   "bootstrap": cfg.model.bootstrap.threads})
    if cfg.model.critic_path:
        out["critic_base"] = {"path": str(cfg.model.critic_path), "sha256": base_checksum(cfg.model.critic_path)}
    return out


def machine_key(p: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for two builds to be expected bit-equal: CPU model, torch kernel level, torch version."""
    c = p.get("cpu", {})
    return c.get("model"), c.get("torch_capability"), p.get("versions", {}).get("torch")


def describe(p: dict[str, Any] | None) -> str:
    """One line for a table or log: ``Intel Xeon (AVX512, 2 threads), torch 2.13.0, deepspeed 0.19.8, abc1234``."""
    if not p:
        return "unknown"
    c, v, t = p.get("cpu", {}), p.get("versions", {}), p.get("threads", {})
    th = t.get("learner", t.get("bootstrap", t.get("torch")))
    sha = (p.get("commit") or {}).get("sha")
    dirty = "+dirty" if (p.get("commit") or {}).get("dirty") else ""
    base = (p.get("base") or {}).get("sha256")
    return (f"{c.get('model', '?')} ({c.get('torch_capability', '?')}, {th} thread{'' if th == 1 else 's'}), torch {v.get('torch', '?')}, "
            f"deepspeed {v.get('deepspeed', '?')}, commit {sha[:10] if sha else '?'}{dirty}"
            + (f", base {base[:12]}" if base else ""))


def of_run(run_dir: str | Path) -> dict[str, Any] | None:
    """What produced a run: its metrics.jsonl's first ``header`` record (None: a run from before headers)."""
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        return None
    with f.open() as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "header":
                return r
    return None


def machines_line(run_dirs: list[Path]) -> str:
    """One line for a results table: each distinct machine/versions/threads/base, with its run count, the
    1-minute load its runs started at (range) and their commits, and how many runs recorded none ("unknown")."""
    groups: dict[str, tuple[int, set[str], list[float]]] = {}
    unknown = 0
    for d in run_dirs:
        p = of_run(d)
        if p is None:
            unknown += int((Path(d) / "metrics.jsonl").is_file())
            continue
        c, v, t = p.get("cpu", {}), p.get("versions", {}), p.get("threads", {})
        key = (f"{c.get('model')} ({c.get('torch_capability')}, {c.get('logical_cpus')} CPUs), torch {v.get('torch')}, "
               f"deepspeed {v.get('deepspeed')}, threads learner {t.get('learner')} / engine {t.get('engine')}, "
               f"base {((p.get('base') or {}).get('sha256') or '?')[:12]}")
        n, commits, loads = groups.get(key, (0, set(), []))
        sha = (p.get("commit") or {}).get("sha")
        commits = commits | {(sha or "?")[:10] + ("+dirty" if (p.get("commit") or {}).get("dirty") else "")}
        groups[key] = (n + 1, commits, loads + [float(p["load_1m"])] if p.get("load_1m") is not None else loads)
    parts = []
    for k, (n, cs, loads) in groups.items():
        # machines shared with other work: the load says how much (a run's wall time depends on it)
        load = "" if not loads else (f", load {min(loads):g} at start" if min(loads) == max(loads)
                                     else f", load {min(loads):g}–{max(loads):g} at start")
        parts.append(f"{k}: {n} run{'s' if n != 1 else ''}{load}, commit {', '.join(sorted(cs))}")
    if unknown:
        parts.append(f"unknown (no metrics.jsonl header): {unknown} run{'s' if unknown != 1 else ''}")
    return "; ".join(parts) if parts else "unknown (no runs)"


__all__ = ["base_checksum", "collect", "commit", "cpu", "describe", "for_config", "load", "machine_key",
           "machines_line", "of_run", "threads", "verify_base", "versions"]
