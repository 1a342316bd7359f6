"""Every Prometheus metric of vapo, declared once (the Grafana dashboard and docs/METRICS.md read these names).

Each process builds only its own component's metrics in its own registry and serves them:

    m = Metrics("buffer")
    m.serve(cfg.buffer.metrics_port, cfg.metrics.host)
    m.depth_groups.set(12)
    m.rejected_frames.labels(reason="oversized").inc()

Full names are ``vapo_<component>_<name>``; counters get prometheus_client's ``_total`` suffix on the
wire (``vapo_buffer_acked_groups_total``). Learner health names follow verl's where verl has one.

The ``/metrics`` HTTP server reads each request under a timeout (``READ_TIMEOUT_S``: a client that sends half a
request is dropped, its thread freed) and serves at most ``MAX_CONNECTIONS`` connections at once (one thread
each; a connection beyond that is closed at once), so slow or idle clients cannot pile up threads.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

Kind = Literal["counter", "gauge", "histogram"]
COMPONENTS = ("buffer", "actor", "engine", "learner", "launcher")

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STALENESS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


READ_TIMEOUT_S = 5.0  # /metrics: seconds a read of a request may block before the connection is dropped
MAX_CONNECTIONS = 16  # /metrics: connections (threads) served at once; more are closed unserved


@dataclass(frozen=True)
class MetricSpec:
    component: str
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def full_name(self) -> str:
        return f"vapo_{self.component}_{self.name}"

    @property
    def exposed_name(self) -> str:
        """The sample name a PromQL query uses (counters carry ``_total``)."""
        return self.full_name + ("_total" if self.kind == "counter" else "")


def _c(comp: str, name: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(comp, name, "counter", help, labels)


def _g(comp: str, name: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(comp, name, "gauge", help, labels)


def _h(comp: str, name: str, help: str, buckets: tuple[float, ...] = _LATENCY, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(comp, name, "histogram", help, labels, buckets)


SPECS: tuple[MetricSpec, ...] = (
    # ---- buffer
    _g("buffer", "depth_groups", "Groups stored and not yet served"),
    _g("buffer", "depth_samples", "Samples stored and not yet served"),
    _c("buffer", "ingested_groups", "Groups received from actors (including duplicates)"),
    _c("buffer", "acked_groups", "Groups acknowledged after their LMDB commit"),
    _c("buffer", "duplicate_groups", "Re-sent groups recognised by group_id and stored once"),
    _c("buffer", "rejected_frames", "Frames rejected as malformed or hostile (reason role: a message its client key's role may not send)", ("reason",)),
    _c("buffer", "invalid_groups", "Groups refused at ingest as unusable by the learner (never stored)", ("reason",)),
    _c("buffer", "auth_refused", "Connections refused at the CurveZMQ handshake (no key, unknown key, wrong server key)", ("socket",)),
    _c("buffer", "stale_dropped_groups", "Groups dropped for exceeding max_staleness"),
    _c("buffer", "filtered_groups", "Groups dropped by a filter", ("reason",)),
    _c("buffer", "served_groups", "Groups served to the learner"),
    _g("buffer", "positives_stored", "Verified-correct samples held for NLL replay"),
    _c("buffer", "admission_waits", "Credit requests that had to wait for capacity"),
    _g("buffer", "credit_outstanding", "Groups granted to actors and not yet received"),
    _g("buffer", "learner_version", "Newest learner version the buffer has heard of"),
    _g("buffer", "lmdb_bytes", "Bytes of the LMDB data file"),
    _c("buffer", "storage_errors", "Failed LMDB writes (disk full, map full)", ("reason",)),
    _h("buffer", "commit_latency_seconds", "LMDB transaction commit latency"),
    _h("buffer", "batch_serve_seconds", "Time to assemble and send one learner batch"),
    _g("buffer", "depth_bytes", "Bytes of group frames stored and not yet served"),
    _c("buffer", "positives_duplicates", "Positives not stored again (same prompt and output tokens)"),
    _c("buffer", "positives_evicted", "Positives evicted oldest-first at buffer.positives_capacity"),
    _c("buffer", "credit_granted", "Credits (groups) granted to actors"),
    _c("buffer", "credit_reclaimed", "Credits lent above a fair share and taken back for an actor below its share"),
    _g("buffer", "credit_waiting", "Actors waiting for credit"),
    _g("buffer", "admission_capacity", "Groups the buffer would admit now (staleness bound minus queued and in flight)"),
    _c("buffer", "batch_timeouts", "Batch requests answered with a timeout error"),
    # ---- actors (one process per actor; label actor = actor id)
    _c("actor", "samples", "Verified samples generated", ("actor",)),
    _c("actor", "tokens", "Response tokens generated", ("actor",)),
    _c("actor", "groups_sent", "Groups acknowledged by the buffer", ("actor",)),
    _c("actor", "groups_resent", "Groups re-sent after a timeout or reconnect", ("actor",)),
    _g("actor", "reward_mean", "Mean reward of the last group", ("actor",)),
    _g("actor", "positives_rate", "Fraction of positives (reward >= buffer.positive_reward) in the last group", ("actor",)),
    _c("actor", "source_samples", "Scored samples per data_source (the prompt's; the task's name when it has none; past 32 sources, other)", ("actor", "data_source")),
    _c("actor", "source_positives", "Scored samples with reward >= buffer.positive_reward per data_source", ("actor", "data_source")),
    _g("actor", "source_reward_mean", "Mean reward of the last scored group of each data_source", ("actor", "data_source")),
    _h("actor", "generation_seconds", "Engine latency of one group's generation", labels=("actor",)),
    _c("actor", "credit_wait_seconds", "Seconds blocked waiting for buffer credit", ("actor",)),
    _c("actor", "weight_wait_seconds", "Seconds granted prompts waited for the engine to serve the grant's learner version", ("actor",)),
    _g("actor", "weight_version", "Weight version the actor's engine serves", ("actor",)),
    _h("actor", "weight_sync_seconds", "Learner publish to engine serving the new version", labels=("actor",)),
    _c("actor", "weight_sync_failures", "Weight updates refused (checksum, load error)", ("actor", "reason")),
    _h("actor", "weight_sync_phase_seconds", "Engine side of one weight update by phase: pause (generation paused, pause to continue), load (disk: /update_weights_from_disk; distributed: the bucket posts)", labels=("actor", "phase", "transport")),
    _c("actor", "engine_restarts", "Engine processes restarted after dying", ("actor",)),
    _g("actor", "samples_per_second", "Verified samples per second over the last interval", ("actor",)),
    _g("actor", "prompts_in_flight", "Prompts between buffer credit and buffer ack", ("actor",)),
    _c("actor", "resubmits", "Prompts generated again after an abort or an engine failure", ("actor", "reason")),
    _c("actor", "prompts_skipped", "Prompts the engine refused (4xx) and that were skipped", ("actor",)),
    _c("actor", "reward_errors", "Reward calls that failed and scored 0 (timeout, exception, memory, crash, bad_value) or gave a value outside [task.reward_min, task.reward_max], clipped (out_of_range)", ("actor", "kind")),
    _g("actor", "reward_extra", "Mean over the last group of a reward function's extra figure (the keys of its dict besides score; at most 32 names)", ("actor", "figure")),
    _c("actor", "groups_not_served", "Groups the buffer stored but will not serve (stale, filtered) or refused as unusable (invalid)", ("actor", "reason")),
    # ---- engine (actors.rollout_server)
    _c("engine", "requests", "Generate requests served", ("status",)),
    _c("engine", "generated_tokens", "Tokens generated"),
    _g("engine", "running_sequences", "Sequences currently decoding"),
    _g("engine", "queued_sequences", "Sequences waiting for a batch slot"),
    _h("engine", "batch_size", "Sequences per decode batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
    _g("engine", "weight_version", "Weight version being served"),
    _c("engine", "weight_updates", "Weight updates applied or refused", ("status",)),
    _h("engine", "step_seconds", "Wall time of one engine step (admission prefill + batched decode)"),
    _c("engine", "bad_requests", "Requests refused with a 4xx", ("endpoint",)),
    _c("engine", "control_requests", "Control calls (pause, continue, abort, weight update, flush) by outcome: ok | unauthorized (no or a wrong admin API key)", ("endpoint", "status")),
    # ---- learner
    _g("learner", "step", "Learner steps completed"),
    _g("learner", "weight_version", "Policy version (published weights)"),
    _g("learner", "last_step_timestamp_seconds", "Unix time when the last step finished"),
    _g("learner", "critic_loss", "Critic value loss (last step)"),
    _g("learner", "value_explained_variance", "Critic explained variance of the λ_critic returns"),
    _g("learner", "value_mean", "Mean critic value over real tokens"),
    _g("learner", "policy_loss", "Clipped policy loss (last step)"),
    _g("learner", "nll_loss", "Positive-example NLL loss (last step)"),
    _g("learner", "clip_fraction_low", "Fraction of tokens clipped at 1 - ε_low (negative advantage)"),
    _g("learner", "clip_fraction_high", "Fraction of tokens clipped at 1 + ε_high (positive advantage)"),
    _g("learner", "clip_fraction_dual", "Fraction of tokens held at the dual clip c·A (negative advantage, ratio above c)"),
    _g("learner", "mismatch_kl", "Engine/learner mismatch: mean per-token KL(behaviour || learner), k3 estimate, rows of the weights being updated"),
    _g("learner", "mismatch_ratio_max", "Engine/learner mismatch: largest per-token ratio π_learner/π_behaviour on those rows"),
    _g("learner", "mismatch_tokens", "Tokens the last mismatch measurement used (0: no row was generated by the weights being updated)"),
    _g("learner", "mismatch_ratio_min", "Engine/learner mismatch: smallest per-token ratio π_learner/π_behaviour on those rows (measured in the proximal pass)"),
    _g("learner", "mismatch_kl_by_length", "Engine/learner mismatch: mean per-token KL of those rows by response-length bin (proximal pass)", ("length_bin",)),
    _g("learner", "oracle_explained_variance", "algo.critic=oracle: explained variance of the oracle's values (the critic's own is value_explained_variance)"),
    _g("learner", "approx_kl", "Approximate KL(old || new) over tokens"),
    _g("learner", "entropy", "Mean token entropy of the policy"),
    _g("learner", "grad_norm", "Gradient norm before clipping", ("model",)),
    _g("learner", "lr", "Current learning rate", ("model",)),
    _g("learner", "lambda_actor_mean", "Mean length-adaptive λ of the batch"),
    _g("learner", "reward_mean", "Mean reward of the batch"),
    _g("learner", "positives_fraction", "Fraction of positives (reward >= buffer.positive_reward) in the batch"),
    _g("learner", "response_length_mean", "Mean response length of the batch (tokens)"),
    _h("learner", "staleness", "Learner version minus sample weight version", buckets=_STALENESS),
    _c("learner", "data_wait_seconds", "Seconds spent waiting for batches"),
    _g("learner", "tokens_per_second", "Trained tokens per second (last step)"),
    _g("learner", "phase_seconds", "Seconds of the last step spent in each phase", ("phase",)),
    _g("learner", "tokens_per_second_per_rank", "Trained tokens per second per learner rank (last step)"),
    _g("learner", "phase_tokens_per_second", "Tokens through a model per second in each model phase of the last step (an update counts them once per epoch)", ("phase",)),
    _g("learner", "tflops_per_rank", "Model TFLOP/s per learner rank in each model phase of the last step, and over its non-fetch time (phase=step)", ("phase",)),
    _g("learner", "mfu", "Model FLOP utilisation per learner rank against learner.peak_tflops (CPU: a matmul ceiling measured at start), per model phase and phase=step", ("phase",)),
    _g("learner", "eval_accuracy", "Held-out accuracy", ("metric",)),
    _g("learner", "eval_response_length", "Held-out mean response length"),
    _g("learner", "eval_avg_at_k", "Mean reward of the k samples per prompt of an evaluation set (task.eval_sets; heldout = the held-out slice), per data_source (all = the whole set)", ("set", "data_source")),
    _g("learner", "eval_pass_at_k", "Fraction of an evaluation set's prompts with a fully rewarded sample among their k, per data_source (all = the whole set)", ("set", "data_source")),
    _c("learner", "samples", "Samples trained on"),
    _c("learner", "weights_published", "Weight versions published"),
    _h("learner", "weight_sync_phase_seconds", "Learner side of one weight publish by phase: gather (ZeRO-3 gathers + flatten + NaN check), broadcast (the learner's wait for its broadcasts to the engines' group; the final bucket's completes off its path, uncounted), host_copy (for the durable writer), group (building the weight-update group), disk_write (disk transport: the whole synchronous export; distributed: the background durable write)", labels=("phase", "transport")),
    _c("learner", "weight_pushes", "Versions a distributed push was attempted for, by outcome: ok (every member received every bucket) | failed (the group broke; that version reaches the engines from disk) | no_group (no engine in the group)", ("outcome",)),
    _g("learner", "weight_push_members", "Engines in the current weight-update group"),
    _c("learner", "unusable_samples", "Batch samples dropped as unusable (a bad sample drops its whole group; replayed positives one by one)", ("reason",)),
    _c("learner", "auth_refused", "Connections to the weight publisher refused at the CurveZMQ handshake", ("socket",)),
    _g("learner", "value_pretrain_explained_variance", "Explained variance during value pretraining (fresh batches)"),
    _g("learner", "value_pretrain_loss", "Critic loss during value pretraining"),
    _g("learner", "value_pretrain_step", "Value pretraining steps done"),
    # ---- launcher
    _c("launcher", "component_restarts", "Children restarted by ops/launch.sh", ("component",)),
    _g("launcher", "components_up", "Children running", ("component",)),
    _g("launcher", "engines_alive", "Engines (each with its actor) neither given up nor on a lost host"),
    _g("launcher", "engines_planned", "Engines (each with its actor) the run's plan starts"),
    _c("launcher", "components_given_up", "Engine/actor children that exited past their restarts and were left down (the run goes on on the others while placement.min_engines hold)", ("component",)),
    _c("launcher", "hosts_lost", "Engine hosts lost (ssh exit 255 of a child there); their engines and actors wait for the host to answer a probe again", ("host",)),
    _c("launcher", "hosts_rejoined", "Lost engine hosts that answered a probe again and had their engines and actors restarted", ("host",)),
    _c("launcher", "auto_resumes", "Automatic resumes of a run stopped by a lost learner, buffer or host (run.max_resumes)"),
    _c("launcher", "resume_lost_seconds", "Seconds lost to automatic resumes: each stop to the resumed learner's first step, plus the redone steps at the run's pace"),
    _c("launcher", "groups_dropped_lost_host", "Groups granted to the actors of a lost host and never delivered: the credit the buffer released over the loss (their prompts are generated again by the restarted actor)"),
)

# The config key that sets each component's /metrics port (named in bind errors).
_PORT_KEYS = {"buffer": "buffer.metrics_port", "learner": "learner.metrics_port",
              "actor": "actors.metrics_base_port", "launcher": "metrics.launcher_port"}

_BY_COMPONENT: dict[str, dict[str, MetricSpec]] = {}
for _s in SPECS:
    _BY_COMPONENT.setdefault(_s.component, {})
    assert _s.name not in _BY_COMPONENT[_s.component], f"duplicate metric {_s.full_name}"
    _BY_COMPONENT[_s.component][_s.name] = _s


def specs(component: str | None = None) -> list[MetricSpec]:
    return [s for s in SPECS if component is None or s.component == component]


class Metrics:
    """The metrics of one component, in their own registry; attribute access by short name."""

    def __init__(self, component: str, registry: CollectorRegistry | None = None) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"unknown metrics component {component!r}; one of {COMPONENTS}")
        self.component = component
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics: dict[str, Any] = {}
        for spec in _BY_COMPONENT.get(component, {}).values():
            kw: dict[str, Any] = {"registry": self.registry, "labelnames": spec.labels}
            if spec.kind == "counter":
                m: Any = Counter(spec.full_name, spec.help, **kw)
            elif spec.kind == "gauge":
                m = Gauge(spec.full_name, spec.help, **kw)
            else:
                m = Histogram(spec.full_name, spec.help, buckets=spec.buckets or _LATENCY, **kw)
            self._metrics[spec.name] = m
        self.port: int | None = None
        self._scraped = threading.Condition()
        # time.time() at which the newest fully sent /metrics response started being collected (0 = never).
        self.last_scrape: float = 0.0

    def __getattr__(self, name: str) -> Any:
        metrics = self.__dict__.get("_metrics", {})
        if name in metrics:
            return metrics[name]
        raise AttributeError(f"no metric vapo_{self.__dict__.get('component')}_{name} declared in common/metrics.py")

    def serve(self, port: int, host: str = "127.0.0.1", config_key: str | None = None, *,
              read_timeout_s: float | None = None, max_connections: int | None = None) -> int:
        """Serve ``/metrics`` on host:port (port 0 picks a free one); returns the port.

        A bind failure raises OSError naming host:port and the config key that sets it (``config_key``,
        else the component's usual key), so the operator knows which setting collides. ``read_timeout_s`` and
        ``max_connections`` default to ``READ_TIMEOUT_S`` and ``MAX_CONNECTIONS`` (module docstring).
        """
        try:
            server = self._start_server(port, host, READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s,
                                        MAX_CONNECTIONS if max_connections is None else max_connections)
        except OSError as e:
            key = config_key or _PORT_KEYS.get(self.component, "the component's metrics port")
            raise OSError(e.errno, f"cannot serve {self.component} /metrics on {host}:{port}: "
                          f"{e.strerror or e}; set {key} to a free port (0 = any free port), "
                          "or metrics.host / metrics.prometheus=false") from None
        self.port = int(server.server_address[1])
        return self.port

    def _start_server(self, port: int, host: str, read_timeout_s: float, max_connections: int) -> ThreadingWSGIServer:
        """prometheus_client's WSGI exposition, plus a note of each scrape once its response is sent."""
        collect = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            started = time.time()
            return _ThenNotify(collect(environ, start_response), lambda: self._on_scrape(started))

        class Server(_BoundedServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            slots = threading.BoundedSemaphore(max_connections)

        class Handler(_QuietHandler):
            timeout = read_timeout_s  # StreamRequestHandler puts it on the socket: every read is bounded

        server = make_server(host, port, app, Server, handler_class=Handler)
        threading.Thread(target=server.serve_forever, daemon=True, name=f"metrics-{self.component}").start()
        return server

    def _on_scrape(self, started: float) -> None:
        with self._scraped:
            self.last_scrape = max(self.last_scrape, started)
            self._scraped.notify_all()

    def wait_for_scrape(self, after: float, timeout_s: float) -> bool:
        """Block until a ``/metrics`` response collected at or after ``after`` (a ``time.time()``) has been
        sent in full, or ``timeout_s``.

        A short-lived process calls this before it exits so that Prometheus records its final values
        (a pull model never sees what changed after its last scrape). Returns whether a scrape came.
        Both ends matter: a scrape already collecting when ``after`` was taken may hold older values,
        and one noted at collection time would let the process exit before the bytes are on the wire,
        so Prometheus would record a failed scrape instead of the final values.
        """
        deadline = time.monotonic() + timeout_s
        with self._scraped:
            while self.last_scrape < after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._scraped.wait(left)
        return True

    def stay_for_last_scrape(self, timeout_s: float) -> bool | None:
        """Before a process exits: wait up to ``timeout_s`` for one more scrape (``wait_for_scrape`` from now),
        but only where someone has scraped it; ``None`` when nobody ever did or ``timeout_s`` is 0.

        Pull-based monitoring never sees values set after its last scrape, so without this the final
        step's figures, or a short-lived process's only ones, never reach Grafana.
        """
        if self.last_scrape <= 0 or timeout_s <= 0:
            return None
        return self.wait_for_scrape(time.time(), timeout_s)


class _ThenNotify:
    """A WSGI response body that calls ``done`` when the server closes it: after the last byte is written."""

    def __init__(self, body: Iterable[bytes], done: Callable[[], None]) -> None:
        self.body, self.done = body, done

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.done()


class _BoundedServer(ThreadingWSGIServer):
    """One thread per connection, at most ``slots`` at once; a connection past the bound is closed unserved."""

    slots: threading.BoundedSemaphore
    request_queue_size = 64  # listen backlog: a burst of connections is accepted (and closed), not SYN-dropped
    refused = 0  # connections closed at the bound (per server class)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            type(self).refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # the thread never started
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away: dropped quietly (the default prints a traceback)."""


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on stderr."""

    def log_message(self, format: str, *args: Any) -> None:  # the base class's name
        pass
