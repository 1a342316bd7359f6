"""Where the distributed weight push listens on host 0 (``learner.weight_transport=distributed``), checked
before anything starts: by the plan (``common.placement.build_plan``, what ``ops/launch.sh --dry-run``
prints) and by learner rank 0 before its value pretraining (``learner.runner``).

Learner rank 0 binds ``learner.push_addr`` (the actors' ROUTER) and listens on
``learner.push_master_address:push_master_port`` (the weight group's TCP store, ``common.weight_bucket``)
on host 0. An address host 0 does not have used to fail only there, after value pretraining (hours at
paper scale), with "Cannot assign requested address". The store has no authentication: off loopback it
needs a fixed port and the ``placement.store_protection`` statement.

    push_store_problem(cfg)                      # None, or why the store may not listen so
    check_push_addresses(cfg, remote_engines)    # ConfigError naming the key
"""

from __future__ import annotations

import socket

from common.config import Config, ConfigError
from common.security import endpoint_host, is_loopback_host

WILDCARDS = ("", "*", "0.0.0.0", "::", "[::]")


def push_store_problem(cfg: Config) -> str | None:
    """What is wrong with where the weight group's store listens (``learner.push_master_address`` and
    ``push_master_port``: torch's TCP store, no authentication), or None; the plan and learner rank 0 refuse
    it. Loopback is this host's business; any other address needs a fixed port (a free one differs at every
    group: no firewall rule can name it) and the ``placement.store_protection`` statement."""
    lc = cfg.learner
    addr = lc.push_master_address.strip()
    if lc.weight_transport != "distributed" or is_loopback_host(addr):
        return None
    if addr in WILDCARDS:
        return (f"learner.push_master_address: {addr!r} is no address the engines can connect to: give learner rank "
                "0's host's address on their network")
    if lc.push_master_port == 0:
        return (f"learner.push_master_port: 0 (a free port, another at every group) with learner.push_master_address="
                f"{addr}: the weight group's unauthenticated store would listen on a port no firewall rule can name; "
                "set a fixed port, e.g. 29501")
    if not cfg.placement.store_protection:
        return (f"placement.store_protection: the weight group's store listens on {addr}:{lc.push_master_port} without "
                "authentication; say how that port is protected (firewall | private_network)")
    return None


def _resolve(host: str) -> set[str]:
    try:
        return {str(ai[4][0]) for ai in socket.getaddrinfo(host.strip("[]"), None)}
    except (OSError, UnicodeError):
        return set()


def _bindable(ip: str) -> bool:
    """Whether this machine has the address ``ip`` (a socket can be bound to it)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def _on_host0(h0: str) -> bool:
    """Whether this plan is made on host 0, as the launcher's is: host 0's addresses are then this machine's."""
    if h0 == "localhost" or h0.split(".")[0] == socket.gethostname().split(".")[0]:
        return True
    return any(not is_loopback_host(ip) and _bindable(ip) for ip in _resolve(h0))


def check_push_addresses(cfg: Config, remote_engines: bool) -> None:
    """learner.weight_transport=distributed: learner rank 0 binds ``learner.push_addr`` and listens on
    ``learner.push_master_address`` on host 0, the first after its value pretraining (hours at scale), where
    an address host 0 does not have fails ("Cannot assign requested address"): refused here instead. On host 0
    (the launcher's) an address counts when this machine can bind it; elsewhere when it is host 0's name or
    resolves to one of its addresses."""
    lc, h0 = cfg.learner, cfg.placement.hosts[0]
    if lc.weight_transport != "distributed":
        return
    problem = push_store_problem(cfg)
    if problem:
        raise ConfigError(problem)
    here = _on_host0(h0)
    push_host = endpoint_host(lc.push_addr) if lc.push_addr.startswith("tcp://") else ""  # ipc://: host 0's own
    for key, host in (("learner.push_addr", push_host), ("learner.push_master_address", lc.push_master_address.strip())):
        if host in WILDCARDS:
            continue  # every interface of host 0
        ips = _resolve(host)
        if not (any(_bindable(ip) for ip in ips) if here else host.lower() == h0.lower() or ips & _resolve(h0)):
            raise ConfigError(f"{key}: {host} is not an address of host 0 ({h0}), where learner rank 0 binds it once "
                              "value pretraining is over; give host 0's address on the engines' network (a shipped "
                              "placeholder must be replaced: ops/slurm/vapo.sbatch derives it)")
        if here and remote_engines and all(is_loopback_host(ip) for ip in ips):
            raise ConfigError(f"{key}: {host} is loopback on host 0 ({', '.join(sorted(ips))}; Debian's /etc/hosts maps a "
                              "host's own name so), unreachable from the engines on other hosts: give its cluster address")


__all__ = ["WILDCARDS", "check_push_addresses", "push_store_problem"]
