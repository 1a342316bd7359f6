"""The sections of vapo's config tree (``common.config``): one documented dataclass per section and ``Config``,
their root. Loading, validation and the command line are ``common.config``, which re-exports these."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def f(default: Any, doc: str) -> Any:
    """A documented dataclass field (the doc shows in ``--help`` and error messages)."""
    if isinstance(default, list | dict):
        def fresh() -> Any:  # each instance gets its own copy of a mutable default
            return type(default)(default)

        return field(default_factory=fresh, metadata={"doc": doc})
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
    max_resumes: int = f(0, "the launcher resumes a run stopped by a lost learner, buffer or host by itself (newest intact checkpoint), at most this many times per launch (ops/launch.sh --auto-resume N sets it; 0 = stop and print the --resume hint)")
    resume_wait_s: float = f(900.0, "run.max_resumes: how long an automatic resume waits for a lost host to answer an ssh probe (backoff) before the run stops")
    log_level: str = f("INFO", "Python logging level for every process")


@dataclass
class EvalSetConfig:
    """One entry of ``task.eval_sets`` (a list of these; an unknown field is an error naming these)."""

    name: str = f("", "the set's name in reports, metrics.jsonl and the metrics' set label ([A-Za-z0-9_.-], unique, not heldout)")
    path: str = f("", "the set's prompts: a .jsonl, a .parquet or a datasets.save_to_disk directory, read as dataset:<path> is (docs/DATA.md); a row's data_source defaults to the set's name")
    k: int = f(0, "samples per prompt for avg@k and pass@k (0 = learner.eval_k)")
    max_new_tokens: int = f(0, "response token limit of this set (0 = actors.max_new_tokens)")


@dataclass
class TaskConfig:
    name: str = f("addition", "task: addition | chain | reasoning_gym:<generator> | jsonl:<path> | dataset:<path> (a .jsonl, a .parquet or a datasets.save_to_disk directory; docs/DATA.md)")
    min_digits: int = f(1, "addition: fewest digits per operand")
    max_digits: int = f(6, "addition: most digits per operand (response length grows with digits)")
    min_steps: int = f(5, "chain: fewest steps (a response has 9 tokens per step + 4)")
    max_steps: int = f(44, "chain: most steps (steps are drawn log-uniformly, so long responses are a tail)")
    eval_buckets: int = f(10, "held-out split = operands whose hash falls in bucket 0 of this many")
    eval_size: int = f(256, "number of held-out prompts used for evaluation")
    eval_sets: list[EvalSetConfig] = f([], "named evaluation sets, each {name, path, k, max_new_tokens} (k 0 = learner.eval_k, max_new_tokens 0 = actors.max_new_tokens), evaluated with the held-out slice every learner.eval_every steps and reported per set and per data_source at avg@k and pass@k (docs/DATA.md, Evaluation sets); empty = the held-out slice alone")
    eval_heldout: bool = f(True, "with task.eval_sets: evaluate the held-out slice too, reported as the set named heldout")
    train_size: int = f(0, "reasoning_gym/jsonl/dataset: number of training items (0 = generator/file default)")
    prompt_key: str = f("", "dataset: the prompt column, a string or a list of chat messages (dotted for a nested field; empty = auto: prompt | question | problem)")
    answer_key: str = f("", "dataset: the reference answer column (dotted for a nested field; empty = auto: reward_model.ground_truth | answer | solution)")
    data_source_key: str = f("", "dataset: the column naming each row's source (empty = auto: data_source, else the file's stem)")
    extra_info_key: str = f("", "dataset: the column of each row's extra fields, kept as JSON text for reward functions (empty = auto: extra_info, else none)")
    instruction: str = f("", "text appended verbatim to every prompt (a chat prompt's last user turn); jsonl: empty keeps its \\boxed instruction")
    shuffle: bool = f(True, "dataset: train in a shuffled order (a new permutation each pass over the rows, drawn from task.shuffle_seed) instead of file order")
    shuffle_seed: int = f(-1, "dataset: seed of the training order (-1 = run.seed, resolved when the config loads; the held-out split keeps task.seed)")
    bad_rows: str = f("skip", "dataset: rows without an answer, with an empty or malformed prompt, or too long for the context: skip (counted and named at start) | error (refuse to start)")
    reward_min: float = f(0.0, "lowest reward the task's verifier gives: the buffer refuses a group below it, the learner drops such a row")
    reward_max: float = f(1.0, "highest reward the task's verifier gives: the buffer refuses a group above it, the learner drops such a row")
    seed: int = f(1234, "task seed (fixed so the held-out split is the same across runs)")
    reward: str = f("", "reward of every data_source not in reward_by_source: '' = the task's own verifier | boxed | answer_line | exact | file:<path>:<function> (verl's compute_score signature); named rewards run in a guarded process pool (docs/DATA.md, Rewards)")
    reward_by_source: dict[str, str] = f({}, "data_source -> reward name (same choices as task.reward), e.g. {openai/gsm8k: boxed}; a source not listed gets task.reward")
    reward_workers: int = f(2, "processes of the reward pool (each imports the reward files once)")
    reward_timeout_s: float = f(10.0, "seconds one response's reward may take; past it the worker is killed and replaced and the reward is 0 (a counted timeout)")
    reward_memory_mb: int = f(2048, "address space (MiB, RLIMIT_AS) a reward worker may add to what it holds after importing the reward files; past it the call fails (reward 0, a counted memory error) and the worker is replaced")


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
    critic_path: str = f("", "HF model dir the critic's backbone starts from, e.g. a larger model than the policy (empty = model.path); must share model.path's tokenizer")
    bootstrap: BootstrapConfig = sub(BootstrapConfig, "how learner.sft builds the embedded base policy")


@dataclass
class EngineConfig:
    kind: str = f("rollout_server", "engine: rollout_server (CPU/CUDA, ours) | sglang (GPU, or CPU after ops/setup.sh --sglang) | external")
    urls: list[str] = f([], "kind=external: engine base URLs to use as given (one actor each)")
    host: str = f("127.0.0.1", "bind address of engines started by vapo (non-loopback needs engine.bind_protection)")
    bind_protection: str = f("", "non-loopback engine.host only: how its unauthenticated control API port is protected: firewall | private_network | auth_proxy (empty = refuse such binds)")
    base_port: int = f(30000, "first engine port; engine i listens on base_port + i")
    max_batch_size: int = f(256, "rollout_server: most sequences decoded together")
    batch_wait_ms: float = f(2.0, "rollout_server: how long to gather concurrent requests into a batch")
    threads: int = f(1, "torch threads per engine process: rollout_server, and SGLang on CPU (OMP_NUM_THREADS)")
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
    sglang_radix_cache: str = f("auto", "sglang: SGLang's radix (prefix) cache: auto (disabled, --disable-radix-cache, only for learner.weight_transport=distributed with actors.push_pause=in_place: requests keep running through each push, SGLang then refuses every cache flush and later prompts sharing a cached prefix reuse KV of old weights, unseen by staleness accounting; a disk update drains the engine first and flushes) | enabled | disabled. Disabled costs ~3% of rollout tokens/s on the CPU default (ops/bench/sglang_radix.py; common/sglang_args.py)")
    sglang_max_total_tokens: int = f(0, "sglang: KV-cache pool in tokens (--max-total-tokens); 0 = on CPU actors.prompts_in_flight x group_size x min(placement.est_prompt_tokens + actors.max_new_tokens, context), at least one context; on GPU SGLang's own sizing (sglang_mem_fraction_static)")


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
    filter_uniform_groups: bool = f(False, "drop groups whose trained returns are all equal (DAPO dynamic sampling)")
    max_frame_bytes: int = f(64 << 20, "largest accepted wire frame")
    map_size_bytes: int = f(1 << 30, "initial LMDB map size (grows automatically)")
    commit_batch: int = f(64, "most groups written in one LMDB transaction")
    max_map_size_bytes: int = f(0, "LMDB map size ceiling; past it writes fail as storage errors (0 = free disk)")
    record_served: bool = f(False, "keep a durable record of every take: the group keys served and dropped as stale, with the learner version and staleness floor (LMDB db served, 20 bytes per group, never trimmed; for ops.bench.chaos's history)")
    positive_reward: float = f(1.0, "samples with reward >= this are verified-correct positives, for every role: the buffer's positives store, the learner's NLL mask, replay count and positives_fraction, the actors' positives_rate")
    credit_ttl_s: float = f(600.0, "seconds after which a granted, unused credit stops counting as in flight")
    peer_timeout_s: float = f(15.0, "an ingest connection that answers no ZMTP heartbeat (sent every third of this) for this long is closed and its unused credit released: an actor host that vanished without closing TCP (0 = never; credit_ttl_s still applies)")
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
    micro_batch_size: int = f(64, "most rows per micro-batch of the padded layout (learner.packing=false); packed micro-batches are bounded by micro_batch_tokens alone")
    micro_batch_tokens: int = f(0, "token budget of a training micro-batch: packed, the sum of its rows' prompt+response tokens; padded, rows x the longest (0 = micro_batch_size x the batch's longest row); a longer row goes alone")
    no_grad_micro_batch_tokens: int = f(0, "token budget of a micro-batch of the no-grad passes (values, recomputed pi_old), which keep no activations for a backward (0 = 2 x the training budget)")
    packing: bool = f(True, "pack each micro-batch's rows into one token stream (positions restart per row, attention block-diagonal causal, no padding); false = rows right-padded to the longest")
    logits_chunk_elements: int = f(1 << 24, "policy log-probs: LM head over chunks of this many tokens x vocab elements, recomputed in backward (0 = full [B, S, vocab] logits)")
    activation_checkpointing: bool = f(False, "recompute the policy's and critic's transformer layers in backward (non-reentrant): less memory, ~1/3 more compute")
    activation_checkpointing_every: int = f(1, "with activation_checkpointing: recompute every k-th transformer layer only (1 = every layer; k > 1 keeps the other layers' activations: less recompute, more memory)")
    peak_tflops: float = f(0.0, "MFU's denominator: dense peak TFLOP/s of one learner device at learner.precision (0 = by the device's name for known GPUs, common/device_peak.py; on the CPU a matmul ceiling measured at start; no MFU on an unknown GPU)")
    actor_lr: float = f(1e-4, "policy learning rate")
    critic_lr: float = f(2e-4, "critic learning rate")
    warmup_steps: int = f(0, "linear lr warmup (optimizer steps) for the policy")
    critic_warmup_steps: int = f(0, "linear lr warmup (optimizer steps) for the critic")
    critic_updates: int = f(0, "K_v: critic optimizer steps (mini-batches) per epoch of a step, set apart from the actor's (0 = learner.mini_batches; the paper: 16)")
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
    value_head_surprise_source: str = f("critic_head", "whose token logprobs the surprise features are: critic_head (the critic's own tied LM head and backbone, moved by its training) | behaviour (each sample's behaviour logprobs) | frozen_base (a frozen copy of the base model, backbone and LM head; not with ZeRO-3)")
    critic_grown_lr_scale: float = f(1.0, "layers learner.grow inserted into the critic's backbone (grow.json in model.critic_path) train at this multiple of the critic lr: their output projections start at zero, and at a near-frozen backbone lr they barely move")
    publish_addr: str = f("tcp://127.0.0.1:5557", "PUB address for WeightUpdate")
    query_addr: str = f("tcp://127.0.0.1:5558", "REP address where late subscribers ask for the latest weights")
    weights_every: int = f(1, "publish weights every N steps")
    keep_weights: int = f(3, "newest weight versions kept on disk")
    weight_transport: str = f("disk", "how a new version reaches the engines: disk (safetensors under <run dir>/weights, each engine loads them: /update_weights_from_disk) | distributed (rank 0 broadcasts flattened buckets to the engines' weight-update group: /update_weights_from_distributed; the disk version is then written in the background, for restarts and engines that missed a push)")
    bucket_bytes: int = f(512 << 20, "weight_transport=distributed: most bytes gathered and broadcast at a time (one /update_weights_from_distributed call each)")
    push_addr: str = f("tcp://127.0.0.1:5559", "weight_transport=distributed: ROUTER address where actors join the weight-update group and report each push; learner rank 0 binds it on host 0 before value pretraining, and the plan refuses an address host 0 does not have")
    push_master_address: str = f("127.0.0.1", "weight_transport=distributed: address the engines reach learner rank 0's group store and broadcasts at (learner rank 0's host on the engines' network); the store listens on it alone (not loopback: needs a fixed push_master_port and placement.store_protection)")
    push_master_port: int = f(0, "weight_transport=distributed: port of the group store, the same for every rebuilt group (0 = a free one each time, sent to the engines; only with a loopback push_master_address)")
    push_backend: str = f("auto", "weight_transport=distributed: the group's backend: gloo | nccl | auto (nccl when run.device is cuda)")
    push_timeout_s: float = f(60.0, "weight_transport=distributed: longest a group join or one bucket's broadcast waits for the engines; past it the group is dropped, that version reaches the engines from disk, and the group is rebuilt at the next version with the engines that answered")
    checkpoint_every: int = f(10, "full checkpoint (policy + critic + optimizers + cursors) every N steps")
    keep_checkpoints: int = f(2, "newest checkpoints kept")
    resume: str = f("auto", "auto (newest intact checkpoint) | never | <checkpoint path>")
    resume_damaged: str = f("fallback", "a damaged newest checkpoint (file not matching its digest) on resume=auto: fallback (set it aside as v<N>.damaged, resume from the newest intact one) | refuse (stop, naming the file and the intact one)")
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
    critic: str = f("learned", "what gives the actor's advantages their values: learned (the critic) | oracle (chain task only: a hand-made, task-aware reference critic from the task's own state, p^(step lines left) and 0 after a mistake, one slip rate p for every line, so not a ceiling; the critic still trains and reports its EV beside oracle_explained_variance)")
    baseline: str = f("critic", "the actor's prompt-level baseline: critic (GAE over the critic's values) | group_loo (for G >= 8: each response's leave-one-out group mean reward, the critic's values only for credit within the response)")
    oracle_line_accuracy: float = f(0.0, "critic=oracle: p, the chance of writing a step line right (0 = each batch's own rate: 1 - first mistakes / (lines right before them + first mistakes))")


@dataclass
class ValuePretrainConfig:
    enabled: bool = f(True, "fit the critic before RL with the policy frozen")
    steps: int = f(50, "most critic updates")
    batch_groups: int = f(32, "groups per value-pretraining step")
    lr: float = f(5e-4, "critic lr during value pretraining")
    patience: int = f(10, "stop when explained variance has not improved for this many steps")
    pool_groups: int = f(0, "groups drawn once and trained on in epochs (each epoch a fresh shuffle cut into batch_groups-group batches) until patience or steps ends (0 = a fresh batch from the buffer every step)")
    allow_untrained_critic: bool = f(True, "RL may start from a critic whose best held-out explained variance is <= 0; false: the learner refuses to start")
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
    store_protection: str = f("", "how host 0's torch.distributed stores (no authentication) are protected: placement.master_port (a learner on several hosts; every interface) and learner.push_master_port (the weight group's, on a non-loopback learner.push_master_address): firewall | private_network (empty = refuse such a run)")
    master_port: int = f(29500, "a learner on several hosts: torch.distributed's rendezvous port on host 0 (ranks on one host meet in a file; one rank needs neither)")
    master_addr: str = f("", "a learner on several hosts: host 0's address the other ranks reach its store at (empty = the name hosts[0])")
    ssh_args: str = f("", "extra options of every ssh to another host and of pdsh's (e.g. '-F /path/ssh_config'); $VAPO_SSH_ARGS adds more")
    ssh_connect_timeout_s: int = f(10, "ssh ConnectTimeout: a host that does not answer within this fails the start")
    ssh_alive_interval_s: int = f(5, "ssh ServerAliveInterval and the launcher's heartbeat period to processes it started over ssh")
    ssh_alive_count_max: int = f(3, "ssh ServerAliveCountMax: a link silent for interval x this is lost; the remote process stops itself, the launcher stops the run (a learner or buffer host) or carries on without the engine host and probes it")
    min_engines: int = f(1, "engines (each with its actor) the run needs alive: a lost engine host or an engine given up past engine.max_restarts costs only its share while at least this many remain")
    min_engines_grace_s: float = f(300.0, "seconds the run may have fewer than placement.min_engines engines alive (a lost host coming back) before it stops (--resume continues it)")
    srun_cpus_per_task: int = f(0, "placement.remote=srun: CPUs of each srun'd engine/actor step, learner steps split them over their ranks per host (0 = $SLURM_CPUS_ON_NODE; srun's own default is one)")
    gpu_memory_gib: float = f(80.0, "memory of one GPU; the launcher refuses a placement whose estimated model states do not fit")
    gpu_peak_tflops: float = f(989.0, "balance estimate (--dry-run): dense bf16 peak TFLOP/s of one GPU (H100/H800 SXM 989, A100 312)")
    learner_utilization: float = f(0.35, "balance estimate: fraction of peak a learner GPU's passes reach on a perfectly balanced plan (the micro-batch plan's lockstep cost is counted on top; ZeRO-3 with activation checkpointing: ~0.3-0.5)")
    learner_gather_gbps: float = f(50.0, "balance estimate, learner.zero_stage=3: GB/s one learner GPU all-gathers parameters at (400 Gb/s InfiniBand a GPU: ~50); each micro-batch's forward and backward gather the weights")
    engine_utilization: float = f(0.5, "balance estimate: fraction of peak an engine's matmuls reach where FLOPs bind (the estimate takes the larger of the FLOP and the memory-traffic time)")
    gpu_memory_bandwidth_gbps: float = f(3350.0, "balance estimate: memory bandwidth of one GPU in GB/s (H100 SXM 3350, H200 4800, A100 80GB 2039); each decode iteration reads the weights and every running request's KV cache")
    engine_bandwidth_utilization: float = f(0.8, "balance estimate: fraction of placement.gpu_memory_bandwidth_gbps an engine's decoding reaches")
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
    final_scrape_wait_s: float = f(20.0, "a scraped learner or actor waits up to this long for one last scrape before exiting (0 = never)")
    trackers: list[str] = f([], "experiment trackers fed every metrics.jsonl record by learner rank 0: any of tensorboard (<run dir>/tensorboard), wandb (<run dir>/wandb)")
    wandb_mode: str = f("offline", "metrics.trackers wandb: offline (written under the run dir, no network, no API key; wandb sync uploads it later) | online")
    wandb_project: str = f("vapo", "metrics.trackers wandb: the W&B project")


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
