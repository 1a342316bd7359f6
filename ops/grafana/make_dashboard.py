"""Writes ops/grafana/vapo.json, the importable Grafana dashboard (edit the PANELS table, then run this).

    .venv/bin/python -m ops.grafana.make_dashboard

Every query must return data against a real run (tests/ops/test_observability.py checks it with a real
Prometheus): counters that may not have a labelled child yet are written as ``... or vector(0)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# row title -> [(panel title, unit, [(PromQL, legend)])]
PANELS: dict[str, list[tuple[str, str, list[tuple[str, str]]]]] = {
    "Learning": [
        ("Batch reward", "percentunit", [("vapo_learner_reward_mean", "reward mean"), ("vapo_learner_positives_fraction", "positives fraction")]),
        ("Held-out accuracy", "percentunit", [("vapo_learner_eval_accuracy", "{{metric}}")]),
        ("Evaluation sets: avg@k", "percentunit", [('vapo_learner_eval_avg_at_k{data_source="all"}', "{{set}}")]),
        ("Evaluation sets: pass@k", "percentunit", [('vapo_learner_eval_pass_at_k{data_source="all"}', "{{set}}")]),
        ("Evaluation sets by data_source: avg@k", "percentunit", [('vapo_learner_eval_avg_at_k{data_source!="all"}', "{{set}} {{data_source}}")]),
        ("Evaluation sets by data_source: pass@k", "percentunit", [('vapo_learner_eval_pass_at_k{data_source!="all"}', "{{set}} {{data_source}}")]),
        ("Response length", "short", [("vapo_learner_response_length_mean", "train"), ("vapo_learner_eval_response_length", "held-out")]),
        ("Policy entropy", "short", [("vapo_learner_entropy", "entropy")]),
        ("Approx KL", "short", [("vapo_learner_approx_kl", "approx KL")]),
        ("Clip fractions", "percentunit", [("vapo_learner_clip_fraction_low", "low (1-ε_low)"), ("vapo_learner_clip_fraction_high", "high (1+ε_high)"), ("vapo_learner_clip_fraction_dual", "dual (c·A)")]),
        ("Engine/learner mismatch (same weights)", "short", [("vapo_learner_mismatch_kl", "KL(behaviour ‖ learner) per token"), ("vapo_learner_mismatch_ratio_max", "max ratio")]),
        ("Losses", "short", [("vapo_learner_policy_loss", "policy"), ("vapo_learner_nll_loss", "NLL (positives)")]),
    ],
    "Critic": [
        ("Critic loss", "short", [("vapo_learner_critic_loss", "critic loss"), ("vapo_learner_value_pretrain_loss", "value pretraining")]),
        ("Value explained variance", "short", [("vapo_learner_value_explained_variance", "RL batches"), ("vapo_learner_value_pretrain_explained_variance", "value pretraining (fresh)")]),
        ("Value mean", "short", [("vapo_learner_value_mean", "V mean")]),
        ("Length-adaptive λ (mean)", "short", [("vapo_learner_lambda_actor_mean", "λ_actor")]),
        ("Grad norms", "short", [("vapo_learner_grad_norm", "{{model}}")]),
    ],
    "Pipeline": [
        ("Actors' reward by data_source (last group)", "percentunit", [("avg by (data_source) (vapo_actor_source_reward_mean)", "{{data_source}}")]),
        ("Samples/s per actor", "short", [("sum by (actor) (rate(vapo_actor_samples_total[1m])) or sum by (actor) (vapo_actor_samples_total)", "actor {{actor}}")]),
        ("Learner tokens/s", "short", [("vapo_learner_tokens_per_second", "tokens/s"), ("vapo_learner_tokens_per_second_per_rank", "per rank"), ("vapo_learner_phase_tokens_per_second", "{{phase}}")]),
        ("Buffer depth", "short", [("vapo_buffer_depth_groups", "groups"), ("vapo_buffer_credit_outstanding", "credit outstanding")]),
        ("Staleness (mean versions)", "short", [("vapo_learner_staleness_sum / clamp_min(vapo_learner_staleness_count, 1)", "mean staleness")]),
        ("Stale drops", "short", [("vapo_buffer_stale_dropped_groups_total", "stale groups dropped"), ("sum(vapo_buffer_filtered_groups_total) or vector(0)", "filtered")]),
        ("Time waiting for data", "s", [("vapo_learner_data_wait_seconds_total", "learner wait (total)"), ("sum(vapo_actor_credit_wait_seconds_total) or vector(0)", "actors blocked on credit"), ("sum(vapo_actor_weight_wait_seconds_total) or vector(0)", "actors waiting for granted weights")]),
        ("Weight-sync latency", "s", [("sum(vapo_actor_weight_sync_seconds_sum) / clamp_min(sum(vapo_actor_weight_sync_seconds_count), 1) or vector(0)", "mean publish → serving")]),
        ("Step time by phase", "s", [("vapo_learner_phase_seconds", "{{phase}}")]),
        ("Learner MFU by phase (CPU: of a measured matmul ceiling)", "percentunit", [("vapo_learner_mfu", "{{phase}}")]),
        ("Learner model TFLOP/s per rank by phase", "short", [("vapo_learner_tflops_per_rank", "{{phase}}")]),
        ("Weight sync by phase: learner (mean)", "s", [("sum by (phase, transport) (vapo_learner_weight_sync_phase_seconds_sum) / clamp_min(sum by (phase, transport) (vapo_learner_weight_sync_phase_seconds_count), 1) or vector(0)", "{{transport}} {{phase}}")]),
        ("Weight sync by phase: engines (mean)", "s", [("sum by (phase, transport) (vapo_actor_weight_sync_phase_seconds_sum) / clamp_min(sum by (phase, transport) (vapo_actor_weight_sync_phase_seconds_count), 1) or vector(0)", "{{transport}} {{phase}}")]),
        ("Distributed weight pushes", "short", [("sum by (outcome) (vapo_learner_weight_pushes_total) or vector(0)", "{{outcome}}"), ("vapo_learner_weight_push_members", "engines in the group")]),
    ],
    "Health": [
        ("Seconds since last learner step", "s", [("time() - vapo_learner_last_step_timestamp_seconds", "last-step age")]),
        ("Weight version", "short", [("vapo_learner_weight_version", "learner"), ("vapo_actor_weight_version", "actor {{actor}}")]),
        ("Engine restarts", "short", [("sum(vapo_actor_engine_restarts_total) or vector(0)", "engine restarts"), ("sum(vapo_launcher_component_restarts_total) or vector(0)", "component restarts")]),
        ("Engines (elastic)", "short", [("vapo_launcher_engines_alive", "alive"), ("vapo_launcher_engines_planned", "planned"), ("sum(vapo_launcher_hosts_lost_total) or vector(0)", "hosts lost"), ("sum(vapo_launcher_hosts_rejoined_total) or vector(0)", "hosts rejoined"), ("sum(vapo_launcher_components_given_up_total) or vector(0)", "given up"), ("vapo_launcher_groups_dropped_lost_host_total", "groups dropped with a lost host")]),
        ("Automatic resumes", "short", [("vapo_launcher_auto_resumes_total", "resumes"), ("vapo_launcher_resume_lost_seconds_total", "seconds lost")]),
        ("Rejected frames", "short", [("sum by (reason) (vapo_buffer_rejected_frames_total) or vector(0)", "{{reason}}")]),
    ],
}


def build() -> dict:
    panels = []
    pid = 1
    y = 0
    for row, items in PANELS.items():
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (title, unit, targets) in enumerate(items):
            panels.append({
                "type": "timeseries",
                "title": title,
                "id": pid,
                "datasource": DS,
                "gridPos": {"h": 7, "w": 8, "x": 8 * (i % 3), "y": y + 7 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + k)} for k, (expr, legend) in enumerate(targets)],
            })
            pid += 1
        y += 7 * ((len(items) + 2) // 3)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": "vapo",
        "uid": "vapo-main",
        "tags": ["vapo", "rl"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "panels": panels,
    }


def main() -> int:
    out = Path(__file__).with_name("vapo.json")
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
