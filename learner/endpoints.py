"""The learner's listening sockets, bound before value pretraining so that an address this host lacks fails
at start, not hours later: rank 0's weight publisher (PUB, REP) and, with ``learner.weight_transport=
distributed``, the push coordinator (``learner.push_addr``) with the weight group's store address checked.

Not a CLI. ``learner.runner.main`` makes ``Endpoints`` first, attaches the learner once it is built (its
tokenizer and model config go beside every pushed version) and closes them last.
"""

from __future__ import annotations

from typing import Any

import zmq

from common.config import Config, ConfigError
from common.metrics import Metrics
from common.push_addresses import push_store_problem
from common.weight_bucket import check_listen
from learner.dist import rank
from learner.publisher import WeightPublisher
from learner.push_coordinator import PushCoordinator
from learner.train import Learner
from learner.weights import latest_update, prune


def start_publisher(cfg: Config, metrics: Metrics) -> WeightPublisher:
    """Rank 0's WeightPublisher, announcing the newest complete version on disk."""
    learner_cfg, weights_root = cfg.learner, cfg.run_dir / "weights"
    weights_root.mkdir(parents=True, exist_ok=True)
    prune(weights_root, learner_cfg.keep_weights)  # drops *.tmp left by a crash
    refused = metrics.auth_refused
    return WeightPublisher(learner_cfg.publish_addr, learner_cfg.query_addr, cfg.buffer.curve,
                           latest=latest_update(weights_root), on_refused=lambda sock: refused.labels(socket=sock).inc())


def check_push_store(cfg: Config) -> None:
    """Rank 0: the weight group's store can listen where configured (``learner.push_master_address``, one of
    this host's addresses; a fixed ``push_master_port`` free; off loopback ``placement.store_protection``
    said). It listens only while a group is built, the first time after value pretraining."""
    problem = push_store_problem(cfg)
    if problem:
        raise ConfigError(problem)
    lc = cfg.learner
    try:
        check_listen(lc.push_master_address, lc.push_master_port)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"learner.push_master_address / push_master_port: {why} (it must be an address of learner "
                          "rank 0's host, the port free)") from e


class _Later:
    """What the durable writer saves beside each pushed version (tokenizer, model config) once the learner
    that has it is built: the push coordinator is made before value pretraining, the learner after it."""

    def __init__(self) -> None:
        self.target: Any = None

    def save_pretrained(self, path: Any) -> None:
        if self.target is not None:
            self.target.save_pretrained(path)


class Endpoints:
    """The learner's listening sockets, bound before value pretraining (hours at paper scale) so that an address
    this host does not have fails at once, not after it: rank 0's weight publisher (PUB, REP) and, with
    ``learner.weight_transport=distributed``, the push coordinator (every rank makes it; rank 0 binds
    ``learner.push_addr``) with the weight group's store address checked."""

    def __init__(self, cfg: Config, metrics: Metrics) -> None:
        self.tokenizer, self.model_config = _Later(), _Later()
        self.publisher = start_publisher(cfg, metrics) if rank() == 0 else None
        self.push: PushCoordinator | None = None
        try:
            if cfg.learner.weight_transport == "distributed":
                self.push = self._push_coordinator(cfg, metrics)
        except BaseException:
            self.close()
            raise

    def _push_coordinator(self, cfg: Config, metrics: Metrics) -> PushCoordinator:
        if rank() == 0:
            check_push_store(cfg)
        try:
            push = PushCoordinator(cfg, cfg.run_dir / "weights", self.publisher, metrics, self.tokenizer,
                                   self.model_config)
        except zmq.ZMQError as e:
            raise ConfigError(f"learner.push_addr: cannot bind {cfg.learner.push_addr} on learner rank 0's host: {e}") from e
        push.start()
        return push

    def attach(self, learner: Learner) -> None:
        """The built learner's tokenizer and model config go beside every version the push writes."""
        self.tokenizer.target = learner.tokenizer
        self.model_config.target = getattr(learner.policy.module, "config", None)

    def close(self) -> None:
        """The push first (its last durable version is written and announced), then the publisher; idempotent."""
        push, publisher, self.push, self.publisher = self.push, self.publisher, None, None
        if push is not None:
            push.close()
        if publisher is not None:
            publisher.close()
