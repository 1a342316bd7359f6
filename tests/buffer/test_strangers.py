"""What a process that is not part of the run can do to the buffer: nothing. Groups a learner could not use
are refused at ingest with a final reason (never stored); without the run's keys a client gets no frame
through; with a key of the wrong role it may not take groups, move the learner version or take credit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from buffer.client import BatchClient
from common.config import CurveConfig
from common.protocol import (
    BatchRequest,
    CreditRequest,
    ErrorReply,
    SampleGroup,
    decode,
    encode,
)
from common.security import ClientKeys, apply_client_curve, client_curve_keys, generate_keypair
from tests.buffer.fixtures import BufferProc, SyncSender, make_group, make_sample, run_keys
from tests.polling import wait_for


def _poison(gid: str, **change: Any) -> SampleGroup:
    s = make_sample(reward=0.0, seed=3)
    for k, v in change.items():
        setattr(s, k, v)
    if "output_ids" in change:
        s.response_length = len(s.output_ids)
    return SampleGroup(group_id=gid, prompt_id="p", task="t", actor_id=0,
                       samples=[s, make_sample(reward=1.0, seed=4)], created_at=0.0)


@pytest.mark.timeout(120)
def test_groups_the_learner_cannot_use_are_refused_at_ingest_with_a_reason(tmp_path: Path) -> None:
    model = tmp_path / "model"  # the vocabulary and context come from the run's model
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 200, "max_position_embeddings": 64}))
    srv = BufferProc(tmp_path, [f"model.path={model}", "buffer.vocab_size=0", "actors.max_new_tokens=40",
                                "learner.batch_groups=1"]).start()
    poison = {
        "empty_prompt": _poison("e", prompt_ids=np.zeros(0, np.int32)),
        "empty_output": _poison("o", output_ids=np.zeros(0, np.int32), output_logprobs=np.zeros(0, np.float32)),
        "token_id": _poison("t", output_ids=np.array([5, 2**31 - 1], np.int32),
                            output_logprobs=np.array([-0.1, -0.2], np.float32)),
        "reward": _poison("r", reward=1e300),
        "logprob": _poison("l", output_logprobs=np.full(8, 3e38, np.float32)),
        "too_long": _poison("n", output_ids=np.arange(50, dtype=np.int32), output_logprobs=np.full(50, -1, np.float32)),
    }
    try:
        with SyncSender(srv.ingest_addr, 0, ack_timeout_s=2) as s, BatchClient(srv.serve_addr) as c:
            for reason, g in poison.items():
                ack = s.send(g, timeout_s=10)  # returns at once: a final refusal, not retried
                assert not ack.committed and ack.error.startswith(f"invalid:{reason}:"), (reason, ack)
            assert s.resent == 0
            # Prompt 60 + response 8 tokens > the model's 64 positions.
            long_prompt = _poison("c", prompt_ids=np.arange(60, dtype=np.int32))
            assert s.send(long_prompt, timeout_s=10).error.startswith("invalid:too_long:")
            assert s.send(make_group("good", seed=1), timeout_s=10).committed
            st = c.stats()
            assert st["invalid_total"] == 7 and st["invalid_too_long"] == 2 and st["invalid_token_id"] == 1, st
            assert st["depth_groups"] == 1 and st["accepted_groups"] == 1 and st["positives"] == 2, st
            assert [g.group_id for g in c.get_batch(0, 1, 5).groups] == ["good"]
    finally:
        srv.cleanup()


def _raw(ctx: zmq.Context, kind: int, addr: str, keys: ClientKeys | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.sndtimeo = 1000
    apply_client_curve(sock, keys)
    sock.connect(addr)
    return sock


def _ask(sock: zmq.Socket, frame: bytes, timeout_ms: int = 1000) -> Any:
    """The decoded answer to one frame, or None when none came (the connection never formed)."""
    try:
        sock.send(frame)
    except zmq.Again:
        return None
    return decode(sock.recv()) if sock.poll(timeout_ms) else None


@pytest.mark.timeout(180)
def test_strangers_cannot_take_groups_move_the_learner_version_or_hold_credit(tmp_path: Path) -> None:
    overrides, keys = run_keys(tmp_path / "keys")
    srv = BufferProc(tmp_path, [*overrides, "learner.batch_groups=4", "buffer.max_staleness=1"]).start()
    role = {r: client_curve_keys(CurveConfig(keys_dir=str(keys)), r) for r in ("actor", "learner", "monitor")}
    _, other_secret = generate_keypair(tmp_path / "other", "actor")  # named like an actor's, not authorised
    unknown = client_curve_keys(CurveConfig(client_secret_key=str(other_secret),
                                            server_public_key=str(keys / "server.key")))
    ctx = zmq.Context()
    try:
        assert srv.info["curve"] is True
        with SyncSender(srv.ingest_addr, 1, curve=role["actor"], ack_timeout_s=2) as actor:
            actor.send_many([make_group(f"v0-{i}", seed=i) for i in range(3)], timeout_s=10)
            # Strangers without a key of the run (none, or one the run never authorised): nothing gets through.
            for keys_ in (None, unknown):
                req = _raw(ctx, zmq.REQ, srv.serve_addr, keys_)
                assert _ask(req, encode(BatchRequest(learner_version=2, n_groups=1, timeout_ms=0))) is None
                req.close()
                for i in range(2):
                    dealer = _raw(ctx, zmq.DEALER, srv.ingest_addr, keys_)
                    assert _ask(dealer, encode(CreditRequest(actor_id=1000 + i, n=32)), 500) is None
                    dealer.close()
            # Keys of the run, wrong role: refused with reason "role".
            for r in ("actor", "monitor"):
                req = _raw(ctx, zmq.REQ, srv.serve_addr, role[r])
                ans = _ask(req, encode(BatchRequest(learner_version=2, n_groups=1, timeout_ms=0)), 5000)
                assert isinstance(ans, ErrorReply) and ans.reason == "role", ans
                req.close()
            for r in ("learner", "monitor"):
                dealer = _raw(ctx, zmq.DEALER, srv.ingest_addr, role[r])
                ans = _ask(dealer, encode(CreditRequest(actor_id=1000, n=32)), 5000)
                assert isinstance(ans, ErrorReply) and ans.reason == "role", ans
                ans = _ask(dealer, encode(make_group("sneak")), 5000)
                assert isinstance(ans, ErrorReply) and ans.reason == "role", ans
                dealer.close()
            with BatchClient(srv.serve_addr, curve=role["monitor"]) as probe:  # the launcher's health probe
                st = wait_for(lambda: (x := probe.stats())["auth_refused_serve"] >= 2
                              and x["auth_refused_ingest"] >= 4 and x, 20, "refused handshakes counted")
            assert st["learner_version"] == 0 and st["depth_groups"] == 3, st
            assert st["rejected_role"] == 6 and st["credit_outstanding"] == 0, st
            # The real actor and learner are unaffected: the one admissible credit (1 x 4 - 3 waiting) is the
            # actor's, and v0 groups are served at version 0. Which two: the first two to arrive, and send_many
            # sends concurrently (as an actor's loops do), so their order is not the list's.
            assert actor.acquire(1, timeout_s=10).n == 1
            with BatchClient(srv.serve_addr, curve=role["learner"]) as learner:
                served = learner.get_batch(0, 2, 5).groups
                ids = {g.group_id for g in served}
                assert len(ids) == 2 and ids <= {"v0-0", "v0-1", "v0-2"}, ids
                assert all(g.weight_version == 0 for g in served)
                assert learner.stats()["learner_version"] == 0
    finally:
        ctx.term()
        srv.cleanup()


def test_a_key_file_that_names_no_role_is_refused_at_start(tmp_path: Path) -> None:
    _, keys = run_keys(tmp_path / "keys")
    generate_keypair(keys / "authorized_clients", "client-0")
    srv = BufferProc(tmp_path, [f"buffer.curve.keys_dir={keys}"])
    with pytest.raises(AssertionError, match="must say its role"):
        srv.start()
    srv.cleanup()


@pytest.mark.timeout(60)
def test_a_stranger_reconnecting_again_and_again_is_logged_once_then_summarised(tmp_path: Path) -> None:
    overrides, keys = run_keys(tmp_path / "keys")
    srv = BufferProc(tmp_path, overrides).start()
    _, other_secret = generate_keypair(tmp_path / "other", "actor")
    unknown = client_curve_keys(CurveConfig(client_secret_key=str(other_secret),
                                            server_public_key=str(keys / "server.key")))
    ctx = zmq.Context()
    try:
        with BatchClient(srv.serve_addr, curve=client_curve_keys(CurveConfig(keys_dir=str(keys)), "monitor")) as probe:
            for i in range(20):  # each a new connection refused at the handshake
                dealer = _raw(ctx, zmq.DEALER, srv.ingest_addr, unknown)
                wait_for(lambda i=i: probe.stats()["auth_refused_ingest"] >= i + 1, 10, f"refusal {i + 1}")
                dealer.close()
        lines = [ln for ln in srv.log.read_text().splitlines() if "CurveZMQ handshake" in ln]
        # The first refusal at once; the other 19 within the minute wait for the summary line.
        assert len(lines) == 1 and "ingest socket: refused 1 connection(s)" in lines[0], lines
    finally:
        ctx.term()
        srv.cleanup()
