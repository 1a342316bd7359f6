"""common.security on its own: endpoint hosts, key roles by file name, key loading and its errors (each
names what is missing), a run's generated key set, and the role a real CURVE client is served as.
(tests/buffer/test_security.py covers the bind rule and the buffer's refusals end to end.)"""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest
import zmq
import zmq.auth

from common.config import CurveConfig
from common.security import (
    HANDSHAKE_FAILED,
    ROLES,
    RefusalLog,
    SecurityError,
    ServerCurve,
    apply_client_curve,
    client_curve_keys,
    close_monitor,
    endpoint_host,
    generate_keypair,
    generate_run_keys,
    is_loopback_host,
    key_actor_id,
    key_role,
    open_monitor,
    server_curve,
    server_keys,
    url_host,
)


@pytest.mark.parametrize("addr, host", [("tcp://127.0.0.1:5555", "127.0.0.1"), ("tcp://[::1]:7", "::1"),
                                        ("tcp://eth0;192.0.2.2:5555", "192.0.2.2"), ("tcp://*:1", "*"),
                                        ("tcp://node-3.cluster:99", "node-3.cluster")])
def test_endpoint_host(addr: str, host: str) -> None:
    assert endpoint_host(addr) == host


def test_endpoint_host_refuses_other_transports() -> None:
    with pytest.raises(ValueError, match="not a tcp endpoint"):
        endpoint_host("ipc:///tmp/sock")


@pytest.mark.parametrize("host, loopback", [("localhost", True), ("127.0.0.1", True), ("127.255.0.9", True),
                                            ("[::1]", True), ("::1", True), ("0.0.0.0", False), ("*", False),
                                            ("10.0.0.1", False), ("localhost.example.com", False)])
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("name, role", [("actor.key", "actor"), ("actor-3.key", "actor"), ("learner", "learner"),
                                        ("monitor-a.key", "monitor"), ("actors.key", None), ("server.key", None),
                                        ("x-actor.key", None), ("learner_1.key", None)])
def test_key_role_is_the_file_name(name: str, role: str | None) -> None:
    assert key_role(name) == role


def test_generate_run_keys_writes_private_secrets_and_keeps_them_on_a_second_call(tmp_path: Path) -> None:
    d = generate_run_keys(tmp_path / "keys", actors=2)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    names = ["server", *ROLES, "actor-0", "actor-1"]
    for name in names:
        assert (d / f"{name}.key").is_file()
        assert stat.S_IMODE((d / f"{name}.key_secret").stat().st_mode) == 0o600
    assert sorted(p.name for p in (d / "authorized_clients").iterdir()) == sorted(f"{n}.key" for n in names[1:])
    before = {n: (d / f"{n}.key_secret").read_bytes() for n in names}
    generate_run_keys(d, actors=2)  # a resumed run keeps its keys
    assert {n: (d / f"{n}.key_secret").read_bytes() for n in names} == before


def test_server_keys_from_keys_dir_map_each_client_key_to_its_role(tmp_path: Path) -> None:
    d = generate_run_keys(tmp_path / "keys", actors=1)
    keys = server_keys(CurveConfig(keys_dir=str(d)))
    assert keys is not None and keys.authorized_dir == d / "authorized_clients"
    by_role = sorted(keys.roles.values())
    assert by_role == ["actor", "actor", "learner", "monitor"]
    learner_public = (d / "learner.key").read_text()
    assert any(k in learner_public and r == "learner" for k, r in keys.roles.items())
    assert server_keys(CurveConfig()) is None  # nothing configured: no CURVE


def test_server_key_errors_name_what_is_wrong(tmp_path: Path) -> None:
    d = generate_run_keys(tmp_path / "keys")
    with pytest.raises(SecurityError, match="authorized_clients_dir is empty"):
        server_keys(CurveConfig(server_secret_key=str(d / "server.key_secret")))
    with pytest.raises(SecurityError, match="server_secret_key is empty"):
        server_keys(CurveConfig(authorized_clients_dir=str(d / "authorized_clients")))
    with pytest.raises(SecurityError, match=r"server.key holds no secret key \(use the .key_secret file\)"):
        server_keys(CurveConfig(server_secret_key=str(d / "server.key"), authorized_clients_dir=str(d / "authorized_clients")))
    (d / "broken.key_secret").write_text("not a certificate\n")
    with pytest.raises(SecurityError, match="cannot read key file .*broken.key_secret"):
        server_keys(CurveConfig(server_secret_key=str(d / "broken.key_secret"),
                                authorized_clients_dir=str(d / "authorized_clients")))
    generate_keypair(d / "authorized_clients", "stranger")
    with pytest.raises(SecurityError, match="stranger.key: its file name must say its role"):
        server_keys(CurveConfig(keys_dir=str(d)))


def test_client_keys_by_role_and_their_errors(tmp_path: Path) -> None:
    d = generate_run_keys(tmp_path / "keys")
    keys = client_curve_keys(CurveConfig(keys_dir=str(d)), "learner")
    assert keys is not None and keys.public in (d / "learner.key").read_bytes()
    assert keys.server_public in (d / "server.key").read_bytes()
    with pytest.raises(SecurityError, match="a client must name its role"):
        client_curve_keys(CurveConfig(keys_dir=str(d)), "")
    with pytest.raises(SecurityError, match="both curve.client_secret_key and curve.server_public_key"):
        client_curve_keys(CurveConfig(server_public_key=str(d / "server.key")))
    with pytest.raises(SecurityError, match="not found .*python -m buffer.keys DIR"):
        client_curve_keys(CurveConfig(client_secret_key=str(d / "nobody.key_secret"), server_public_key=str(d / "server.key")))
    assert client_curve_keys(CurveConfig(), "actor") is None


@pytest.mark.timeout(60)
def test_a_curve_client_is_served_as_the_role_of_its_key(tmp_path: Path) -> None:
    d = generate_run_keys(tmp_path / "keys")
    cfg = CurveConfig(keys_dir=str(d))
    ctx = zmq.Context()
    sec = server_curve(ctx, ["tcp://127.0.0.1:0"], cfg)
    server = ctx.socket(zmq.ROUTER)
    clients = []
    try:
        assert sec.enabled
        sec.apply(server)
        server.bind("tcp://127.0.0.1:0")
        addr = server.getsockopt_string(zmq.LAST_ENDPOINT)
        for role in ("monitor", "actor"):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            apply_client_curve(sock, client_curve_keys(cfg, role))
            sock.connect(addr)
            sock.send(role.encode())
            clients.append(sock)
        seen = {}
        for _ in range(2):
            assert server.poll(30_000), "no message from an authorised client"
            frames = server.recv_multipart(copy=False)
            seen[frames[1].bytes.decode()] = sec.role(frames[1].get("User-Id"))
        assert seen == {"monitor": "monitor", "actor": "actor"}
        assert sec.role(None) is None and sec.role("not-a-key") is None
    finally:
        for sock in clients:
            sock.close()
        server.close(linger=0)
        sec.stop()
        ctx.term()


def test_a_monitor_endpoint_is_unique_even_where_a_descriptor_named_one_is_still_bound() -> None:
    # pyzmq names a monitor endpoint after the socket's descriptor; a closed socket's endpoint can outlive the
    # descriptor, which the next socket gets again.
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PAIR)
    sock = ctx.socket(zmq.ROUTER)
    try:
        squatter.bind(f"inproc://monitor.s-{sock.FD}")
        mon = open_monitor(sock, HANDSHAKE_FAILED)
        close_monitor(sock, mon)
    finally:
        for s in (sock, squatter):
            s.close(linger=0)
        ctx.term()


def test_monitored_sockets_closed_with_close_monitor_are_released() -> None:
    # A socket closed while its monitor still runs is never reaped: its context cannot terminate (a server's
    # shutdown hangs) and runs out of its 1023 sockets after a few hundred monitored ones. (Fewer than the
    # limit here: closed sockets are reaped asynchronously, and a loop can outrun the reaper on a busy host.)
    ctx = zmq.Context()
    for _ in range(200):
        sock = ctx.socket(zmq.ROUTER)
        close_monitor(sock, open_monitor(sock, zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED))
        sock.close(linger=0)
    term = threading.Thread(target=ctx.term, daemon=True)
    term.start()
    term.join(30)
    assert not term.is_alive(), "the context still holds sockets closed a while ago"


@pytest.mark.parametrize("name, actor_id", [("actor-3.key", 3), ("actor-0", 0), ("actor.key", None),
                                            ("actor-a.key", None), ("actor-3x.key", None), ("learner-1.key", None),
                                            ("actor-99999999.key", None)])
def test_key_actor_id_is_the_number_in_an_actor_keys_name(name: str, actor_id: int | None) -> None:
    assert key_actor_id(name) == actor_id


def test_per_actor_keys_bind_their_actor_id_and_actors_pick_their_own(tmp_path: Path) -> None:
    d = generate_run_keys(tmp_path / "keys", actors=2)
    keys = server_keys(CurveConfig(keys_dir=str(d)))
    assert keys is not None
    curve = ServerCurve(keys, None)
    z85 = {n: zmq.auth.load_certificate(str(d / f"{n}.key"))[0].decode() for n in ("actor", "actor-0", "actor-1")}
    assert sorted(keys.actor_ids.values()) == [0, 1] and keys.actor_ids[z85["actor-1"]] == 1
    assert curve.actor_refusal(z85["actor-1"], 1) is None
    assert "actor 1's" in (curve.actor_refusal(z85["actor-1"], 0) or "")  # not for another id
    assert "key of its own" in (curve.actor_refusal(z85["actor"], 0) or "")  # the shared key: not for a bound id
    assert curve.actor_refusal(z85["actor"], 5) is None  # an id without a key of its own
    assert ServerCurve(None, None).actor_refusal(None, 0) is None  # no CurveZMQ: no binding
    # Actor 1 loads its own pair; an actor without one (id 7) the shared pair.
    cfg = CurveConfig(keys_dir=str(d))
    for actor_id, name in ((1, "actor-1"), (7, "actor")):
        ck = client_curve_keys(cfg, "actor", actor_id)
        assert ck is not None and ck.public.decode() == z85[name]
    # Two files binding the same id (a copy under another name) are refused at start.
    (d / "authorized_clients" / "actor-01.key").write_bytes((d / "actor-0.key").read_bytes())
    with pytest.raises(SecurityError, match="already bound"):
        server_keys(CurveConfig(keys_dir=str(d)))


def test_refusal_log_writes_the_first_refusal_then_one_summary_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    log = logging.getLogger("test.refusals")
    rl = RefusalLog(log, "ingest socket", interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        # A stranger reconnecting every 100 ms for 3 minutes: 1800 refusals, one loop turn each.
        for i in range(1800):
            rl.note(1, now=i * 0.1)
        rl.note(0, now=200.0)  # quiet since: the pending count still comes out once its interval is over
        rl.note(0, now=300.0)  # nothing pending: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # first at 0 s, summaries at 60, 120 and 200 s
    assert "refused 1 connection(s)" in lines[0]
    assert "refused 600 more" in lines[1] and "refused 600 more" in lines[2]
    assert "refused 599 more" in lines[3] and "(1800 in all)" in lines[3]


def test_url_host_brackets_ipv6_addresses_only() -> None:
    assert [url_host(h) for h in ("::", "::1", "[::1]", "127.0.0.1", "node-3")] == [
        "[::]", "[::1]", "[::1]", "127.0.0.1", "node-3"]
