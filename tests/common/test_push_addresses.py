"""Where the distributed weight push listens, checked by the plan (``ops/launch.sh --dry-run`` included).

Learner rank 0 binds ``learner.push_addr`` and the weight group's store (``learner.push_master_address``)
on host 0 only after value pretraining: a placeholder address used to pass every check and fail there,
hours in, with "Cannot assign requested address". The store has no authentication: off loopback it needs a
fixed port and the ``placement.store_protection`` statement.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from common import push_addresses
from common.config import ConfigError, load_config
from common.placement import build_plan
from common.push_addresses import push_store_problem
from tests.common.placement_fixtures import QWEN_7B, QWEN_32B

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("pdsh_on_path")

NOT_HERE = "198.51.100.7"  # TEST-NET-2: never an address of this machine
STORE_OK = ["learner.push_master_port=29501", "placement.store_protection=private_network"]


def _plan(name: str, hf: dict | None, *overrides: str):
    cfg = load_config(ROOT / "ops" / "configs" / name, list(overrides))
    return build_plan(cfg, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=hf)


def _own_address() -> str | None:
    """A non-loopback address of this machine (the interface of its route out; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


@pytest.mark.parametrize("key,value", [("learner.push_master_address", "10.0.0.1"),
                                       ("learner.push_addr", "tcp://10.0.0.1:5559")])
def test_paper_with_a_placeholder_push_address_is_refused_at_plan_time(key: str, value: str) -> None:
    """paper.yaml used to ship 10.0.0.1 here, and its documented command and vapo.sbatch left it: this plan is
    made off host 0 (node0 does not resolve here), so only host 0's name or its addresses pass."""
    with pytest.raises(ConfigError, match=rf"^{key}: 10\.0\.0\.1 is not an address of host 0 \(node0\)"):
        _plan("paper.yaml", QWEN_32B, f"{key}={value}")
    plan = _plan("paper.yaml", QWEN_32B)  # as shipped: host 0 by the name placement.hosts gives it
    assert plan.proc("learner").host == "node0"


def test_on_host_0_an_address_counts_when_this_machine_has_it() -> None:
    """The launcher plans on host 0: there, an address is host 0's when a socket can be bound to it."""
    with pytest.raises(ConfigError, match=rf"^learner.push_master_address: {NOT_HERE} is not an address of host 0 "
                                          r"\(localhost\)"):
        _plan("gpu-node8.yaml", QWEN_7B, f"learner.push_master_address={NOT_HERE}", *STORE_OK)
    with pytest.raises(ConfigError, match=rf"^learner.push_addr: {NOT_HERE} is not an address"):
        _plan("default.yaml", None, "learner.weight_transport=distributed", f"learner.push_addr=tcp://{NOT_HERE}:5559")
    _plan("default.yaml", None, "learner.weight_transport=distributed")  # loopback, a free port: one host's affair
    _plan("default.yaml", None, f"learner.push_master_address={NOT_HERE}")  # disk transport: never bound
    own = _own_address()
    if own is not None:
        _plan("gpu-node8.yaml", QWEN_7B, f"learner.push_master_address={own}", f"learner.push_addr=tcp://{own}:5559",
              *STORE_OK)


@pytest.mark.parametrize("overrides,match", [
    ([], r"^learner.push_master_port: 0 \(a free port"),
    (["learner.push_master_port=29501"], rf"^placement.store_protection: the weight group's store listens on {NOT_HERE}:29501"),
    (["learner.push_master_address=0.0.0.0"], r"^learner.push_master_address: '0.0.0.0' is no address the engines"),
])
def test_the_weight_groups_store_off_loopback_needs_a_fixed_port_and_a_protection_statement(
        overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _plan("default.yaml", None, "learner.weight_transport=distributed", f"learner.push_master_address={NOT_HERE}",
              *overrides)
    with pytest.raises(ConfigError, match=r"^learner.push_master_port: 0"):  # paper.yaml's fixed port is needed
        _plan("paper.yaml", QWEN_32B, "learner.push_master_port=0")


def test_push_store_problem_is_none_for_loopback_and_for_the_disk_transport() -> None:
    assert push_store_problem(load_config(None, ["learner.weight_transport=distributed"])) is None
    assert push_store_problem(load_config(None, [f"learner.push_master_address={NOT_HERE}"])) is None
    problem = push_store_problem(load_config(None, ["learner.weight_transport=distributed",
                                                    f"learner.push_master_address={NOT_HERE}"]))
    assert problem is not None and problem.startswith("learner.push_master_port: 0")


def test_a_host_0_name_that_is_loopback_on_host_0_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's /etc/hosts maps a host's own name to 127.0.1.1: on node0 itself "node0" binds loopback, which
    the engines on node6 and node7 cannot reach."""
    monkeypatch.setattr(push_addresses, "_on_host0", lambda h0: True)
    monkeypatch.setattr(push_addresses, "_resolve", lambda host: {"127.0.1.1"} if host == "node0" else {"10.1.0.7"})
    monkeypatch.setattr(push_addresses, "_bindable", lambda ip: True)
    with pytest.raises(ConfigError, match=r"^learner.push_addr: node0 is loopback on host 0 \(127\.0\.1\.1"):
        _plan("paper.yaml", QWEN_32B)
    _plan("paper.yaml", QWEN_32B, "learner.push_addr=tcp://10.1.0.7:5559", "learner.push_master_address=10.1.0.7")
