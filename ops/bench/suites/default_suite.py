"""The default task's experiment suite, run by ``ops/bench/suites/experiments.py``: VAPO against vanilla PPO, GRPO
and DAPO at the same sample budget, VAPO with each component removed, async against synchronous training,
the staleness sweep and an α sweep (the other suites, ``*_suite.py``, list their runs with this
``Experiment``)."""

from __future__ import annotations

from dataclasses import dataclass

FULL_STEPS = 60   # the default's budget: 60 steps x 32 prompts x G=8 = 15,360 samples
SHORT_STEPS = 40  # ablations and sweeps (1 seed): 10,240 samples, compared with VAPO at the same samples
# The critic default.yaml and long.yaml shipped before the paper-trained, frozen-base one became their default
# (docs/CRITIC.md): every suite's records were measured on it, so its runs keep it, and a rerun or a missing
# seed measures what the records say. An arm's own overrides come after, and win.
SHIPPED_CRITIC = ("learner.critic_lr=1e-5", "learner.value_head_lr_scale=1000", "learner.critic_updates=0",
                  "learner.critic_warmup_steps=0", "learner.value_head_surprise_source=critic_head",
                  "value_pretrain.lr=1e-5", "value_pretrain.steps=10", "value_pretrain.patience=5",
                  "value_pretrain.pool_groups=0", "value_pretrain.allow_untrained_critic=true")
PINNED_CONFIGS = frozenset(("ops/configs/default.yaml", "ops/configs/long.yaml"))


@dataclass(frozen=True)
class Experiment:
    name: str
    group: str              # baselines | ablations | staleness | alpha
    label: str              # what the row is, for the report
    config: str = "ops/configs/default.yaml"
    overrides: tuple[str, ...] = ()  # what sets the arm apart (the report prints these)
    seeds: tuple[int, ...] = (0,)
    steps: int = FULL_STEPS

    @property
    def launch_overrides(self) -> tuple[str, ...]:
        """What the run is launched with: on default.yaml and long.yaml ``SHIPPED_CRITIC`` first, then
        ``overrides``."""
        return (*SHIPPED_CRITIC, *self.overrides) if self.config in PINNED_CONFIGS else self.overrides


SEEDS3 = (0, 1, 2)
SUITE: tuple[Experiment, ...] = (
    Experiment("vapo", "baselines", "VAPO (near-frozen critic)", seeds=SEEDS3),
    Experiment("stale0", "staleness", "VAPO, synchronous (buffer.max_staleness=0)",
               overrides=("buffer.max_staleness=0",), steps=SHORT_STEPS),
    Experiment("stale2", "staleness", "VAPO, buffer.max_staleness=2",
               overrides=("buffer.max_staleness=2",), steps=SHORT_STEPS),
    Experiment("stale4", "staleness", "VAPO, buffer.max_staleness=4",
               overrides=("buffer.max_staleness=4",), steps=SHORT_STEPS),
    Experiment("grpo", "baselines", "GRPO", "ops/configs/grpo.yaml", seeds=SEEDS3),
    Experiment("dapo", "baselines", "DAPO", "ops/configs/dapo.yaml", seeds=SEEDS3),
    Experiment("ppo", "baselines", "vanilla PPO", "ops/configs/ppo.yaml", seeds=SEEDS3),
    Experiment("no_value_pretrain", "ablations", "VAPO − value pretraining",
               overrides=("value_pretrain.enabled=false",), steps=SHORT_STEPS),
    Experiment("no_decoupled_gae", "ablations", "VAPO − decoupled GAE (critic λ = actor's length-adaptive λ)",
               overrides=("algo.decoupled_gae=false",), steps=SHORT_STEPS),
    Experiment("no_length_adaptive", "ablations", "VAPO − length-adaptive λ (λ_actor = 0.95)",
               overrides=("algo.length_adaptive=false",), steps=SHORT_STEPS),
    Experiment("no_clip_higher", "ablations", "VAPO − clip-higher (ε_high = 0.2)",
               overrides=("algo.clip_high=0.2",), steps=SHORT_STEPS),
    Experiment("no_token_level", "ablations", "VAPO − token-level loss (sequence mean)",
               overrides=("algo.loss_agg=seq_mean",), steps=SHORT_STEPS),
    Experiment("no_nll", "ablations", "VAPO − positive-example NLL",
               overrides=("nll.coef=0",), steps=SHORT_STEPS),
    Experiment("no_group_sampling", "ablations", "VAPO − group sampling (256 prompts × G=1)",
               overrides=("actors.group_size=1", "learner.batch_groups=256", "value_pretrain.batch_groups=256",
                          "value_pretrain.eval_groups=256"), steps=SHORT_STEPS),
    Experiment("plus_dynamic_sampling", "ablations", "VAPO + dynamic sampling (DAPO's uniform-group filter)",
               overrides=("buffer.filter_uniform_groups=true",), steps=SHORT_STEPS),
    Experiment("stale4_decoupled", "staleness", "VAPO, buffer.max_staleness=4, AReaL's decoupled PPO objective",
               overrides=("buffer.max_staleness=4", "learner.off_policy=decoupled"), steps=SHORT_STEPS),
    Experiment("grpo_sync", "staleness", "GRPO, synchronous (buffer.max_staleness=0)", "ops/configs/grpo.yaml",
               overrides=("buffer.max_staleness=0",), steps=SHORT_STEPS),
    Experiment("alpha0.3", "alpha", "VAPO, α = 0.3", overrides=("algo.alpha=0.3",), steps=SHORT_STEPS),
    Experiment("alpha3", "alpha", "VAPO, α = 3", overrides=("algo.alpha=3.0",), steps=SHORT_STEPS),
)
BY_NAME = {e.name: e for e in SUITE}


def run_name(e: Experiment, seed: int) -> str:
    return f"{e.name}-s{seed}"


# A group of the suite with no run under the report's root (the re-measurement from the shipped bases runs
# the baselines only) gets this pointer instead of a table of "not run yet" rows.
EARLIER = ("Not re-measured from the shipped bases: the earlier tables (from bases bootstrapped on a machine "
           "whose details were not recorded) are in [results/earlier.md](results/earlier.md).")


def group_ran(runs: dict[str, list], group: str) -> bool:
    """Whether any experiment of ``group`` (its own runs, not VAPO's reference) has a finished run."""
    return any(runs.get(e.name) for e in SUITE if e.group == group)

