"""The one config tree of vapo: dataclasses, YAML + dotted overrides, strict validation.

Every process loads the same tree:

    cfg = load_config("ops/configs/default.yaml", ["learner.total_steps=50", "run.seed=1"])

Unknown keys and values of the wrong type are errors that name the dotted key. The resolved config is
written into the run directory (``save_config``) and can be loaded back unchanged.

``python -m common.config [config.yaml] [key=value ...]`` prints the resolved tree; ``--help`` lists every
field with its documentation.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


def f(default: Any, doc: str) -> Any:
    """A documented dataclass field (the doc shows in ``--help`` and error messages)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def sub(cls: type, doc: str) -> Any:
    """A documented nested section."""
    return field(default_factory=cls, metadata={"doc": doc})


# --------------------------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    name: str = f("default", "run name; everything the run writes goes to <root>/<name>/")
    root: str = f("runs", "parent directory of run directories (relative to the repo root or absolute)")
    seed: int = f(0, "global seed (task sampling, model init, sampling RNGs)")
    device: str = f("cpu", "compute device for rollout engines and learner: cpu | cuda")
    max_wall_seconds: float = f(0.0, "stop the run after this many seconds of RL (0 = no limit)")
    log_level: str = f("INFO", "Python logging level for every process")


@dataclass
class TaskConfig:
    name: str = f("addition", "task: addition | chain | reasoning_gym:<generator> | jsonl:<path>")
    min_digits: int = f(1, "addition: fewest digits per operand")
    max_digits: int = f(6, "addition: most digits per operand (response length grows with digits)")
    min_steps: int = f(5, "chain: fewest steps (a response has 9 tokens per step + 4)")
    max_steps: int = f(44, "chain: most steps (steps are drawn log-uniformly, so long responses are a tail)")
    eval_buckets: int = f(10, "held-out split = operands whose hash falls in bucket 0 of this many")
    eval_size: int = f(256, "number of held-out prompts used for evaluation")
    train_size: int = f(0, "reasoning_gym/jsonl: number of training items (0 = generator/file default)")
    reward_min: float = f(0.0, "lowest reward the task's verifier gives: the buffer refuses a group below it, the learner drops such a row")
    reward_max: float = f(1.0, "highest reward the task's verifier gives: the buffer refuses a group above it, the learner drops such a row")
    seed: int = f(1234, "task seed (fixed so the held-out split is the same across runs)")


@dataclass
class BootstrapConfig:
    hidden_size: int = f(128, "tiny Qwen2 hidden size")
    num_layers: int = f(3, "tiny Qwen2 decoder layers")
    num_heads: int = f(4, "attention heads")
    num_kv_heads: int = f(2, "key/value heads (GQA)")
    intermediate_size: int = f(384, "MLP width")
    max_position_embeddings: int = f(256, "longest prompt + response the model supports")
    teacher_error_rate: float = f(0.12, "probability that a teacher trace makes a wrong column sum (RL room)")
    seconds: float = f(1200.0, "SFT wall-clock safety cap in seconds (hitting it makes the result machine-dependent)")
    max_steps: int = f(800, "SFT steps; the run stops here (deterministic) unless the seconds cap comes first")
    batch_size: int = f(64, "SFT batch size (sequences)")
    lr: float = f(3e-3, "SFT peak learning rate")
    threads: int = f(2, "torch threads for SFT (part of the determinism key: results differ per thread count)")
    seed: int = f(0, "SFT seed (model init, teacher errors); the base model does not depend on run.seed")
    warmup_fraction: float = f(0.05, "fraction of max_steps with linear lr warmup")
    min_lr_ratio: float = f(0.1, "cosine decay floor as a fraction of lr")
    weight_decay: float = f(0.01, "AdamW weight decay")
    eval_k: int = f(8, "samples per held-out prompt for the closing evaluation (0 = skip it)")
    log_every_s: float = f(10.0, "seconds between progress lines")
    length_group: int = f(1, "SFT batches sorted by length together (less padding, but slows learning here; 1 = off)")


@dataclass
class ModelConfig:
    path: str = f("ops/bases/addition-tiny", "HF model dir of the base policy (shipped: ops/bases/*, checked against its manifest.json); built by learner.sft if missing")
    rebuild: bool = f(False, "ops/launch.sh: rebuild model.path with learner.sft even when it exists (replaces it and its manifest; a modified shipped base is refused without this)")
    dtype: str = f("float32", "parameter dtype for engines and learner: float32 | bfloat16 | float16")
    bootstrap: BootstrapConfig = sub(BootstrapConfig, "how learner.sft builds the embedded base policy")


@dataclass
class EngineConfig:
    kind: str = f("rollout_server", "engine: rollout_server (CPU/CUDA, ours) | sglang (GPU) | external")
    urls: list[str] = f([], "kind=external: engine base URLs to use as given (one actor each)")
    host: str = f("127.0.0.1", "bind address of engines started by vapo (non-loopback needs engine.bind_protection)")
    bind_protection: str = f("", "non-loopback engine.host only: how its unauthenticated control API port is protected: firewall | private_network | auth_proxy (empty = refuse such binds)")
    base_port: int = f(30000, "first engine port; engine i listens on base_port + i")
    max_batch_size: int = f(256, "rollout_server: most sequences decoded together")
    batch_wait_ms: float = f(2.0, "rollout_server: how long to gather concurrent requests into a batch")
    threads: int = f(1, "rollout_server: torch threads per engine process")
    context_length: int = f(0, "rollout_server: longest prompt + response per sequence (0 = model max_position_embeddings)")
    logprobs: str = f("original", "rollout_server: original = log_softmax(logits) as the learner computes | scaled = by 1/T (SGLang default)")
    startup_timeout_s: float = f(600.0, "seconds to wait for an engine to load and answer /health; SGLang loading a 32B checkpoint (plus CUDA graphs) takes minutes: allow ~60 s + 30 s per 10 GB of weights")
    max_restarts: int = f(3, "restarts of a dead engine before the actor gives up")
    health_interval_s: float = f(10.0, "seconds between the starts of an actor's /health probes of its engine (/model_info while it updates the engine's weights); a hung engine is found within health_failures x health_interval_s + health_timeout_s")
    health_timeout_s: float = f(30.0, "one /health probe's deadline; SGLang 0.5.23 runs a one-token generation for /health and gives up after 20 s")
    health_failures: int = f(3, "consecutive failed /health probes after which the engine counts as dead: restarted (rollout_server) or waited for")
    weight_load_timeout_s: float = f(600.0, "rollout_server: reading and checking a checkpoint for /update_weights_from_disk must finish within this; the actor gives an update request this + health_timeout_s")
    admin_api_key_file: str = f("", "kind=sglang|external: file holding the engines' admin API key (SGLang --admin-api-key; the SGLang engines vapo starts get it through --config <file>.sglang.yaml), sent as a Bearer token on control requests; rollout_server engines get a fresh key per worker instead")
    imitate_sglang: bool = f(False, "rollout_server test mode: behave as real SGLang 0.5.23 (slow /health blocking while paused or loading, 400 after a load whose cache flush is refused, /model_info, meta_info.weight_versions)")
    sglang_mem_fraction_static: float = f(0.8, "sglang: --mem-fraction-static")
    sglang_tp_size: int = f(1, "sglang: --tp-size")
    sglang_extra_args: list[str] = f([], "sglang: extra command-line arguments for sglang.launch_server")


@dataclass
class ActorsConfig:
    num_actors: int = f(1, "rollout workers (each bound to one engine)")
    group_size: int = f(8, "G: samples per prompt")
    prompts_in_flight: int = f(16, "prompts each worker keeps outstanding at its engine")
    temperature: float = f(1.0, "sampling temperature")
    top_p: float = f(1.0, "nucleus sampling p")
    top_k: int = f(-1, "top-k sampling (-1 = off)")
    max_new_tokens: int = f(96, "response token limit")
    weight_sync: str = f("wait", "in-flight requests on a disk weight update: wait (finish on old weights) | abort")
    push_pause: str = f("in_place", "in-flight requests during a distributed push (learner.weight_transport=distributed): in_place (paused with their KV cache, continue on the new weights; their tokens carry each span's version) | retract (re-queued, recomputed) | abort | none (SGLang then drains before each bucket)")
    send_timeout_s: float = f(10.0, "seconds before an unacknowledged group is re-sent with the same group_id")
    metrics_base_port: int = f(9300, "actor i serves /metrics on metrics_base_port + i (0 = any free port)")
    max_prompts: int = f(0, "stop each worker after this many of its prompts, counted across restarts (0 = run until stopped)")
    weight_poll_s: float = f(5.0, "seconds between WeightQuery polls (catches a WeightUpdate the PUB socket dropped)")
    weight_wait_s: float = f(30.0, "longest a granted prompt waits for the engine to serve the grant's announced learner version (0 = never wait)")
    weight_query_timeout_s: float = f(2.0, "seconds to wait for the learner's WeightQuery answer (none = keep current weights)")
    generate_timeout_s: float = f(0.0, "seconds before a /generate call is abandoned and the prompt resubmitted (0 = auto: generate_timeout_base_s + max_new_tokens / min_tokens_per_s)")
    generate_timeout_base_s: float = f(120.0, "generate_timeout_s = 0: the fixed part (queueing, prefill)")
    min_tokens_per_s: float = f(5.0, "generate_timeout_s = 0: the slowest decode rate per sequence still counted as progress")
    verify_tensors: bool = f(True, "before loading published weights, check that every tensor of model.path is present with its shape and finite (reads the weights once)")
    max_worker_restarts: int = f(3, "python -m actors without --actor-id: restarts of a crashed worker process")


@dataclass
class CurveConfig:
    keys_dir: str = f("", "directory of the run's CurveZMQ keys (server.key[_secret], <role>.key_secret, authorized_clients/); the launcher writes <run dir>/keys and sets this when no key below is named")
    server_secret_key: str = f("", "path to the server's CurveZMQ secret key file (default: keys_dir/server.key_secret)")
    server_public_key: str = f("", "path to the server's public key, which clients need (default: keys_dir/server.key)")
    client_secret_key: str = f("", "path to this client's secret key file (default: keys_dir/<role>.key_secret)")
    authorized_clients_dir: str = f("", "directory of allowed client public keys, each named for its role: actor*.key, learner*.key, monitor*.key (default: keys_dir/authorized_clients)")


@dataclass
class BufferConfig:
    path: str = f("", "LMDB directory (empty = <run dir>/buffer on one host; across several placement.hosts <local_root>/<run name>/buffer)")
    local_root: str = f("/var/tmp/vapo", "a run across several hosts keeps its LMDB buffer under <local_root>/<run name>/buffer on host 0, off the shared filesystem that holds runs/ (LMDB's memory map and locks are unsafe on NFS and similar)")
    ingest_addr: str = f("tcp://127.0.0.1:5555", "ROUTER address where actors send groups")
    serve_addr: str = f("tcp://127.0.0.1:5556", "address of the buffer's ROUTER socket (REQ/REP envelope) where the learner asks for batches")
    max_staleness: int = f(1, "serve only groups with weight_version >= learner version - max_staleness (0 = sync)")
    capacity_groups: int = f(4096, "most groups held before admission stops")
    capacity_bytes: int = f(8 << 30, "most bytes of group data held before admission stops")
    positives_capacity: int = f(20000, "verified-correct samples kept for NLL replay (oldest evicted)")
    filter_uniform_groups: bool = f(False, "drop groups whose rewards are all equal (DAPO dynamic sampling)")
    max_frame_bytes: int = f(64 << 20, "largest accepted wire frame")
    map_size_bytes: int = f(1 << 30, "initial LMDB map size (grows automatically)")
    commit_batch: int = f(64, "most groups written in one LMDB transaction")
    max_map_size_bytes: int = f(0, "LMDB map size ceiling; past it writes fail as storage errors (0 = free disk)")
    positive_reward: float = f(1.0, "samples with reward >= this are verified-correct positives, for every role: the buffer's positives store, the learner's NLL mask, replay count and positives_fraction, the actors' positives_rate")
    credit_ttl_s: float = f(600.0, "seconds after which a granted, unused credit stops counting as in flight")
    max_credit_per_actor: int = f(0, "most credit one actor id may hold (granted, unused); 0 = 2 x actors.prompts_in_flight")
    max_credit_per_connection: int = f(0, "most credit the actor ids of one ingest connection may hold together; 0 = max_credit_per_actor")
    max_batch_groups: int = f(1024, "largest BatchRequest.n_groups accepted (also at most capacity_groups)")
    max_batch_wait_s: float = f(300.0, "longest BatchRequest.timeout_ms accepted, in seconds (the learner asks in shorter waits)")
    learner_version_max_step: int = f(2, "a BatchRequest may raise the learner version at most this far past that of the last full batch served (2: a learner resumed past published weights republishes its checkpoint under one more version)")
    vocab_size: int = f(0, "token ids at ingest must be below this (0 = vocab_size from model.path's config.json; no check when that is missing)")
    metrics_port: int = f(9200, "buffer /metrics port")
    curve: CurveConfig = sub(CurveConfig, "CurveZMQ keys: every client of a launched run authenticates with the key of its role")


@dataclass
class LearnerConfig:
    batch_groups: int = f(32, "prompts (groups) per learner step")
    total_steps: int = f(60, "learner steps (weight versions) to run")
    ppo_epochs: int = f(1, "passes over each batch")
    mini_batches: int = f(2, "optimizer steps per epoch (batch split into this many mini-batches)")
    micro_batch_size: int = f(64, "sequences per forward/backward (gradient accumulation inside a mini-batch)")
    micro_batch_tokens: int = f(0, "token budget per micro-batch: rows x longest prompt+response <= this (0 = rows only, micro_batch_size)")
    logits_chunk_elements: int = f(1 << 24, "policy log-probs: LM head over chunks of this many tokens x vocab elements, recomputed in backward (0 = full [B, S, vocab] logits)")
    activation_checkpointing: bool = f(False, "recompute the policy's and critic's transformer layers in backward (non-reentrant): less memory, ~1/3 more compute")
    actor_lr: float = f(1e-4, "policy learning rate")
    critic_lr: float = f(2e-4, "critic learning rate")
    warmup_steps: int = f(0, "linear lr warmup (optimizer steps) for the policy")
    critic_warmup_steps: int = f(0, "linear lr warmup (optimizer steps) for the critic")
    weight_decay: float = f(0.0, "AdamW weight decay")
    grad_clip: float = f(1.0, "gradient norm clip (0 = off)")
    zero_stage: int = f(0, "DeepSpeed ZeRO stage 0-3")
    precision: str = f("fp32", "fp32 | bf16 | fp16 (values and GAE are always fp32)")
    off_policy: str = f("behaviour", "the PPO ratio's π_old: behaviour (engine logprobs) | decoupled (AReaL: recomputed, masked behaviour weight) | rollout_correction (verl: recomputed, truncated behaviour weight)")
    decoupled_weight_cap: float = f(5.0, "decoupled: tokens whose behaviour importance weight π_prox/π_behav exceeds this are masked out of the policy loss (AReaL)")
    rollout_correction_level: str = f("token", "rollout_correction: importance weight per token | sequence (product over the response)")
    rollout_correction_cap: float = f(2.0, "rollout_correction: the importance weight is truncated at this (verl's threshold)")
    value_head_init_std: float = f(0.0, "std of the value head's weight init (0 = zeros, output starts at bias)")
    value_head_init_bias: float = f(0.5, "initial value head bias (prior mean reward)")
    value_head_lr_scale: float = f(1.0, "the critic's surprise MLP (value_head_surprise) trains at this multiple of the critic lr")
    value_head_surprise: bool = f(False, "critic adds an MLP over the response's token logprobs under its own LM head (latest and running minimum): sees the first unlikely token")
    publish_addr: str = f("tcp://127.0.0.1:5557", "PUB address for WeightUpdate")
    query_addr: str = f("tcp://127.0.0.1:5558", "REP address where late subscribers ask for the latest weights")
    weights_every: int = f(1, "publish weights every N steps")
    keep_weights: int = f(3, "newest weight versions kept on disk")
    weight_transport: str = f("disk", "how a new version reaches the engines: disk (safetensors under <run dir>/weights, each engine loads them: /update_weights_from_disk) | distributed (rank 0 broadcasts flattened buckets to the engines' weight-update group: /update_weights_from_distributed; the disk version is then written in the background, for restarts and engines that missed a push)")
    bucket_bytes: int = f(512 << 20, "weight_transport=distributed: most bytes gathered and broadcast at a time (one /update_weights_from_distributed call each)")
    push_addr: str = f("tcp://127.0.0.1:5559", "weight_transport=distributed: ROUTER address where actors join the weight-update group and report each push")
    push_master_address: str = f("127.0.0.1", "weight_transport=distributed: address the engines reach learner rank 0's group store and broadcasts at (learner rank 0's host on the engines' network)")
    push_master_port: int = f(0, "weight_transport=distributed: port of the group store (0 = a free one, sent to the engines)")
    push_backend: str = f("auto", "weight_transport=distributed: the group's backend: gloo | nccl | auto (nccl when run.device is cuda)")
    push_timeout_s: float = f(60.0, "weight_transport=distributed: longest a group join or one bucket's broadcast waits for the engines; past it the group is dropped, that version reaches the engines from disk, and the group is rebuilt at the next version with the engines that answered")
    checkpoint_every: int = f(10, "full checkpoint (policy + critic + optimizers + cursors) every N steps")
    keep_checkpoints: int = f(2, "newest checkpoints kept")
    resume: str = f("auto", "auto (newest complete checkpoint) | never | <checkpoint path>")
    eval_every: int = f(10, "held-out evaluation every N steps (0 = off)")
    eval_k: int = f(8, "samples per held-out prompt for avg@k")
    eval_via: str = f("auto", "held-out evaluation runs: local (in the learner process, between steps; one rank only) | engine (on rollout engines once they serve the published weights, in a background thread of rank 0 while training goes on) | auto (local for a one-process CPU learner, else engine)")
    eval_engine_url: str = f("", "eval_via=engine: one engine's base URL (empty: see eval_engine_urls)")
    eval_engine_urls: list[str] = f([], "eval_via=engine: engines the held-out prompts are dealt to, round-robin (empty = eval_engine_url alone if set, else engine.urls for external engines, else every engine of a one-host run, else engine 0)")
    eval_timeout_s: float = f(0.0, "eval_via=engine: longest one evaluation may take (0 = no overall limit: each request gets the actors' generate timeout, each engine engine.weight_load_timeout_s + engine.health_timeout_s to serve the weights); a failed evaluation is recorded and training goes on")
    batch_timeout_s: float = f(600.0, "seconds to wait for a batch before failing")
    dist_timeout_s: float = f(1800.0, "torch.distributed timeout of a multi-rank learner: a rank silent this long (lost host, hung peer) fails the run; rank 0's long waits (batch, evaluation) do not count, the other ranks hear from it every min(30 s, a quarter of this)")
    metrics_port: int = f(9100, "learner /metrics port")
    threads: int = f(2, "torch threads of the learner process")


@dataclass
class AlgoConfig:
    advantage: str = f("gae", "advantage estimator: gae (critic) | grpo (group-normalised, no critic)")
    gamma: float = f(1.0, "discount γ")
    lambda_critic: float = f(1.0, "λ for critic targets (decoupled GAE: 1.0 = Monte-Carlo)")
    decoupled_gae: bool = f(True, "critic targets use lambda_critic; false (ablation): the actor's λ, as in plain PPO")
    lambda_actor: float = f(0.95, "λ for policy advantages when length_adaptive is off")
    length_adaptive: bool = f(True, "policy λ = 1 - 1/(alpha * response length), per sample")
    alpha: float = f(0.05, "length-adaptive λ coefficient α (paper 0.05)")
    clip_low: float = f(0.2, "ε_low: ratio lower clip 1 - ε_low")
    clip_high: float = f(0.28, "ε_high: ratio upper clip 1 + ε_high (clip-higher)")
    loss_agg: str = f("token_mean", "policy loss aggregation: token_mean | seq_mean")
    value_clip: float = f(0.0, "value clipping range around old values (0 = off)")
    whiten_advantages: bool = f(True, "normalise advantages to zero mean, unit std over the batch's tokens")
    entropy_coef: float = f(0.0, "entropy bonus coefficient")
    grpo_std_normalize: bool = f(True, "grpo: divide group-centred rewards by the group std")
    overlong_buffer: int = f(0, "DAPO soft overlong punishment: L_cache, the penalty ramps over the last N tokens before overlong_max_length (0 = off)")
    overlong_penalty: float = f(1.0, "DAPO soft overlong punishment: the penalty at and past overlong_max_length")
    overlong_max_length: int = f(0, "DAPO soft overlong punishment: L_max, the length at which the penalty is full (0 = actors.max_new_tokens)")
    truncated: str = f("zero_reward", "responses cut at actors.max_new_tokens: keep (verifier reward) | mask (no policy or value loss, DAPO overlong filtering) | zero_reward (reward 0); never NLL positives")
    clip_ratio_c: float = f(3.0, "dual clip: for A < 0 the policy objective is at least c·A, bounding a huge ratio's gradient (0 = off; else > 1)")
    actor_values: str = f("post_update", "values for the actor's advantages: post_update (critic after its update) | pre_update (one value pass before the critic update, verl's order)")


@dataclass
class ValuePretrainConfig:
    enabled: bool = f(True, "fit the critic before RL with the policy frozen")
    steps: int = f(50, "most critic updates")
    batch_groups: int = f(32, "groups per value-pretraining step")
    lr: float = f(5e-4, "critic lr during value pretraining")
    patience: int = f(10, "stop when explained variance has not improved for this many steps")
    min_explained_variance: float = f(0.0, "warn (and record) when the final explained variance is below this")
    eval_groups: int = f(32, "fresh groups held out to measure explained variance")


@dataclass
class NLLConfig:
    coef: float = f(0.1, "μ: weight of the positive-example NLL loss")
    replay_fraction: float = f(0.0, "extra stored positives per batch positive (0 = batch positives only)")


@dataclass
class PlacementConfig:
    hosts: list[str] = f(["localhost"], "hosts of the run in order; host 0 runs the launcher, the buffer and learner rank 0")
    gpus_per_host: int = f(8, "GPUs on every host (global GPU g is host g // gpus_per_host, local GPU g % gpus_per_host); run.device=cpu across hosts: process slots per host")
    engine_gpus: str = f("", "global GPUs of the engines, e.g. '0-3' or '0,2'; engine i takes the next engine.sglang_tp_size of them (run.device=cpu across hosts: slots, which only say the host; empty on one CPU host)")
    learner_gpus: str = f("", "global GPUs of the learner, one DeepSpeed rank each, e.g. '4-7' (run.device=cpu across hosts: slots, one CPU rank each; empty on one CPU host)")
    share_gpus: bool = f(False, "allow an engine and a learner rank on the same GPU (one-GPU configs); off = refuse overlaps")
    remote: str = f("ssh", "how processes start on hosts other than host 0: ssh (DeepSpeed's pdsh launcher for the learner) | srun (inside a Slurm allocation)")
    store_protection: str = f("", "a learner on several hosts: how placement.master_port (torch.distributed's store, every interface, no authentication) is protected: firewall | private_network (empty = refuse such a learner)")
    master_port: int = f(29500, "a learner on several hosts: torch.distributed's rendezvous port on host 0 (ranks on one host meet in a file; one rank needs neither)")
    master_addr: str = f("", "a learner on several hosts: host 0's address the other ranks reach its store at (empty = the name hosts[0])")
    ssh_args: str = f("", "extra options of every ssh to another host and of pdsh's (e.g. '-F /path/ssh_config'); $VAPO_SSH_ARGS adds more")
    ssh_connect_timeout_s: int = f(10, "ssh ConnectTimeout: a host that does not answer within this fails the start")
    ssh_alive_interval_s: int = f(5, "ssh ServerAliveInterval and the launcher's heartbeat period to processes it started over ssh")
    ssh_alive_count_max: int = f(3, "ssh ServerAliveCountMax: a link silent for interval x this is lost; the launcher stops the run, the remote process stops itself")
    srun_cpus_per_task: int = f(0, "placement.remote=srun: CPUs of each srun'd engine/actor step, learner steps split them over their ranks per host (0 = $SLURM_CPUS_ON_NODE; srun's own default is one)")
    gpu_memory_gib: float = f(80.0, "memory of one GPU; the launcher refuses a placement whose estimated model states do not fit")
    gpu_peak_tflops: float = f(989.0, "balance estimate (--dry-run): dense bf16 peak TFLOP/s of one GPU (H100/H800 SXM 989, A100 312)")
    learner_utilization: float = f(0.35, "balance estimate: fraction of peak the learner's training reaches (ZeRO-3 with activation checkpointing: ~0.3-0.4)")
    engine_utilization: float = f(0.12, "balance estimate: fraction of peak an engine's generation reaches (decoding is memory-bound: ~0.1-0.15)")
    est_prompt_tokens: int = f(256, "balance estimate: mean prompt length in tokens")
    est_response_tokens: int = f(0, "balance estimate: mean response length in tokens (0 = half of actors.max_new_tokens)")
    learner_memory_fraction: float = f(0.6, "share of a learner GPU that model states (weights, grads, Adam) may take; the rest is activations")


@dataclass
class MetricsConfig:
    host: str = f("127.0.0.1", "address every /metrics server binds to (non-loopback needs metrics.bind_protection)")
    bind_protection: str = f("", "non-loopback metrics.host only: how the unauthenticated /metrics ports are protected (they show run names, paths, rates and versions): firewall | private_network | auth_proxy (empty = refuse such binds)")
    jsonl: bool = f(True, "append learner metrics to <run dir>/metrics.jsonl")
    prometheus: bool = f(True, "serve Prometheus /metrics in every process")
    plots: bool = f(True, "write PNG plots to <run dir>/plots at the end")
    launcher_port: int = f(9400, "ops/launch.sh /metrics port (component restarts)")
    final_scrape_wait_s: float = f(20.0, "a scraped learner waits up to this long for one last scrape before exiting (0 = never)")


@dataclass
class Config:
    run: RunConfig = sub(RunConfig, "run identity and global settings")
    task: TaskConfig = sub(TaskConfig, "task registry: prompts and verifier")
    model: ModelConfig = sub(ModelConfig, "base policy")
    engine: EngineConfig = sub(EngineConfig, "rollout engines (SGLang or rollout_server)")
    actors: ActorsConfig = sub(ActorsConfig, "rollout workers")
    buffer: BufferConfig = sub(BufferConfig, "durable replay buffer")
    learner: LearnerConfig = sub(LearnerConfig, "DeepSpeed learner")
    algo: AlgoConfig = sub(AlgoConfig, "VAPO algorithm terms")
    value_pretrain: ValuePretrainConfig = sub(ValuePretrainConfig, "value pretraining before RL")
    nll: NLLConfig = sub(NLLConfig, "positive-example NLL loss")
    metrics: MetricsConfig = sub(MetricsConfig, "observability")
    placement: PlacementConfig = sub(PlacementConfig, "which hosts and GPUs (CPU: slots) run engines and learner ranks")

    @property
    def run_dir(self) -> Path:
        return Path(self.run.root) / self.run.name

    @property
    def buffer_path(self) -> Path:
        if self.buffer.path:
            return Path(self.buffer.path)
        if len(self.placement.hosts) > 1:  # runs/ is then on a network filesystem every host mounts
            return Path(self.buffer.local_root) / self.run.name / "buffer"
        return self.run_dir / "buffer"


_CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("cpu", "cuda"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "engine.kind": ("rollout_server", "sglang", "external"),
    "engine.logprobs": ("original", "scaled"),
    "engine.bind_protection": ("", "firewall", "private_network", "auth_proxy"),
    "metrics.bind_protection": ("", "firewall", "private_network", "auth_proxy"),
    "actors.weight_sync": ("wait", "abort"),
    "actors.push_pause": ("in_place", "retract", "abort", "none"),
    "learner.weight_transport": ("disk", "distributed"),
    "learner.push_backend": ("auto", "gloo", "nccl"),
    "learner.precision": ("fp32", "bf16", "fp16"),
    "learner.off_policy": ("behaviour", "decoupled", "rollout_correction"),
    "learner.rollout_correction_level": ("token", "sequence"),
    "algo.truncated": ("keep", "mask", "zero_reward"),
    "algo.actor_values": ("post_update", "pre_update"),
    "learner.eval_via": ("auto", "local", "engine"),
    "algo.advantage": ("gae", "grpo"),
    "algo.loss_agg": ("token_mean", "seq_mean"),
    "placement.remote": ("ssh", "srun"),
    "placement.store_protection": ("", "firewall", "private_network"),
}


Check = tuple[str, bool, str]  # (dotted key, holds, why not)


def _validate(cfg: Config) -> None:
    """The first broken rule as a ConfigError: choices first, then the checks in declaration order."""
    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    checks = [*_actor_engine_checks(cfg), *_buffer_checks(cfg), *_learner_algo_checks(cfg), *_placement_task_checks(cfg)]
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"{key}: {why}")


def _actor_engine_checks(cfg: Config) -> list[Check]:
    from common.security import is_loopback_host  # one definition of "loopback" for every bind rule

    return [
        ("actors.group_size", cfg.actors.group_size >= 1, "must be >= 1"),
        ("actors.num_actors", cfg.actors.num_actors >= 1, "must be >= 1"),
        ("actors.max_new_tokens", cfg.actors.max_new_tokens >= 1, "must be >= 1"),
        ("actors.temperature", cfg.actors.temperature >= 0, "must be >= 0"),
        ("actors.top_p", 0 < cfg.actors.top_p <= 1, "must be in (0, 1]"),
        ("actors.prompts_in_flight", cfg.actors.prompts_in_flight >= 1, "must be >= 1"),
        ("actors.max_prompts", cfg.actors.max_prompts >= 0, "must be >= 0"),
        ("actors.weight_poll_s", cfg.actors.weight_poll_s > 0, "must be > 0"),
        ("actors.weight_wait_s", cfg.actors.weight_wait_s >= 0, "must be >= 0"),
        ("actors.send_timeout_s", cfg.actors.send_timeout_s > 0, "must be > 0"),
        ("actors.generate_timeout_s", cfg.actors.generate_timeout_s >= 0, "must be >= 0 (0 = auto)"),
        ("actors.min_tokens_per_s", cfg.actors.min_tokens_per_s > 0, "must be > 0"),
        ("engine.health_failures", cfg.engine.health_failures >= 1, "must be >= 1"),
        ("engine.health_interval_s", cfg.engine.health_interval_s > 0, "must be > 0"),
        ("engine.health_timeout_s", cfg.engine.health_timeout_s > 0, "must be > 0"),
        ("engine.host", is_loopback_host(cfg.engine.host) or bool(cfg.engine.bind_protection),
         f"{cfg.engine.host!r} is not a loopback address: the engine's /generate has no authentication (its control "
         "endpoints take an admin API key); bind 127.0.0.1 or set engine.bind_protection (firewall | private_network | auth_proxy)"),
        ("metrics.host", not cfg.metrics.prometheus or is_loopback_host(cfg.metrics.host) or bool(cfg.metrics.bind_protection),
         f"{cfg.metrics.host!r} is not a loopback address: every process's /metrics (no authentication) would be open "
         "to whoever reaches it; bind 127.0.0.1 or set metrics.bind_protection (firewall | private_network | auth_proxy)"),
    ]


def _buffer_checks(cfg: Config) -> list[Check]:
    return [
        ("buffer.max_staleness", cfg.buffer.max_staleness >= 0, "must be >= 0"),
        ("buffer.vocab_size", cfg.buffer.vocab_size >= 0, "must be >= 0"),
        ("task.reward_max", cfg.task.reward_min <= cfg.task.reward_max, "must be >= task.reward_min"),
        ("buffer.capacity_groups", cfg.buffer.capacity_groups >= 1, "must be >= 1"),
        ("buffer.capacity_bytes", cfg.buffer.capacity_bytes >= 1, "must be >= 1"),
        ("buffer.positives_capacity", cfg.buffer.positives_capacity >= 0, "must be >= 0"),
        ("buffer.max_frame_bytes", cfg.buffer.max_frame_bytes >= 1024, "must be >= 1024"),
        ("buffer.map_size_bytes", cfg.buffer.map_size_bytes >= 1 << 20, "must be >= 1 MiB"),
        ("buffer.commit_batch", cfg.buffer.commit_batch >= 1, "must be >= 1"),
        ("buffer.credit_ttl_s", cfg.buffer.credit_ttl_s > 0, "must be > 0"),
        ("buffer.max_credit_per_actor", cfg.buffer.max_credit_per_actor >= 0, "must be >= 0"),
        ("buffer.max_credit_per_connection", cfg.buffer.max_credit_per_connection >= 0, "must be >= 0"),
        ("buffer.max_batch_groups", cfg.buffer.max_batch_groups >= 1, "must be >= 1"),
        ("buffer.max_batch_wait_s", cfg.buffer.max_batch_wait_s >= 5, "must be >= 5 (the learner asks in waits of 5 s)"),
        ("buffer.learner_version_max_step", cfg.buffer.learner_version_max_step >= 1, "must be >= 1"),
    ]


def _learner_algo_checks(cfg: Config) -> list[Check]:
    return [
        ("learner.batch_groups", cfg.learner.batch_groups >= 1, "must be >= 1"),
        ("learner.mini_batches", cfg.learner.mini_batches >= 1, "must be >= 1"),
        ("learner.ppo_epochs", cfg.learner.ppo_epochs >= 1, "must be >= 1"),
        ("learner.micro_batch_size", cfg.learner.micro_batch_size >= 1, "must be >= 1"),
        ("learner.zero_stage", 0 <= cfg.learner.zero_stage <= 3, "must be 0..3"),
        ("learner.dist_timeout_s", cfg.learner.dist_timeout_s >= 1, "must be >= 1"),
        ("algo.gamma", 0 <= cfg.algo.gamma <= 1, "must be in [0, 1]"),
        ("algo.lambda_critic", 0 <= cfg.algo.lambda_critic <= 1, "must be in [0, 1]"),
        ("algo.lambda_actor", 0 <= cfg.algo.lambda_actor <= 1, "must be in [0, 1]"),
        ("algo.alpha", cfg.algo.alpha > 0, "must be > 0"),
        ("algo.clip_low", 0 <= cfg.algo.clip_low < 1, "must be in [0, 1)"),
        ("algo.clip_high", cfg.algo.clip_high >= 0, "must be >= 0"),
        ("algo.clip_ratio_c", cfg.algo.clip_ratio_c == 0 or cfg.algo.clip_ratio_c > 1, "must be 0 (off) or > 1"),
        ("algo.overlong_max_length", cfg.algo.overlong_max_length >= 0, "must be >= 0"),
        ("learner.decoupled_weight_cap", cfg.learner.decoupled_weight_cap > 0, "must be > 0"),
        ("learner.rollout_correction_cap", cfg.learner.rollout_correction_cap > 0, "must be > 0"),
        ("nll.coef", cfg.nll.coef >= 0, "must be >= 0"),
        ("nll.replay_fraction", cfg.nll.replay_fraction >= 0, "must be >= 0"),
        ("metrics.final_scrape_wait_s", cfg.metrics.final_scrape_wait_s >= 0, "must be >= 0"),
    ]


def _placement_task_checks(cfg: Config) -> list[Check]:
    return [
        ("placement.hosts", len(cfg.placement.hosts) >= 1 and all(cfg.placement.hosts), "must name at least one host"),
        ("placement.gpus_per_host", cfg.placement.gpus_per_host >= 1, "must be >= 1"),
        ("placement.master_port", 0 < cfg.placement.master_port < 65536, "must be a port number"),
        ("placement.gpu_memory_gib", cfg.placement.gpu_memory_gib > 0, "must be > 0"),
        ("placement.learner_memory_fraction", 0 < cfg.placement.learner_memory_fraction <= 1, "must be in (0, 1]"),
        ("placement.ssh_connect_timeout_s", cfg.placement.ssh_connect_timeout_s >= 1, "must be >= 1"),
        ("placement.ssh_alive_interval_s", cfg.placement.ssh_alive_interval_s >= 1, "must be >= 1"),
        ("placement.ssh_alive_count_max", cfg.placement.ssh_alive_count_max >= 1, "must be >= 1"),
        ("placement.srun_cpus_per_task", cfg.placement.srun_cpus_per_task >= 0, "must be >= 0"),
        ("placement.gpu_peak_tflops", cfg.placement.gpu_peak_tflops > 0, "must be > 0"),
        ("placement.learner_utilization", 0 < cfg.placement.learner_utilization <= 1, "must be in (0, 1]"),
        ("placement.engine_utilization", 0 < cfg.placement.engine_utilization <= 1, "must be in (0, 1]"),
        ("placement.est_prompt_tokens", cfg.placement.est_prompt_tokens >= 0, "must be >= 0"),
        ("placement.est_response_tokens", cfg.placement.est_response_tokens >= 0, "must be >= 0"),
        ("task.min_digits", 1 <= cfg.task.min_digits <= cfg.task.max_digits, "must satisfy 1 <= min <= max_digits"),
        ("task.min_steps", 1 <= cfg.task.min_steps <= cfg.task.max_steps <= 99, "must satisfy 1 <= min <= max_steps <= 99"),
    ]


# ------------------------------------------------------------------------------------- typed merging


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; allow int -> float, nothing else implicit."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an int, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a float, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def _did_you_mean(key: str, names: set[str]) -> str:
    """A hint naming the known keys nearest ``key``: close spellings (``group_sizee``), else keys with
    ``key`` as one of their ``_`` words (``lr`` -> ``actor_lr, critic_lr, ...``), else a shared prefix."""
    close = (difflib.get_close_matches(key, names, n=3, cutoff=0.75)
             or [n for n in names if key in n.split("_")]
             or [n for n in names if n.startswith(key[:3])])
    return f" (did you mean {', '.join(sorted(close))}?)" if close else ""


def _merge(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {fl.name for fl in dataclasses.fields(obj)}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            hint = _did_you_mean(str(k), names)
            raise ConfigError(f"{key}: unknown config key{hint}")
        current = getattr(obj, k)
        if dataclasses.is_dataclass(current):
            _merge(current, v, key + ".")
        else:
            setattr(obj, k, _coerce(key, hints[k], v))


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. learner.total_steps=10)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    value = yaml.safe_load(raw) if raw.strip() != "" else ""
    return key.split("."), value


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    return out


def _coerce_override(cfg: Config, path: list[str], value: Any) -> Any:
    """YAML parses `x=1e-4` as a string and `x=3` as int; coerce to what the field wants."""
    obj: Any = cfg
    for part in path[:-1]:
        obj = getattr(obj, part, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            return value
    hints = typing.get_type_hints(type(obj)) if dataclasses.is_dataclass(obj) else {}
    tp = hints.get(path[-1])
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if tp is str and value is not None and not isinstance(value, str):
        return str(value)
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the config: defaults <- YAML file <- dotted ``key=value`` overrides, then validate."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from e
        _merge(cfg, data)
    for item in overrides or []:
        keypath, value = _parse_override(item)
        value = _coerce_override(cfg, keypath, value)
        _merge(cfg, _nest(keypath, value))
    _validate(cfg)
    return cfg


def load_config_args(argv: list[str]) -> Config:
    """``[config.yaml] [key=value ...]`` as every vapo CLI takes them (raises ConfigError)."""
    path = argv[0] if argv and "=" not in argv[0] else None
    return load_config(path, argv[1:] if path else argv)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str | Path | None = None) -> Path:
    """Write the resolved config (default ``<run dir>/config.yaml``) atomically."""
    out = Path(path) if path is not None else cfg.run_dir / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(out)
    return out


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field, in declaration order."""
    rows: list[tuple[str, str, Any, str]] = []
    inst = cls()
    hints = typing.get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        value = getattr(inst, fl.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), f"{prefix}{fl.name}."))
        else:
            tp = hints[fl.name]
            rows.append((f"{prefix}{fl.name}", _type_name(tp) if not typing.get_origin(tp) else str(tp), value, fl.metadata.get("doc", "")))
    return rows


def usage() -> str:
    """The ``--help`` of every config-driven command: how to pass the config, then every field."""
    rows = [f"  {key:<36} {tp:<10} {default!r:<28} {doc}" for key, tp, default, doc in describe()]
    return "usage: python -m common.config [config.yaml] [key=value ...]\n\nPrints the resolved config. Fields:\n\n" + "\n".join(rows)


def config_from_argv(prog: str, usage: str, argv: list[str] | None = None) -> Config | int:
    """The config named by ``argv`` (default ``sys.argv[1:]``), or the exit code the command should return.

    ``-h``/``--help`` prints ``usage`` and gives 0; an unknown key, bad value or unreadable file is reported
    as ``<prog>: config error: ...`` on stderr and gives 2. ``--local_rank=N`` (added by the DeepSpeed
    launcher) is ignored.
    """
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    if any(a in ("-h", "--help") for a in args):
        print(usage)
        return 0
    try:
        return load_config_args(args)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv("common.config", usage(), argv)
    if isinstance(cfg, int):
        return cfg
    print(dump_yaml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
