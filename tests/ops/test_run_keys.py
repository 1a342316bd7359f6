"""The launcher gives every run its own CurveZMQ keys when the config names none (every socket of the run then
authenticates its clients, loopback included), keeps them on --resume, and leaves keys it did not make alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from common.config import load_config
from common.security import SecurityError, client_curve_keys, generate_keypair, server_keys
from ops import launch

ROOT = Path(__file__).resolve().parents[2]


def test_the_launcher_writes_per_run_keys_with_roles_and_private_modes(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=k"])
    keys = launch.ensure_run_keys(cfg)
    assert keys == tmp_path / "k" / "keys" and cfg.buffer.curve.keys_dir == str(keys)
    assert keys.stat().st_mode & 0o777 == 0o700
    for role in ("server", "actor", "learner", "monitor"):
        assert (keys / f"{role}.key_secret").stat().st_mode & 0o777 == 0o600
    srv = server_keys(cfg.buffer.curve)
    # One actor (the default): the shared actor pair and actor 0's own, bound to actor id 0.
    assert srv is not None and sorted(srv.roles.values()) == ["actor", "actor", "learner", "monitor"]
    own = client_curve_keys(cfg.buffer.curve, "actor", 0)
    assert own is not None and srv.actor_ids == {own.public.decode(): 0}
    monitor = client_curve_keys(cfg.buffer.curve, "monitor")
    assert monitor is not None and srv.roles[monitor.public.decode()] == "monitor"
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        launch._apply_client_curve(sock, cfg)  # the health probe: the monitor key, not an actor's or the learner's
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
    finally:
        sock.close(0)
    with pytest.raises(SecurityError, match="must name its role"):
        client_curve_keys(cfg.buffer.curve)  # with a keys directory, no client can go without a role
    before = (keys / "learner.key_secret").read_bytes()
    again = load_config(None, [f"run.root={tmp_path}", "run.name=k"])
    assert launch.ensure_run_keys(again) == keys and (keys / "learner.key_secret").read_bytes() == before  # --resume
    # Resumed with a second actor: actor 0 keeps its key, actor 1 gets one of its own.
    wider = load_config(None, [f"run.root={tmp_path}", "run.name=k", "actors.num_actors=2"])
    launch.ensure_run_keys(wider)
    srv = server_keys(wider.buffer.curve)
    assert srv is not None and sorted(srv.actor_ids.values()) == [0, 1] and srv.actor_ids[own.public.decode()] == 0


def test_keys_named_in_the_config_are_used_as_they_are(tmp_path: Path) -> None:
    pub, _ = generate_keypair(tmp_path / "mine", "server")
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=k", f"buffer.curve.server_public_key={pub}"])
    assert launch.ensure_run_keys(cfg) is None and cfg.buffer.curve.keys_dir == ""
    assert not (tmp_path / "k" / "keys").exists()
