"""Weight updates of the served model: read a safetensors checkpoint, check it against the live parameters,
copy it in.

``LiveWeights(model).read(path)`` reads every tensor of an HF checkpoint directory (one file or shards)
and refuses unknown or missing tensors, shape mismatches and non-finite values; ``install(sd)`` then copies
the tensors into the model's parameters in place (the scheduler calls it between two decode steps). Only
regular files are opened: a FIFO named like a checkpoint would block the reader forever.

Deviations from SGLang: safetensors only (``load_format`` auto | safetensors), always from local disk.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import torch


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the served model."""


def _regular_file(p: Path) -> None:
    """Refuse anything but a regular file: opening a FIFO (or a device) named like a checkpoint blocks the
    reader forever, which no later timeout can interrupt."""
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise WeightLoadError(f"cannot stat {p.name}: {e}") from e
    if not stat.S_ISREG(mode):
        raise WeightLoadError(f"{p.name} is not a regular file")


def read_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (single file or shards)."""
    from safetensors.torch import load_file

    path = Path(model_path)
    if not path.is_dir():
        raise WeightLoadError(f"model_path {str(path)!r} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.exists():
        _regular_file(index)
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {str(path)!r}")
    for name in files:
        _regular_file(path / name)
    out: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            out.update(load_file(str(path / name), device="cpu"))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise WeightLoadError(f"cannot read {name}: {e}") from e
    return out


class LiveWeights:
    """The served model's parameters by name, for checking and installing a weight update."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Every parameter name, tied duplicates included (checkpoints may or may not store lm_head.weight).
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._aliases: dict[int, set[str]] = {}
        for name, p in self.params.items():
            self._aliases.setdefault(id(p), set()).add(name)

    def read(self, model_path: str | Path) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, checked against the live parameters; raises ``WeightLoadError``."""
        sd = read_state_dict(model_path)
        unknown = sorted(set(sd) - set(self.params))
        if unknown:
            raise WeightLoadError(f"tensors not in the served model: {unknown[:5]}")
        missing = sorted(n for n, p in self.params.items() if not self._aliases[id(p)] & sd.keys())
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]}")
        for name, t in sd.items():
            if tuple(t.shape) != tuple(self.params[name].shape):
                raise WeightLoadError(f"shape mismatch for {name}: {tuple(t.shape)} vs {tuple(self.params[name].shape)}")
            if not torch.isfinite(t.float()).all():
                raise WeightLoadError(f"non-finite values in {name}")
        return sd

    def install(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors into the parameters in place (views the model runner fused stay valid)."""
        with torch.no_grad():
            for name, t in sd.items():
                self.params[name].copy_(t)
