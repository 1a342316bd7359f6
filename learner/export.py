"""Any checkpoint's policy as a Hugging Face directory, written as the published weight versions are.

    python -m learner.export runs/default --out exports/default              # the run's newest checkpoint
    python -m learner.export runs/default --version 20 --out exports/v20     # its checkpoints/v20
    python -m learner.export runs/default/checkpoints/v20 --out DIR [--dtype bfloat16] [--model DIR] [--force]

Only the newest ``learner.keep_weights`` published versions stay in ``<run dir>/weights``; a checkpoint
(``learner.checkpoint``) is the only copy of an older policy. This reads one offline, on the CPU, with any
number of ranks behind it: the checkpoint is verified against its ``COMPLETE`` digests first (a damaged one
is refused, naming the file and the newest intact checkpoint; nothing is renamed), then the policy's tensors
are read from DeepSpeed's files: the module states under ZeRO 0-2 (the weights the learner published, memory
mapped), the fp32 partitions of every rank consolidated under ZeRO-3, and under ZeRO-1/2 for ``--dtype
float32`` of a bf16/fp16 learner (DeepSpeed's ``zero_to_fp32``; under ZeRO-3 lazily, one tensor at a time). They are written by ``learner.weights.write_hf``, the writer of the published versions,
against a skeleton of the model on the meta device: safetensors shards, ``config.json`` (its ``dtype`` the
export's), ``generation_config.json`` and the tokenizer, from the run's base model (``--model``, else the run's
``model.path``, else its newest published version). ``export.json`` records where it came from (run,
version, checkpoint and the sha256 of its ``COMPLETE``, ``weights_sha256`` as in a published ``STABLE``).

The dtype is the one the learner held the policy in (``model.dtype``, or ``learner.precision``'s bf16/fp16),
so that an export equals the published version of its number tensor for tensor; ``--dtype`` casts. Written
into a temporary directory beside ``--out`` and renamed at the end; an existing non-empty ``--out`` is refused
without ``--force``. Exit status 2 for a refusal (damaged checkpoint, existing output, nothing to export).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from common.checksum import weights_sha256
from common.cli import setup_logging
from common.modeling import load_tokenizer, torch_dtype
from learner import checkpoint
from learner.host_tensors import tied_aliases
from learner.weights import complete_versions, version_dir, write_hf

log = logging.getLogger("learner.export")
REPO = Path(__file__).resolve().parents[1]
PROVENANCE = "export.json"
PROGRESS_S = 10.0  # seconds between progress lines while the tensors are written
STATE_TAG = "state"  # the tag learner.checkpoint.save gives DeepSpeed's save_checkpoint


class ExportRefused(RuntimeError):
    """An export that must not happen as asked (the message says why and what to do instead)."""


def _newest_intact_hint(root: Path) -> str:
    chosen, _ = checkpoint.newest_intact(root)
    if chosen is None:
        return f"no intact checkpoint under {root}"
    return f"the newest intact checkpoint is {chosen[1]} (--version {chosen[0]})"


def _verified(path: Path) -> bool:
    """``checkpoint.verify``, damage refused with the intact alternative; False for a format-1 checkpoint."""
    t0 = time.monotonic()
    log.info("verifying %s against its %s digests", path, checkpoint.COMPLETE)
    try:
        ok = checkpoint.verify(path)
    except checkpoint.CheckpointDamaged as e:
        raise checkpoint.CheckpointDamaged(path, e.file, e.problem, f"not exported; {_newest_intact_hint(path.parent)}") from e
    if not ok:
        log.warning("%s has no digests (written before checkpoints carried them): exporting it unverified", path)
    else:
        log.info("%s intact (%.1f s)", path.name, time.monotonic() - t0)
    return ok


def pick_checkpoint(path: Path, version: int | None = None) -> tuple[Path, bool]:
    """The checkpoint ``path`` names (a checkpoint directory, or a run directory: its newest complete
    checkpoint, or ``checkpoints/v<version>``), verified; returns it and whether its digests were checked."""
    if (path / checkpoint.COMPLETE).is_file():
        if version is not None and path.name != f"v{version}":
            raise ExportRefused(f"{path} is checkpoint {path.name}, not v{version}: name the run directory with --version")
        return path, _verified(path)
    root = path / "checkpoints"
    found = checkpoint.complete_checkpoints(root)
    if not found:
        raise ExportRefused(f"{path} is neither a complete checkpoint (no {checkpoint.COMPLETE}) nor a run directory "
                            f"with one under checkpoints/")
    if version is None:
        newest = found[-1][1]
        log.info("newest checkpoint of %s: %s", path, newest.name)
        return newest, _verified(newest)
    chosen = dict(found).get(version)
    if chosen is None:
        raise ExportRefused(f"{root} has no complete checkpoint v{version}; complete: "
                            f"{', '.join(f'v{v}' for v, _ in found)}")
    return chosen, _verified(chosen)


@dataclass
class PolicyState:
    """The policy's tensors in a checkpoint, as DeepSpeed stored them (read lazily)."""

    tensors: Mapping[str, Any]  # name -> tensor, or zero_to_fp32's lazy tensor (``.contiguous()`` reads it)
    dtype: torch.dtype  # the dtype the learner held the policy in
    zero_stage: int
    ranks: int


def _model_states(state: Path) -> dict[str, Any]:
    """DeepSpeed's model-states file of (data-parallel) rank 0, memory-mapped: nothing is read until used."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (state / name).is_file():
            # Our own files (verified against COMPLETE where it lists digests); DeepSpeed pickles its config in them.
            return torch.load(state / name, map_location="cpu", mmap=True, weights_only=False)
    raise ExportRefused(f"{state} holds no DeepSpeed model states (mp_rank_00_model_states.pt)")


def read_policy(ckpt: Path, fp32_master: bool = False) -> PolicyState:
    """The policy's tensors in checkpoint ``ckpt``, without its ranks or their devices: the module's under
    ZeRO 0-2 (what was published), the optimizer's fp32 master weights under ZeRO-3 (the only whole copy) and,
    with ``fp32_master``, under ZeRO-1/2 (more precise than a bf16/fp16 module cast up)."""
    state = ckpt / "policy" / STATE_TAG
    first = _model_states(state)
    stage = int(first.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    ranks = int(first.get("dp_world_size", 1))
    module = first["module"]
    dtype = next((t.dtype for t in module.values() if t.is_floating_point()), torch.float32)
    if stage == 0 or (stage < 3 and not (fp32_master and dtype != torch.float32)):
        return PolicyState(module, dtype, stage, ranks)  # rank 0 saved the whole module, as it was published
    log.info("ZeRO-%d checkpoint of %d rank%s: consolidating the fp32 partitions", stage, ranks, "" if ranks == 1 else "s")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read on the CPU, whatever the learner ran on
    from deepspeed.utils.zero_to_fp32 import (  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after DS_ACCELERATOR is set
        get_fp32_state_dict_from_zero_checkpoint,
    )

    with contextlib.redirect_stdout(sys.stderr):  # it prints its progress: stdout is the export's summary
        tensors = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "policy"), tag=STATE_TAG, lazy_mode=True)
    return PolicyState(tensors, dtype, stage, ranks)


def _run_base(run_dir: Path) -> Path | None:
    """The run's ``model.path`` from its saved config, where it still holds a model."""
    for name in ("config.yaml", "learner_config.yaml"):
        try:
            raw = yaml.safe_load((run_dir / name).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        path = str((raw.get("model") or {}).get("path") or "")
        for base in (Path(path), REPO / path) if path else ():
            if (base / "config.json").is_file():
                return base
    return None


def model_source(ckpt: Path, model: Path | None = None) -> Path:
    """Where the export's config, generation config and tokenizer come from: ``model``, else the run's
    ``model.path``, else the run's newest published version."""
    if model is not None:
        if not (model / "config.json").is_file():
            raise ExportRefused(f"--model {model} holds no config.json")
        return model
    if ckpt.parent.name == "checkpoints":
        run_dir = ckpt.parent.parent
        base = _run_base(run_dir)
        if base is not None:
            return base
        published = complete_versions(run_dir / "weights")
        if published:
            return version_dir(run_dir / "weights", published[-1])
    raise ExportRefused(f"no model config for {ckpt}: neither its run's model.path nor a published version is "
                        f"there; name the run's base model with --model DIR")


def skeleton(source: Path, dtype: torch.dtype) -> nn.Module:
    """The policy's model, built on the meta device (no memory): names, shapes, tied weights, config."""
    hf_cfg = AutoConfig.from_pretrained(str(source))
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    if (source / "generation_config.json").is_file():  # what from_pretrained would have given the policy
        module.generation_config = GenerationConfig.from_pretrained(str(source))
    return module


def _plan(module: nn.Module, state: PolicyState) -> list[tuple[str, torch.Size]]:
    """The names (tied aliases left out) and shapes to write, in state-dict order; the checkpoint must hold
    exactly the skeleton's tensors."""
    entries = list(module.state_dict(keep_vars=True).items())
    alias = tied_aliases(module, entries)
    want = [(n, t.shape) for n, t in entries if n not in alias]
    missing = [n for n, _ in want if n not in state.tensors]
    extra = [n for n in state.tensors if n not in dict(entries)]
    wrong = [f"{n} {tuple(state.tensors[n].shape)} != {tuple(s)}" for n, s in want
             if n in state.tensors and tuple(state.tensors[n].shape) != tuple(s)]
    if missing or extra or wrong:
        hf_config: Any = module.config  # nn.Module's __getattr__ types an HF model's config as Tensor | Module
        raise ExportRefused(f"the checkpoint's policy is not the model of {hf_config.name_or_path or 'the config'}: "
                            f"missing {missing[:3]}, unexpected {extra[:3]}, shapes {wrong[:3]} "
                            f"(name the run's base model with --model DIR)")
    return want


def _tensors(state: PolicyState, plan: list[tuple[str, torch.Size]], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Each planned tensor read (one at a time) and cast, with a progress line every ``PROGRESS_S``."""
    total = sum(s.numel() for _, s in plan) * dtype.itemsize
    done, t0 = 0, time.monotonic()
    last = t0
    for name, _ in plan:
        t = state.tensors[name].contiguous()
        yield name, t.to(dtype) if t.is_floating_point() else t
        done += t.numel() * dtype.itemsize
        if time.monotonic() - last >= PROGRESS_S:
            last = time.monotonic()
            log.info("%d%% of %.1f MB read and written (%.0f s)", 100 * done // max(total, 1), total / 1e6, last - t0)
    log.info("%d tensors, %.1f MB read in %.1f s", len(plan), total / 1e6, time.monotonic() - t0)


def _provenance(ckpt: Path, state: PolicyState, dtype: torch.dtype, source: Path, verified: bool,
                out: Path, files: list[str]) -> dict[str, Any]:
    info = json.loads((ckpt / "learner.json").read_text())
    return {
        "run": ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else None,
        "version": int(info["version"]), "samples_seen": int(info.get("samples_seen", 0)),
        "checkpoint": str(ckpt.resolve()),
        "checkpoint_sha256": hashlib.sha256((ckpt / checkpoint.COMPLETE).read_bytes()).hexdigest(),
        "checkpoint_verified": verified, "zero_stage": state.zero_stage, "ranks": state.ranks,
        "dtype": str(dtype).removeprefix("torch."), "model_source": str(source.resolve()),
        "weights_sha256": weights_sha256(out), "files": sorted(files), "created_at": time.time(),
    }


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ExportRefused(f"--out {out} exists and is not empty; --force replaces it")


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; what ``out`` held (``--force``) goes only once it is replaced."""
    old = None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)  # over an empty directory, if any
    if old is not None and old.is_dir():
        shutil.rmtree(old)
    elif old is not None:
        old.unlink()


def export(ckpt: Path, out: Path, dtype: str | None = None, model: Path | None = None, force: bool = False,
           verified: bool = True) -> dict[str, Any]:
    """Write checkpoint ``ckpt``'s policy (already verified: ``pick_checkpoint``) to ``out`` as an HF
    directory; returns its provenance (also in ``out/export.json``)."""
    _check_out(out, force)
    state = read_policy(ckpt, fp32_master=dtype == "float32")
    want = torch_dtype(dtype) if dtype else state.dtype
    source = model_source(ckpt, model)
    module = skeleton(source, want)
    plan = _plan(module, state)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        log.info("exporting %s's policy (ZeRO-%d, %d rank%s) as %s to %s", ckpt, state.zero_stage, state.ranks,
                 "" if state.ranks == 1 else "s", str(want).removeprefix("torch."), out)
        files = write_hf(module, _tensors(state, plan, want), tmp, load_tokenizer(source))
        prov = _provenance(ckpt, state, want, source, verified, tmp, files)
        (tmp / PROVENANCE).write_text(json.dumps(prov, indent=1) + "\n")
        _check_out(out, force)  # something may have written there meanwhile
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prov


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m learner.export", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("path", type=Path, help="a run directory (its newest checkpoint, or --version's) or a checkpoint directory")
    ap.add_argument("--out", type=Path, required=True, help="the HF directory to write (refused if it exists and is not empty)")
    ap.add_argument("--version", type=int, default=None, metavar="N", help="the checkpoint of version N (checkpoints/vN)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="the weights' dtype (default: the one the learner held them in, as published)")
    ap.add_argument("--model", type=Path, default=None, metavar="DIR",
                    help="config and tokenizer from this HF directory (default: the run's model.path, else its newest published version)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--log-level", default="INFO", help="progress lines on stderr at this level (default INFO)")
    args = ap.parse_args(argv)
    setup_logging(args.log_level, "export")
    try:
        ckpt, verified = pick_checkpoint(args.path, args.version)
        prov = export(ckpt, args.out, args.dtype, args.model, args.force, verified)
    except (ExportRefused, checkpoint.CheckpointDamaged) as e:
        print(f"learner.export: {e}", file=sys.stderr)
        return 2
    log.info("wrote %s: policy v%d, %s, weights sha256 %s", args.out, prov["version"], prov["dtype"],
             prov["weights_sha256"][:12])
    print(json.dumps(prov))
    return 0


if __name__ == "__main__":
    sys.exit(main())
