"""ops/bench/zero3_traffic.py: its ``--quick`` run (2 CPU ranks of a ZeRO-3 learner, ~25-50 s on 2 shared cores)
prints one judged JSON line whose figures add up, and its verdict is the two goals' (bytes ≤ 1.1 × the floor,
no trace invalidation after the warm-up step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ops.bench.measure import Run
from ops.bench.zero3_traffic import summary

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # the benchmark's quick run (~16 s); tests/learner/test_zero_trace.py holds the trace in the default suite
def test_quick_line_adds_up_and_meets_both_goals() -> None:
    p = subprocess.run([sys.executable, "-m", "ops.bench.zero3_traffic", "--quick"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stdout[-2000:]
    line = json.loads(lines[0])
    assert line["bench"] == "zero3_traffic" and line["quick"] is True and line["rounds"] == 1
    assert (line["ratio_name"], line["goal"], line["invalidations_goal"]) == ("gathered_over_floor", "<= 1.1", "<= 0")
    assert line["ratio"] == line["gathered_over_floor"] and line["ratio_rounds"] == [line["ratio"]]
    assert line["machine"]["cpus"] >= 1 and len(line["load_at_start"]) == 3 and len(line["load_at_end"]) == 3
    # Every pass kind ran: the critic's value pass and update, the recomputed pi_old and the actor update.
    passes = line["passes_by_phase"]
    assert passes["values"]["critic_forward"] > 0 and passes["proximal"]["policy_forward"] > 0
    for phase, model in (("critic_update", "critic"), ("actor_update", "policy")):
        assert passes[phase][f"{model}_forward"] == passes[phase][f"{model}_backward"] > 0
    # The floor of a phase is each model's parameter bytes times the passes it ran there.
    for phase, n in passes.items():
        want = sum(line["param_mib"][m] * (n.get(f"{m}_forward", 0) + n.get(f"{m}_backward", 0)) for m in ("policy", "critic"))
        assert line["floor_mib_by_phase"][phase] == pytest.approx(want, abs=0.05), phase
    gathered, floor = sum(line["gathered_mib_by_phase"].values()), sum(line["floor_mib_by_phase"].values())
    assert line["gathered_over_floor"] == pytest.approx(gathered / floor, rel=1e-3)
    assert sum(line["gathered_mib_by_entry_point"].values()) == pytest.approx(gathered, abs=0.05)
    # Untied 32k x 64 head and embedding: the policy is ~2x the critic (no head), both mostly embedding.
    assert line["param_mib"]["policy"] == pytest.approx(2 * line["param_mib"]["critic"], rel=0.1)
    assert line["ranks_gathered_equal"] is True and line["resident_at_pass_start_mib"] == 0
    assert line["trace_invalidations"] == 0 and line["warmup_trace_invalidations"] == 0, line
    assert line["trace_complete_fraction"] == 1.0 and line["gathered_over_floor"] <= 1.1
    assert line["verdict"] == "pass"


def _rank(gathered: float, floor: float, invalidations: int) -> dict[str, Any]:
    return {"gathered": {"actor_update": gathered}, "floor": {"actor_update": floor},
            "passes": {"actor_update": {"policy_forward": 1, "policy_backward": 1}},
            "invalidations": {"actor_update": invalidations} if invalidations else {}, "warmup_invalidations": 0,
            "fetches": [9, 10], "gathered_by_path": {"coordinator": gathered}, "param_bytes": {"policy": floor / 2},
            "resident": 0.0}


@pytest.mark.parametrize(("gathered", "invalidations", "verdict"),
                         [(110.0, 0, "pass"), (111.0, 0, "fail"), (50.0, 1, "fail")])
def test_the_verdict_needs_both_goals(gathered: float, invalidations: int, verdict: str) -> None:
    # 1.1 x a floor of 100 bytes is the most that passes; one invalidation on any rank fails whatever the bytes.
    out = summary([_rank(gathered, 100.0, 0), _rank(gathered, 100.0, invalidations)], {}, 2, Run(quick=True))
    assert out["verdict"] == verdict and out["trace_invalidations"] == invalidations
    assert out["gathered_over_floor"] == pytest.approx(gathered / 100.0) and out["trace_complete_fraction"] == 0.9
