"""The weight-update group on its own terms: never a split of the learner's communicator, no NCCL watchdog
of its own that could end the learner, a failed wait that aborts it and lets the caller go on, and a store
that listens on one address at a fixed port.

NCCL cannot run here: what torch is handed when it creates an NCCL group (the default group's bound device,
``TORCH_NCCL_BLOCKING_WAIT``) is checked with torch's creation helper replaced, and the abort with a fake
group; gloo runs for real, with a member in a process of its own that is killed mid-push.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from common import weight_bucket
from common.ports import free_port
from common.weight_bucket import BLOCKING_WAIT, master_store, new_group, seed_nccl_env

REPO = Path(__file__).resolve().parents[2]
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def bound_default_group() -> Iterator[Any]:
    """A default group bound to a device, as ``learner.dist`` binds a CUDA learner's (torch accepts the
    binding on a CPU build: it is a plain field until a collective runs). A learner built in-process by an
    earlier test leaves its default group up (DeepSpeed keeps a handle to it): that one is bound for the test
    and given its old binding back, rather than failing on a second ``init_process_group``."""
    ours = not torch.distributed.is_initialized()
    if ours:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    default = c10d._get_default_group()
    before = default.bound_device_id
    default.bound_device_id = CUDA0
    try:
        yield default
    finally:
        default.bound_device_id = before
        if ours:
            torch.distributed.destroy_process_group()


class FakeNcclGroup:
    """What ``Group`` asks of an NCCL process group, for the parts that need a GPU."""

    def __init__(self, split_from: Any = None) -> None:
        self.aborted = 0
        self.options = type("Options", (), {"split_from": split_from})()

    def _get_backend(self, device: torch.device) -> Any:
        return self

    def abort(self) -> None:
        self.aborted += 1


def fake_helper(seen: dict[str, Any], pg: Any) -> Any:
    """torch's ``_new_process_group_helper`` replaced: records what it would see, returns ``pg``."""

    def helper(*args: Any, **kw: Any) -> tuple[Any, None]:
        default = c10d._get_default_group() if torch.distributed.is_initialized() else None
        seen["bound"] = default.bound_device_id if default is not None else "no default group"
        seen["blocking_wait"] = os.environ.get(BLOCKING_WAIT)
        seen["backend"] = str(args[3])
        return pg, None

    return helper


def test_the_weight_group_is_never_split_from_a_bound_default_group(bound_default_group: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """torch splits every new group from a default group bound to a device (``ncclCommSplit``, collective
    over all learner ranks: rank 0 alone would wait in it). Creating the weight group must not even look
    for a split source, and the learner's binding is back afterwards."""
    looked: list[Any] = []
    monkeypatch.setattr(c10d, "_get_split_source", lambda pg: looked.append(pg))
    real_helper = c10d._new_process_group_helper
    seen: dict[str, Any] = {}

    def helper(*args: Any, **kw: Any) -> Any:
        seen["bound"] = c10d._get_default_group().bound_device_id
        return real_helper(*args, **kw)

    monkeypatch.setattr(c10d, "_new_process_group_helper", helper)
    store = master_store("127.0.0.1", 0, 1, timeout_s=30)
    group = new_group("gloo", "127.0.0.1", store.port, 0, 1, group_name="split_test", timeout_s=30, store=store)
    try:
        assert looked == [] and seen["bound"] is None
        assert bound_default_group.bound_device_id == CUDA0
        buf = torch.arange(8, dtype=torch.uint8)
        group.broadcast(buf)  # the group works
        assert buf.tolist() == list(range(8))
    finally:
        group.close()


def test_an_nccl_weight_group_is_created_unbound_and_without_a_watchdog(bound_default_group: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_NCCL_BLOCKING_WAIT=1 while torch constructs the group's ProcessGroupNCCL (which reads it then):
    no watchdog thread, whose error handling would end the learner; the process's setting is back after."""
    monkeypatch.setenv(BLOCKING_WAIT, "0")
    seen: dict[str, Any] = {}
    fake = FakeNcclGroup()
    monkeypatch.setattr(c10d, "_new_process_group_helper", fake_helper(seen, fake))
    group = new_group("nccl", "127.0.0.1", 0, 0, 2, group_name="nccl_flags", timeout_s=5,
                      store=torch.distributed.HashStore())
    assert seen == {"bound": None, "blocking_wait": "1", "backend": "nccl"}
    assert os.environ[BLOCKING_WAIT] == "0" and bound_default_group.bound_device_id == CUDA0
    assert group.backend == "nccl" and c10d._world.pg_group_ranks.pop(fake) == {0: 0, 1: 1}
    # gloo groups (CPU engines, a CPU learner) are created as before: no NCCL setting at all
    seen.clear()
    monkeypatch.setattr(c10d, "_new_process_group_helper", fake_helper(seen, object()))
    new_group("gloo", "127.0.0.1", 0, 0, 2, group_name="gloo_flags", timeout_s=5, store=torch.distributed.HashStore())
    assert seen["blocking_wait"] == "0" and seen["bound"] is None


def test_a_failed_nccl_wait_aborts_the_group_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broadcast that timed out or lost a member: the group's communicators are aborted (a dead member
    never completes them, and an orderly shutdown would wait for them) and the caller gets the error."""
    fake = FakeNcclGroup()
    group = weight_bucket.Group(fake, object(), 0, 2, "g", 0.1, backend="nccl")

    class Stuck:
        def wait(self, timeout: Any) -> bool:
            assert timeout.total_seconds() == pytest.approx(0.1)
            raise RuntimeError("Work timed out in blocking wait")

    with pytest.raises(RuntimeError, match="timed out"):
        group.wait(Stuck())
    assert fake.aborted == 1 and group.pg is None and group.store is None
    group.close()  # the caller's close afterwards: nothing left to end
    assert fake.aborted == 1


def test_a_group_torch_would_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNcclGroup(split_from=object())
    monkeypatch.setattr(c10d, "_new_process_group_helper", fake_helper({}, fake))
    with pytest.raises(RuntimeError, match="split"):
        new_group("nccl", "127.0.0.1", 0, 0, 2, group_name="split_refused", timeout_s=5,
                  store=torch.distributed.HashStore())
    assert fake.aborted == 1


def test_seed_nccl_env_keeps_what_the_process_has() -> None:
    env: dict[str, str] = {}
    seed_nccl_env(env)
    assert env == {BLOCKING_WAIT: "0"}  # torch's default, now a variable that exists
    env = {"NCCL_BLOCKING_WAIT": "1"}  # the old name: torch reads it when the new one is absent
    seed_nccl_env(env)
    assert env[BLOCKING_WAIT] == "1"
    env = {BLOCKING_WAIT: "1"}
    seed_nccl_env(env)
    assert env == {BLOCKING_WAIT: "1"}


def test_the_store_listens_on_its_address_only_at_the_port_given() -> None:
    """torch's own store server listens on every interface; the weight group's listens on the address the
    engines are told (here 127.0.0.1: another loopback address of this host is refused)."""
    port = free_port()
    store = master_store("127.0.0.1", port, 1, timeout_s=10)
    assert store.port == port
    store.set("k", b"v")
    assert store.get("k") == b"v"
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    with pytest.raises(OSError) as busy:  # the port is the store's while it lives
        master_store("127.0.0.1", port, 1, timeout_s=10)
    assert busy.value.errno == errno.EADDRINUSE and "127.0.0.1" in str(busy.value)
    del store
    again = master_store("127.0.0.1", port, 1, timeout_s=10)  # gone with the store: free again
    assert again.port == port
    with pytest.raises(ValueError, match="one address"):
        master_store("0.0.0.0", 0, 1, timeout_s=10)


MEMBER = textwrap.dedent("""
    import sys
    import torch
    from common.weight_bucket import new_group

    port, name = int(sys.argv[1]), sys.argv[2]
    print("READY", flush=True)  # imports done: joining takes rank 0's timeout, not torch's import time
    group = new_group("gloo", "127.0.0.1", port, 1, 2, name, timeout_s=20)
    buf = torch.zeros(4, dtype=torch.uint8)
    group.broadcast(buf)
    print("GOT", buf.tolist(), flush=True)
    sys.stdin.readline()  # the test decides when this member goes (killed, or told to leave)
    group.close()
""")


def _member(tmp_path: Path, port: int, name: str) -> subprocess.Popen[str]:
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    return subprocess.Popen([sys.executable, str(script), str(port), name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_member_killed_mid_push_costs_rank_0_a_bounded_wait_and_the_port_serves_the_next_group(
        tmp_path: Path) -> None:
    """gloo, for real: rank 0 broadcasts to a member in its own process, the member is killed, rank 0's next
    broadcast fails within the group's timeout and rank 0 goes on; the next group listens at the same
    fixed port (learner.push_master_port) once the failed one is closed."""
    port = free_port()
    for round_, name in enumerate(("wg_1", "wg_2")):
        store = master_store("127.0.0.1", port, 2, timeout_s=20)
        member = _member(tmp_path, port, name)
        try:
            assert member.stdout is not None and member.stdout.readline().strip() == "READY"
            group = new_group("gloo", "127.0.0.1", port, 0, 2, name, timeout_s=4, store=store)
            group.broadcast(torch.tensor([1, 2, 3, round_], dtype=torch.uint8))
            assert member.stdout.readline().split() == ["GOT", "[1,", "2,", "3,", f"{round_}]"]
            if round_ == 0:
                member.kill()
                member.wait(10)
                t0 = time.monotonic()
                with pytest.raises(RuntimeError):
                    for _ in range(3):  # the first send may still be buffered by the kernel
                        group.broadcast(torch.zeros(1 << 20, dtype=torch.uint8))
                assert time.monotonic() - t0 < 3 * 4 + 5
            else:
                assert member.stdin is not None
                member.stdin.write("\n")
                member.stdin.flush()
            group.close()
            del store
            assert member.wait(20) in (0, -9)
        finally:
            if member.poll() is None:
                member.kill()
                member.wait(10)
