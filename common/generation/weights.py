"""Weight updates of the served model: read a safetensors checkpoint, check it against the live parameters,
copy it in.

``LiveWeights(model).read(path)`` reads every tensor of an HF checkpoint directory (one file or shards)
and refuses unknown or missing tensors, shape mismatches, non-float dtypes (integer or bool tensors are
no weights: casting them would serve garbage) and values that are not finite once cast to the served
dtype; ``install(sd)`` then copies the tensors into the model's parameters in place (the scheduler calls
it between two decode steps, through ``WeightUpdates``: the served version and the one update waiting). A float dtype other than the served one is cast, as SGLang's loaders do
(``param.data.copy_``), and refused when the cast overflows (an fp32 value past fp16's range).

Only regular files are read, and the check is made on the opened file: each file is opened with
``O_NONBLOCK`` (opening a FIFO then returns at once instead of waiting for a writer), ``fstat``-ed, and
read through ``/proc/self/fd`` so that a path swapped for a FIFO after the check cannot be what is read.

Deviations from SGLang: safetensors only (``load_format`` auto | safetensors), always from local disk.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

log = logging.getLogger("vapo.engine")


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the served model."""


def _open_regular(p: Path) -> int:
    """An fd of ``p`` if the opened file is a regular file; anything else is refused. Opening a FIFO (or a
    device) for reading blocks until a writer appears, in a call that holds the interpreter, so no later
    timeout or signal handler could interrupt it: O_NONBLOCK makes that open return at once."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise WeightLoadError(f"cannot open {p.name}: {e.strerror or e}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WeightLoadError(f"{p.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_regular_text(p: Path) -> str:
    fd = _open_regular(p)
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def read_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (single file or shards)."""
    path = Path(model_path)
    if not path.is_dir():
        raise WeightLoadError(f"model_path {str(path)!r} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(_read_regular_text(index))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightLoadError(f"{index.name} is not a safetensors index: {e}") from e
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {str(path)!r}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        fd = _open_regular(path / name)
        try:
            # The opened (checked) file itself, whatever the name points at by now.
            out.update(load_file(f"/proc/self/fd/{fd}", device="cpu"))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise WeightLoadError(f"cannot read {name}: {e}") from e
        finally:
            os.close(fd)
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
            live = self.params[name]
            if tuple(t.shape) != tuple(live.shape):
                raise WeightLoadError(f"shape mismatch for {name}: {tuple(t.shape)} vs {tuple(live.shape)}")
            if not t.is_floating_point():
                raise WeightLoadError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}: weights must be "
                                      f"floating point (served as {str(live.dtype).removeprefix('torch.')})")
            if t.dtype != live.dtype:
                t = sd[name] = t.to(live.dtype)
            if not torch.isfinite(t).all():
                raise WeightLoadError(f"non-finite values in {name}"
                                      + ("" if t.dtype == torch.float32 else f" (as {str(t.dtype).removeprefix('torch.')})"))
        return sd

    def install(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors into the parameters in place (views the model runner fused stay valid)."""
        with torch.no_grad():
            for name, t in sd.items():
                self.params[name].copy_(t)


class WeightUpdates:
    """The served weight version and the one checked update waiting for a step boundary (a newer update
    supersedes it). Touched only on the scheduler thread; each update's future resolves to (success, message)."""

    def __init__(self, live: LiveWeights, version: str, metrics: Any = None) -> None:
        self.live = live
        self.version = version
        self.metrics = metrics
        self.pending: tuple[dict[str, torch.Tensor], str | None, cf.Future] | None = None
        self._set_version_metric()

    def arm(self, sd: dict[str, torch.Tensor], version: str | None, fut: cf.Future) -> None:
        if self.pending is not None:
            self.pending[2].set_result((False, "Superseded by a newer weight update."))
        self.pending = (sd, version, fut)

    def apply(self) -> None:
        """Install the waiting update (there must be one) and move the served version with it."""
        assert self.pending is not None
        sd, version, fut = self.pending
        self.pending = None
        self.live.install(sd)
        if version is not None:
            self.version = version
        self._set_version_metric()
        fut.set_result((True, "Succeeded to update model weights."))
        log.info("weights updated (version %s)", self.version)

    def fail(self, message: str) -> None:
        """Answer the waiting update, if any, with ``message`` (the engine died)."""
        if self.pending is not None:
            self.pending[2].set_result((False, message))
            self.pending = None

    def _set_version_metric(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.weight_version.set(float(self.version))
            except ValueError:
                pass
