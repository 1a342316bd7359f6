"""The chaos run's cluster view on a real rehearsal cluster (four network namespaces with sshd and Slurm):
processes on the hosts are found by component (ssh clients and remote guards are not the component their
command line names), and the nemesis's host faults take a host down or off the network and bring it back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.chaos.cluster import ClusterView
from ops.chaos.nemesis import Nemesis, Target
from ops.chaos.procs import alive
from ops.rehearsal.cluster import Cluster, missing_prerequisites
from tests.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0 or bool(missing_prerequisites()),
                                                   reason="needs root and the rehearsal's packages")]
SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(keep=tmp_path_factory.mktemp("daemons")) as c:
        yield c


def _start(c: Cluster, host: str, *words: str) -> subprocess.Popen:
    """A process on ``host`` that only sleeps, with ``words`` in its command line (what names a component)."""
    return c.popen(host, [*SLEEP, *words], cwd=Path.cwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _pid_on_host(c: Cluster, host: str, word: str) -> int:
    """The host's pid (as seen here) of the process started with ``word``: nsenter --pid forks it."""
    found: list[int] = []

    def look() -> bool:
        found[:] = [p for p in c.run_pids(host) if word in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                    and c.comm(p) != "nsenter"]
        return bool(found)
    wait_for(look, 20, f"{word} on {host}")
    return found[0]


def _nemesis(kind: str, view: ClusterView, run_dir: Path) -> tuple[Nemesis, threading.Thread]:
    now = time.time()
    n = Nemesis(seed=0, interval_s=0.05, t0=now, until=now + 120, kinds=(kind,))
    n.target = Target(0, run_dir, [], cluster=view)
    thread = threading.Thread(target=n.run, daemon=True)
    thread.start()
    return n, thread


def _fake_run(c: Cluster, tmp_path: Path) -> list[subprocess.Popen]:
    """A buffer and learner on h0, an engine and actor on h2 and h3 (one under a remote guard), all asleep."""
    procs = [_start(c, "h0", "-m buffer x"), _start(c, "h0", "-m learner x")]
    for h in ("h2", "h3"):
        procs += [_start(c, h, "-m actors.rollout_server x", h), _start(c, h, "-m actors x", h)]
    procs.append(_start(c, "h3", "-m common.remote --timeout 5 -- python -m actors.rollout_server guarded"))
    (tmp_path / "weights" / "v1").mkdir(parents=True)
    (tmp_path / "weights" / "v1" / "STABLE").write_text("")  # a published version: the nemesis may start
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_components_on_every_host_and_a_host_taken_down_then_back(cluster: Cluster, tmp_path: Path) -> None:
    procs = _fake_run(cluster, tmp_path)
    try:
        view = ClusterView(cluster)
        engine_h2 = _pid_on_host(cluster, "h2", "actors.rollout_server")
        guard = _pid_on_host(cluster, "h3", "guarded")
        wait_for(lambda: len(view.components().get("engine", [])) == 2, 20, "both engines")
        comps = view.components()
        assert {k: len(v) for k, v in comps.items() if k != "other"} == {"buffer": 1, "learner": 1, "engine": 2,
                                                                       "actor": 2}
        assert guard in comps["other"] and engine_h2 in comps["engine"]
        assert view.engine_hosts() == ["h2", "h3"]
        n, thread = _nemesis("host_down", view, tmp_path)
        wait_for(lambda: n.faults, 30, "the host fault")
        victim = n.faults[0]["host"]
        assert n.faults[0]["kind"] == "host_down" and victim in ("h2", "h3")
        wait_for(lambda: not cluster.run_pids(victim), 20, f"every run process of {victim} gone")
        assert not any(cluster.comm(p) == "sshd" for p in cluster.pids(victim))  # its daemons died with it
        n.stop.set()  # the undo runs at once: the host comes back
        thread.join(10)
        n.wait_undone(90)
        assert cluster.run("h0", ["ssh", "-F", str(cluster.ssh_config), victim, "hostname"],
                           timeout=30).stdout.strip() == victim
        other = "h3" if victim == "h2" else "h2"
        assert view.engine_hosts() == [other]  # the victim's engine is not back by itself: the launcher restarts it
    finally:
        _stop(procs)


def test_a_partition_cuts_a_hosts_link_and_heals_it(cluster: Cluster, tmp_path: Path) -> None:
    procs = _fake_run(cluster, tmp_path)
    try:
        view = ClusterView(cluster)
        wait_for(lambda: len(view.engine_hosts()) == 2, 20, "both engine hosts")
        n, thread = _nemesis("partition", view, tmp_path)
        wait_for(lambda: n.faults, 30, "the partition")
        victim = n.faults[0]["host"]
        assert victim in ("h2", "h3")  # no checkpoint yet: never the learner's host
        # sshd's port on the victim, from h0 (no ping in the image)
        ping = ["python3", "-c", f"import socket; socket.create_connection(('{victim}', 22), 2).close()"]
        assert cluster.run("h0", ping, timeout=10).returncode != 0
        assert all(alive(p.pid) for p in procs)  # cut off, not killed
        n.stop.set()
        thread.join(10)
        n.wait_undone(30)
        wait_for(lambda: cluster.run("h0", ping, timeout=10).returncode == 0, 30, f"{victim} reachable again")
    finally:
        _stop(procs)
