"""Benchmark: bytes all-gathered and DeepSpeed trace invalidations of a ZeRO-3 learner step, per phase.

    .venv/bin/python -m ops.bench.zero3_traffic [--quick] [--steps 4] [--vocab 32768] [--hidden 64] [--layers 2]

Prints one JSON line. Two CPU ranks (torchrun, gloo, real subprocesses) build a real ``learner.train.Learner``
with ``learner.zero_stage=3`` on a random Qwen2 made on the fly: tiny layers under a large, untied vocabulary,
so that the LM head (its own module, as in Qwen2.5-32B) and the embedding dominate the bytes, as the head
dominates a 32B model's per-call traffic. Every pass kind runs, as in ``ops/configs/paper.yaml``: the critic's
value pass (no grad) and update, the recomputed π_old (``learner.off_policy=rollout_correction``, no grad)
and the actor update, with ``algo.actor_values=pre_update``, activation checkpointing, and a
``learner.logits_chunk_elements`` that puts the head in several chunks. Synthetic groups of varied lengths,
``--steps`` steps (the first is the warm-up: DeepSpeed records its traces there).

Counted on each rank, per phase of ``Learner.step`` (``learner.step_stats.Phases``), after the warm-up step:

- bytes all-gathered, at DeepSpeed's two entry points in ``deepspeed/runtime/zero/partition_parameters.py``:
  ``_dist_allgather_fn`` (what the parameter coordinator's fetches and prefetches run, through
  ``all_gather_coalesced``: the gathered buffer's bytes) and ``Init._all_gather`` (``param.all_gather()``:
  external parameters, ``GatheredParameters``, the persistent parameters re-gathered after each optimizer
  step: the bytes of the parameters it gathers). The ``stage3_use_all_reduce_for_fetch_params`` path
  (all-reduce instead) is not counted; vapo does not set it.
- the floor: each model's parameter bytes × (root forwards + backwards) it ran in that phase, every
  micro-batch really run (fillers included): every parameter gathered once per micro-batch forward and once
  per backward. Checkpoint recompute and re-gathers inside a pass are above the floor; parameters kept
  resident (``stage3_param_persistence_threshold``, reuse within ``stage3_max_reuse_distance``) bring it down.
- trace invalidations: calls of ``PartitionedParameterCoordinator._invalidate_trace``; and the share of
  sub-module fetches made while the coordinator's trace was complete (prefetching);
- ``resident_at_pass_start_mib``: the most partitioned-parameter bytes found still gathered when a pass starts
  (every step, the warm-up too): 0 unless something a pass gathered outlives it.

Judged on deterministic counts, so one round (``ops/bench/measure.py``'s fields with ``rounds`` = 1; a
``--quick`` run judges too, on fewer, smaller steps): ``gathered_over_floor`` (whole step) ≤ 1.1 and
``trace_invalidations`` = 0; ``verdict`` pass when both hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from common.config import load_config  # noqa: E402
from common.modeling import build_char_tokenizer, save_hf  # noqa: E402
from common.ports import free_port  # noqa: E402
from ops.bench.measure import Run, combined_verdict, summarise  # noqa: E402

if TYPE_CHECKING:  # the annotation only: the learner is imported in the ranks, where install patches it
    from learner.train import Phases

GOAL_RATIO = 1.1  # bytes all-gathered per step / the floor
GOAL_INVALIDATIONS = 0  # after the warm-up step
DEFAULTS = {"steps": 4, "groups": 4, "group_size": 4, "resp_max": 160}
QUICK = {"steps": 2, "groups": 2, "group_size": 4, "resp_max": 96}
OUTSIDE = "between_phases"


def make_model(out: Path, vocab: int, hidden: int, layers: int) -> dict[str, int]:
    """A random fp32 Qwen2 with untied embeddings in ``out``; its shape and parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415 - only the parent makes the model

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg)
    save_hf(model, build_char_tokenizer(), out)
    head = model.get_output_embeddings().weight.numel()
    return {"vocab": vocab, "hidden": hidden, "layers": layers, "params": sum(p.numel() for p in model.parameters()),
            "head_params": head}


def overrides(model: Path, quick: bool, vocab: int) -> list[str]:
    """The learner config of every rank: ZeRO-3, every pass kind, the head in several chunks."""
    return [f"model.path={model}", "learner.zero_stage=3", "learner.precision=fp32", "model.dtype=float32",
            "learner.activation_checkpointing=true", "learner.off_policy=rollout_correction",
            "algo.actor_values=pre_update", f"learner.batch_groups={(QUICK if quick else DEFAULTS)['groups']}",
            "learner.mini_batches=2", "learner.micro_batch_size=2",
            f"learner.logits_chunk_elements={48 * vocab}",  # ~48 tokens per head chunk: 1-4 chunks a micro-batch
            "algo.alpha=0.5", "metrics.prometheus=false", "learner.value_head_init_std=0.02"]


# ------------------------------------------------------------------------------------------- counting


class Traffic:
    """Per-phase counters of one rank, installed over DeepSpeed's entry points (``install``)."""

    def __init__(self) -> None:
        self.phase = OUTSIDE
        self.measuring = False
        self.gathered: dict[str, float] = defaultdict(float)
        self.gathered_by_path: dict[str, float] = defaultdict(float)
        self.passes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.invalidations: dict[str, int] = defaultdict(int)
        self.warmup_invalidations = 0
        self.fetches = [0, 0]  # sub-module fetches: with a complete trace, all
        self.param_bytes: dict[str, float] = {}
        self.resident = 0.0  # most bytes of partitioned parameters left gathered at the start of a pass

    def _gathered(self, path: str, nbytes: float) -> None:
        if self.measuring:
            self.gathered[self.phase] += nbytes
            self.gathered_by_path[path] += nbytes

    def install(self) -> None:
        """Wrap the all-gather entry points, the trace invalidation and the fetch, and the phase timer."""
        from deepspeed.runtime.zero import partition_parameters as pp  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
        from deepspeed.runtime.zero.partitioned_param_coordinator import (  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
            PartitionedParameterCoordinator as Coordinator,
        )

        import learner.train  # noqa: PLC0415 - patched in place: the module whose Phases the step uses

        fn, gather, invalidate, fetch = (pp._dist_allgather_fn, pp.Init._all_gather, Coordinator._invalidate_trace,
                                         Coordinator.fetch_sub_module)

        def dist_allgather(input_tensor: torch.Tensor, output_tensor: torch.Tensor, group: Any = None) -> Any:
            self._gathered("coordinator", output_tensor.numel() * output_tensor.element_size())
            return fn(input_tensor, output_tensor, group)

        def all_gather(init: Any, param_list: Any, async_op: bool = False, hierarchy: Any = None) -> Any:
            todo = [p for p in param_list if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            self._gathered("param_all_gather", sum(p.ds_numel * p.ds_tensor.element_size() for p in todo))
            return gather(init, param_list, async_op=async_op, hierarchy=hierarchy)

        def invalidate_trace(coord: Any) -> None:
            if self.measuring:
                self.invalidations[self.phase] += 1
            else:
                self.warmup_invalidations += 1
            invalidate(coord)

        def fetch_sub_module(coord: Any, module: Any, forward: bool) -> None:
            if self.measuring:
                self.fetches[0] += int(coord.is_complete_trace())
                self.fetches[1] += 1
            fetch(coord, module, forward)

        pp._dist_allgather_fn = dist_allgather
        pp.Init._all_gather = all_gather
        Coordinator._invalidate_trace = invalidate_trace
        Coordinator.fetch_sub_module = fetch_sub_module
        # Rebinding the class name is the point of the patch; mypy refuses any assignment to a class name.
        learner.train.Phases = self._phases_class(learner.train.Phases)  # type: ignore[misc]

    def _phases_class(self, base: type[Phases]) -> type[Phases]:
        traffic = self

        class TrackedPhases(base):  # type: ignore[misc,valid-type]
            @contextmanager
            def __call__(self, name: str) -> Iterator[None]:
                traffic.phase = name
                try:
                    with super().__call__(name):
                        yield
                finally:
                    traffic.phase = OUTSIDE

        return TrackedPhases

    def watch(self, name: str, engine: Any) -> None:
        """Count ``engine``'s root forwards and backwards per phase; note its parameter bytes."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

        params = list(engine.module.parameters())
        self.param_bytes[name] = float(sum(p.ds_numel * p.ds_tensor.element_size() for p in params))

        def forward(*_: Any) -> None:
            # After DeepSpeed's own pre-hooks: the previous pass's prefetches are released, and this pass's first
            # ones are in flight (not counted); a partitioned parameter available now outlived an earlier pass.
            left = sum(p.ds_numel * p.ds_tensor.element_size() for p in params
                       if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist)
            self.resident = max(self.resident, float(left))
            if self.measuring:
                self.passes[self.phase][f"{name}_forward"] += 1

        engine.module.register_forward_pre_hook(forward)
        backward = engine.backward

        def counted_backward(*a: Any, **kw: Any) -> Any:
            if self.measuring:
                self.passes[self.phase][f"{name}_backward"] += 1
            return backward(*a, **kw)

        engine.backward = counted_backward

    def floor(self, phase: str) -> float:
        n = self.passes.get(phase, {})
        return sum(b * (n.get(f"{m}_forward", 0) + n.get(f"{m}_backward", 0)) for m, b in self.param_bytes.items())

    def report(self) -> dict[str, Any]:
        phases = sorted(set(self.gathered) | set(self.passes) | set(self.invalidations))
        return {"gathered": dict(self.gathered), "floor": {p: self.floor(p) for p in phases},
                "passes": {p: dict(v) for p, v in self.passes.items()}, "invalidations": dict(self.invalidations),
                "warmup_invalidations": self.warmup_invalidations, "fetches": self.fetches,
                "gathered_by_path": dict(self.gathered_by_path), "param_bytes": self.param_bytes,
                "resident": self.resident}


def step_groups(k: int, quick: bool, vocab: int) -> list[Any]:
    """Step ``k``'s groups: prompts of 4-16 tokens, responses of 8 to ``resp_max`` (varied micro-batches)."""
    from learner.synthetic import synth_groups  # noqa: PLC0415 - the learner is imported after setup_distributed

    size = QUICK if quick else DEFAULTS
    return synth_groups(size["groups"], size["group_size"], vocab, seed=1000 + k, prompt_len=(4, 16),
                        resp_len=(8, size["resp_max"]), max_new_tokens=size["resp_max"])


def child(model: str, out: str, quick: bool, vocab: int, steps: int) -> None:
    """One rank (run under torchrun): ``steps`` learner steps, counted after the first; writes rank<r>.json."""
    torch.set_num_threads(1)
    from learner.dist import exit_process, rank, setup_distributed  # noqa: PLC0415 - after the thread setting

    cfg = load_config(None, overrides(Path(model), quick, vocab))
    setup_distributed(cfg)
    from learner.train import Learner  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    traffic = Traffic()
    traffic.install()
    learner = Learner(cfg, None)
    traffic.watch("policy", learner.policy)
    traffic.watch("critic", learner.critic)
    for k in range(steps):
        traffic.measuring = k > 0
        learner.step(step_groups(k, quick, vocab))
    (Path(out) / f"rank{rank()}.json").write_text(json.dumps(traffic.report()))
    exit_process(0)  # no interpreter finalisation: gloo's threads can abort a rank that finished


# ------------------------------------------------------------------------------------------- the run


def run_ranks(model: Path, out: Path, quick: bool, vocab: int, steps: int, ranks: int = 2) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VAPO_DS_SHM": "0", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "VAPO_STORE_FILE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "ops.bench.zero3_traffic", "--child", str(model), str(out),
           "1" if quick else "0", str(vocab), str(steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"ranks exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def summary(per_rank: list[dict[str, Any]], shape: dict[str, int], steps: int, run: Run) -> dict[str, Any]:
    """The JSON line from the ranks' counters (rank 0's bytes; invalidations: the most any rank saw)."""
    r0 = per_rank[0]
    phases = sorted(set(r0["gathered"]) | set(r0["floor"]))
    gathered, floor = sum(r0["gathered"].values()), sum(r0["floor"].values())
    inval = max(sum(r["invalidations"].values()) for r in per_rank)
    ratio = gathered / floor if floor > 0 else float("inf")
    judged = summarise([ratio], GOAL_RATIO, higher_is_better=False, name="gathered_over_floor", min_rounds=1)
    inval_verdict = "pass" if inval <= GOAL_INVALIDATIONS else "fail"
    done, total = r0["fetches"]
    return {
        "bench": "zero3_traffic", **judged, "verdict": combined_verdict([judged["verdict"], inval_verdict]),
        "ratio_verdict": judged["verdict"], "invalidations_verdict": inval_verdict,
        "invalidations_goal": f"<= {GOAL_INVALIDATIONS}", "rounds": 1,
        "trace_invalidations": inval, "gathered_over_floor": round(ratio, 4),
        "trace_invalidations_by_phase": r0["invalidations"],
        "trace_invalidations_per_rank": [sum(r["invalidations"].values()) for r in per_rank],
        "warmup_trace_invalidations": r0["warmup_invalidations"],
        "trace_complete_fraction": _ratio(done, total),
        "gathered_over_floor_by_phase": {p: _ratio(r0["gathered"].get(p, 0.0), r0["floor"].get(p, 0.0)) for p in phases},
        "gathered_mib_by_phase": {p: round(r0["gathered"].get(p, 0.0) / 2**20, 2) for p in phases},
        "floor_mib_by_phase": {p: round(r0["floor"].get(p, 0.0) / 2**20, 2) for p in phases},
        "gathered_mib_by_entry_point": {k: round(v / 2**20, 2) for k, v in r0["gathered_by_path"].items()},
        "resident_at_pass_start_mib": round(max(r["resident"] for r in per_rank) / 2**20, 3),
        "passes_by_phase": r0["passes"], "param_mib": {k: round(v / 2**20, 2) for k, v in r0["param_bytes"].items()},
        "ranks_gathered_equal": all(r["gathered"] == r0["gathered"] for r in per_rank),
        "model": shape, "steps": steps, "measured_steps": steps - 1, **run.common_fields(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        model, out, quick, vocab, n_steps = [a for a in argv[1:] if not a.startswith("--local")]
        child(model, out, quick == "1", int(vocab), int(n_steps))
        return 0
    ap = argparse.ArgumentParser(prog="python -m ops.bench.zero3_traffic", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 steps of 2 groups (1 warm-up, 1 measured)")
    ap.add_argument("--steps", type=int, default=None, help="steps, the first a warm-up (default 4; --quick 2)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args(argv)
    steps = a.steps or (QUICK if a.quick else DEFAULTS)["steps"]
    if steps < 2:
        ap.error("--steps must be at least 2: the first is the warm-up")
    run = Run(quick=a.quick)
    with tempfile.TemporaryDirectory() as d:
        shape = make_model(Path(d) / "model", a.vocab, a.hidden, a.layers)
        per_rank = run_ranks(Path(d) / "model", Path(d), a.quick, a.vocab, steps)
    print(json.dumps(summary(per_rank, shape, steps, run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
