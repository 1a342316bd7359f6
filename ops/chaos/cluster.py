"""The chaos run on the rehearsal's cluster: hosts h0..h3 as network namespaces, the run started on h0 as the
rehearsal's ssh route starts it, and two faults only hosts can have.

Not a CLI; ``ops.bench.chaos --cluster`` uses it (root, and the rehearsal's Debian packages, as
``ops/rehearse.sh``). Placement as ``ops/configs/rehearsal.yaml``: the launcher, the buffer and learner rank 0
on h0, learner rank 1 on h1, an engine with its actor on each of h2 and h3. The nemesis's process faults find
their targets on every host (the root namespace sees each host's processes); the host faults are:

- ``host_down``: every process of an engine host killed (``Cluster.kill_host``: its engine, actor, sshd and
  slurmd), and the host back after a while (``Cluster.restart_host``); the launcher's probe finds it and
  restarts its engine and actor, which take the newest weights;
- ``partition``: one host's link (its veth on the bridge) down for a while, then up; an engine host's actor
  loses the buffer and the launcher its ssh link, and the learner host's rank loses rank 0 (the process
  group times out, the run stops, and the chaos run resumes it).

``/metrics`` ports live inside the namespaces, so the nemesis's HTTP faults (slow clients) are left out here.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from common.config import load_config
from ops.chaos.nemesis import HOST_FAULTS
from ops.chaos.procs import cmdline, kind
from ops.rehearsal.cluster import Cluster
from ops.rehearsal.runs import leftovers

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "ops/configs/rehearsal.yaml"
# The faults a cluster run can take (no slow_metrics: its ports are inside the namespaces).
KINDS = ("kill_buffer", "kill_actor", "kill_engine", "kill_learner", "stop_engine", "disk_full", *HOST_FAULTS)
HEAD = "h0"  # the launcher's host: losing it is losing the run, which the rehearsal's kill stage covers
LEARNER_HOST = "h1"
WORKLOAD = "ops/configs/default.yaml"
# The ssh route's process-group timeout: a partitioned learner rank fails within seconds, not the default 30 min.
OVERRIDES = ["learner.dist_timeout_s=10"]
# What the cluster's topology sets, kept from its config when the default workload's settings are laid over it
# (the rehearsal's own learning settings test the path and do not learn: its held-out accuracy falls over
# 240 fault-free steps, so accuracy against the base would measure the config, not the faults).
TOPOLOGY = ("run.", "placement.", "engine.", "metrics.", "buffer.curve.", "buffer.ingest_addr", "buffer.serve_addr",
            "learner.publish_addr", "learner.query_addr", "learner.push_addr", "learner.eval_engine_url",
            "learner.zero_stage", "learner.total_steps", "learner.checkpoint_every", "actors.num_actors",
            "actors.metrics_base_port")
# An ssh client's command line names the remote command, and nsenter's (how a command enters a host) the one it
# runs: neither is that component.
CLIENTS = ("ssh", "pdsh", "sshd", "nsenter")
GUARD = "-m common.remote "  # the guard a remote process runs under names it too: not that component either


def workload_overrides() -> list[str]:
    """``key=value`` for every setting in which the default workload differs from the cluster's config, but for
    the topology's: the default run (which learns) on the rehearsal's hosts."""
    def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out.update(flat(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {f"{prefix}{f.name}": v})
        return out
    ours, theirs = flat(load_config(ROOT / CONFIG)), flat(load_config(ROOT / WORKLOAD))
    if ours["learner.zero_stage"] == 3 and theirs["learner.value_head_surprise_source"] == "frozen_base":
        # A frozen base model is a whole copy on every rank, which the cluster's ZeRO-3 learner refuses: the
        # paper-trained critic reads its surprise features from the samples' behaviour log-probs instead.
        theirs["learner.value_head_surprise_source"] = "behaviour"
    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in theirs.items()
            if v != ours.get(k) and not k.startswith(TOPOLOGY)]


class ClusterView:
    """What the nemesis and the chaos run need of a live cluster: processes by component, hosts, faults."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        # The launchers started here: their Popen objects wait for them, so a host's restart must not reap them.
        self.launchers: set[int] = set()

    def components(self) -> dict[str, list[int]]:
        """Every host's run processes by component (engine, buffer, learner, actor, ...)."""
        out: dict[str, list[int]] = {}
        for h in self.cluster.hosts:
            for pid in self.cluster.run_pids(h):
                comp = "other" if self.cluster.comm(pid) in CLIENTS or GUARD in cmdline(pid) else kind(pid)
                out.setdefault(comp, []).append(pid)
        return out

    def engine_hosts(self) -> list[str]:
        """Hosts with an engine running now (a host that is down has none)."""
        return [h for h in self.cluster.hosts
                if h != HEAD and any(kind(p) == "engine" for p in self.cluster.run_pids(h))]

    def host_for(self, fault: str, rng: random.Random, checkpointed: bool) -> str | None:
        """The host a host fault hits: an engine host, or for a partition also the learner's once a
        checkpoint exists (its rank fails and the run stops); None when none can be hit now."""
        hosts = self.engine_hosts()
        if fault == "partition" and checkpointed:
            hosts.append(LEARNER_HOST)
        return rng.choice(sorted(hosts)) if hosts else None

    def host_down(self, host: str) -> int:
        return self.cluster.kill_host(host)

    def host_up(self, host: str) -> None:
        self.cluster.restart_host(host, own=frozenset(self.launchers))

    def link(self, host: str, up: bool) -> None:
        self.cluster.link(host, up)

    def start(self, args: list[str], log: Path, popen_kwargs: dict[str, Any]) -> subprocess.Popen:
        """``python -m ops.launch ARGS`` on the head host, output to ``log``; ``popen_kwargs`` give its
        environment (the cluster's ssh config included) and tie its life to ours."""
        with log.open("ab") as f:
            proc = self.cluster.popen(HEAD, [sys.executable, "-m", "ops.launch", *args], cwd=ROOT, stdout=f,
                                      stderr=subprocess.STDOUT, start_new_session=True, **popen_kwargs)
        self.launchers.add(proc.pid)
        return proc

    def leftovers(self) -> list[str]:
        """Each host's run processes still there (after a bounded wait for them to go)."""
        return [f"{h}: {cmd}" for h, cmds in leftovers(self.cluster).items() for cmd in cmds]


__all__ = ["CONFIG", "KINDS", "OVERRIDES", "ClusterView", "workload_overrides"]
