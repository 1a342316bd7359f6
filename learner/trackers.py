"""Experiment trackers beside Prometheus: TensorBoard and Weights & Biases, fed the metrics.jsonl records.

Not a CLI. ``metrics.trackers`` names the trackers (``tensorboard``, ``wandb``; none by default); learner
rank 0 opens them once at start (``Trackers.open``, through ``learner.records.RunRecords``), every record
appended to metrics.jsonl goes to ``Trackers.log`` as well, and they are closed on exit, an exception's
included. Open the results with ``tensorboard --logdir runs/<name>/tensorboard`` and
``wandb sync runs/<name>/wandb/offline-run-*``.

- Names: a record's numbers, nested dicts flattened as ``a/b``. A ``learner_step`` record's names are its
  metrics.jsonl keys as they are (``reward_mean``, ``phase_seconds/actor_update``, ``eval/avg_at_k``); the other
  kinds' are prefixed with their kind (``eval/avg_at_k``, ``value_pretrain/loss``), so that value
  pretraining's ``value_mean`` is not the RL critic's and an engine evaluation lands beside an in-process one.
  ``kind``, ``step`` (the x axis) and ``time`` (the event's wall time) are not scalars; strings and lists
  are left out.
- Steps: the record's ``step`` (the learner version; value pretraining's own step). W&B gets each kind its
  own x axis (``step``, ``eval/step``, ``value_pretrain/step``: ``define_metric``), because W&B drops rows
  whose ``step=`` goes backwards, and an evaluation finishes after later steps were logged.
- ``header`` records (provenance) go in as text (TensorBoard) and as the ``header`` config entry (W&B); the
  resolved config once at open (TensorBoard: the ``config`` text, YAML; W&B: ``config=``).
- TensorBoard writes ``<run dir>/tensorboard/`` and flushes after every record; a resumed start adds an
  event file there (steps redone after the last checkpoint appear twice). W&B writes ``<run dir>/wandb/``,
  in ``metrics.wandb_mode`` (``offline`` by default: no network, no API key), its console capture off and
  ``WANDB_SILENT`` set; the run id is kept in ``<run dir>/wandb/run_id`` so that a resumed start resumes
  the same W&B run (each start is its own ``offline-run-*`` directory; sync them in order); closing waits
  until W&B's service has written the run's file.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config import Config, dump_yaml, to_dict

log = logging.getLogger("learner.trackers")

NOT_SCALARS = ("kind", "step", "time")  # a record's top-level keys that are no tracker's scalar


def _number(value: Any) -> float | None:
    """``value`` as a float when it is one number (Python, numpy, a 0-d tensor), else None."""
    if isinstance(value, str | bytes):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "__float__"):
        return float(value)
    return None


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The tracker names and values of ``record``'s numbers (see the module docstring for the names)."""
    kind = record.get("kind", "")
    out: dict[str, float] = {}

    def walk(d: Mapping[str, Any], prefix: str, top: bool) -> None:
        for key, value in d.items():
            if top and key in NOT_SCALARS:
                continue
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, name + "/", False)
            elif (x := _number(value)) is not None:
                out[name] = x

    walk(record, "" if kind == "learner_step" else f"{kind}/", True)
    return out


def _as_text(body: str) -> str:
    """``body`` as a Markdown code block (TensorBoard's text tab renders Markdown)."""
    return "\n".join("    " + line for line in body.splitlines())


class _TensorBoard:
    def __init__(self, cfg: Config) -> None:
        # Imported only when enabled: torch.utils.tensorboard pulls in tensorboard (seconds at start).
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard takes seconds to import

        self.dir = cfg.run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("config", _as_text(dump_yaml(cfg)), global_step=0)
        self.writer.flush()

    def log(self, kind: str, values: dict[str, float], step: int, walltime: float | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=walltime)
        self.writer.flush()

    def header(self, record: Mapping[str, Any]) -> None:
        self.writer.add_text("header", _as_text(json.dumps(record, indent=1, default=str)), global_step=0)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, cfg: Config) -> None:
        # Before the import: wandb reads them when it loads and when it starts its service.
        os.environ["WANDB_SILENT"] = "true"
        os.environ["WANDB_MODE"] = cfg.metrics.wandb_mode
        import wandb  # noqa: PLC0415 - wandb takes seconds to import and only runs that ask for it pay that

        # wandb logs its every call (the whole config included) at INFO to its own debug.log under the run
        # dir; not through ours as well.
        logging.getLogger("wandb").propagate = False

        self.dir = cfg.run_dir / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.metrics.wandb_project, name=cfg.run.name, id=_run_id(self.dir / "run_id"),
            # The ignore: wandb types mode as a Literal of its modes; the config's str is checked to be one of them.
            resume="allow", dir=str(cfg.run_dir), mode=cfg.metrics.wandb_mode,  # type: ignore[arg-type]
            config=to_dict(cfg),
            settings=wandb.Settings(console="off", silent=True))
        self.defined: set[str] = set()
        self._wandb = wandb

    def _axis(self, kind: str, names: list[str]) -> str:
        """The x axis of ``kind``'s metrics, declared with every name not yet declared."""
        axis = "step" if kind == "learner_step" else f"{kind}/step"
        for name in [axis, *names]:
            if name not in self.defined:
                if name == axis:
                    self.run.define_metric(axis)
                else:
                    self.run.define_metric(name, step_metric=axis)
                self.defined.add(name)
        return axis

    def log(self, kind: str, values: dict[str, float], step: int, walltime: float | None) -> None:
        axis = self._axis(kind, list(values))
        self.run.log({**values, axis: step})

    def header(self, record: Mapping[str, Any]) -> None:
        self.run.config.update({"header": json.loads(json.dumps(record, default=str))}, allow_val_change=True)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before W&B's service has written the run's file (seen for a second run in one
        # process), and the learner leaves through os._exit, past the atexit hook that would wait for it:
        # teardown waits until the service has written everything, then stops it.
        self._wandb.teardown()


def _run_id(path: Path) -> str:
    """The W&B run id kept at ``path`` (made on the run's first start): a resumed start continues that run."""
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)
    return run_id


_OPENERS = {"tensorboard": _TensorBoard, "wandb": _WandB}


class Trackers:
    """The run's open experiment trackers (rank 0): ``log`` each metrics.jsonl record, ``close`` at exit."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers

    @classmethod
    def open(cls, cfg: Config) -> Trackers | None:
        """The trackers ``metrics.trackers`` names, each opened once (None when it names none)."""
        names = list(dict.fromkeys(cfg.metrics.trackers))
        if not names:
            return None
        writers: list[Any] = []
        try:
            for name in names:
                writers.append(_OPENERS[name](cfg))
        except BaseException:
            cls(writers).close(failed=True)
            raise
        log.info("experiment trackers: %s (under %s)", ", ".join(names), cfg.run_dir)
        return cls(writers)

    def log(self, record: Mapping[str, Any], step: int | None = None) -> None:
        """``record``'s numbers at ``step`` (default: the record's own ``step``), flushed; a ``header``
        record (no step) as text. A record with neither a step nor numbers is left out."""
        kind = str(record.get("kind", ""))
        if kind == "header":
            for w in self.writers:
                w.header(record)
            return
        step = record.get("step") if step is None else step
        values = scalars(record)
        if step is None or not values:
            return
        walltime = _number(record.get("time"))
        for w in self.writers:
            w.log(kind, values, int(step), walltime)

    def close(self, failed: bool = False) -> None:
        """Close every tracker (W&B marks the run failed when ``failed``); the first error is raised after."""
        errors: list[BaseException] = []
        for w in self.writers:
            try:
                w.close(failed)
            except Exception as e:  # the others still close
                errors.append(e)
        self.writers = []
        if errors:
            raise errors[0]
