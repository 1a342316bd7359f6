"""A smoke run that a poison sender and a stranger attack at its start still finishes: the three kinds of
protocol-valid group that each used to end a run (empty prompt, token id 2^31-1, reward 1e300 with logprob
3e38) are refused at ingest even from a holder of actor 0's own key (sent as actor 0, so the refusal is the
bounds', not the key binding's), and a process without the run's keys
can neither move the learner version nor take credit."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from buffer.client import BatchClient
from common.config import CurveConfig, load_config
from common.protocol import BatchRequest, CreditRequest, SampleGroup, encode
from common.security import client_curve_keys
from tests.buffer.fixtures import SyncSender, make_sample
from tests.polling import wait_for
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]


def _poison() -> list[SampleGroup]:
    empty, big_id, huge = make_sample(seed=1), make_sample(seed=2), make_sample(seed=3)
    empty.prompt_ids = np.zeros(0, np.int32)
    big_id.output_ids = big_id.output_ids.copy()
    big_id.output_ids[0] = 2**31 - 1
    huge.reward = 1e300
    huge.output_logprobs = np.full(len(huge.output_ids), 3e38, np.float32)
    return [SampleGroup(group_id=f"poison-{i}", prompt_id="p", task="addition", actor_id=0, samples=[s],
                        created_at=0.0) for i, s in enumerate((empty, big_id, huge))]


def _attack(cfg: Any, keys: Path, out: dict[str, Any]) -> None:
    curve = CurveConfig(keys_dir=str(keys))
    with BatchClient(cfg.buffer.serve_addr, curve=client_curve_keys(curve, "monitor"), request_timeout_s=2) as probe:
        wait_for(lambda: _stats(probe), 300, "the run's buffer")
        ctx = zmq.Context()
        try:
            for kind, addr, frame in ((zmq.REQ, cfg.buffer.serve_addr, BatchRequest(learner_version=2, n_groups=1,
                                                                                      timeout_ms=0)),
                                      *((zmq.DEALER, cfg.buffer.ingest_addr, CreditRequest(actor_id=1000 + i, n=32))
                                        for i in range(2))):
                s = ctx.socket(kind)
                s.linger, s.sndtimeo = 0, 1000
                s.connect(addr)
                try:
                    s.send(encode(frame))
                    out.setdefault("stranger_answers", []).append(bool(s.poll(1000)))
                except zmq.Again:
                    out.setdefault("stranger_answers", []).append(False)
                s.close()
        finally:
            ctx.term()
        # Actor 0's own key: the shared actor key may act for no actor id and would be refused as actor_key.
        with SyncSender(cfg.buffer.ingest_addr, 0, curve=client_curve_keys(curve, "actor", 0), ack_timeout_s=5) as s:
            out["acks"] = [s.send(g, timeout_s=60) for g in _poison()]
        out["stats"] = wait_for(lambda: (x := _stats(probe)) is not None and x["auth_refused_serve"] >= 1
                                and x["auth_refused_ingest"] >= 2 and x, 30, "the strangers counted")


def _stats(c: BatchClient) -> dict[str, float] | None:
    try:
        return c.stats()
    except TimeoutError:
        return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_smoke_run_attacked_at_its_start_finishes(tmp_path: Path) -> None:
    overrides = [f"run.root={tmp_path}", "run.name=poison", *port_overrides()]
    cfg = load_config(ROOT / "ops/configs/smoke.yaml", overrides)
    run_dir = tmp_path / "poison"
    proc = subprocess.Popen([str(ROOT / "ops/launch.sh"), "ops/configs/smoke.yaml", *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: dict[str, Any] = {}
    wait_for(lambda: (run_dir / "keys" / "authorized_clients").is_dir(), 120, "the run's keys")
    attacker = threading.Thread(target=_attack, args=(cfg, run_dir / "keys", out), daemon=True)
    attacker.start()
    log, _ = proc.communicate(timeout=840)
    attacker.join(timeout=60)
    assert proc.returncode == 0, log[-4000:]
    assert out["stranger_answers"] == [False, False, False]
    assert [a.error.split(":")[:2] for a in out["acks"]] == [["invalid", "empty_prompt"], ["invalid", "token_id"],
                                                             ["invalid", "reward"]]
    assert not any(a.committed for a in out["acks"])
    st = out["stats"]
    assert st["invalid_total"] == 3 and st.get("rejected_role", 0) == 0, st
    assert "FAILED" not in log
