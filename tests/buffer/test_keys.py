"""``python -m buffer.keys``: key pairs per role, the authorized clients, no silent overwrite."""

from __future__ import annotations

from pathlib import Path

import pytest

from buffer.keys import main


def test_writes_a_pair_per_role_and_refuses_to_overwrite_without_force(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "keys"
    assert main([str(out), "--actors", "2"]) == 0
    for name in ("server", "actor", "learner", "monitor", "actor-0", "actor-1"):
        assert (out / f"{name}.key").is_file() and (out / f"{name}.key_secret").is_file()
    assert (out / "actor-1.key_secret").stat().st_mode & 0o077 == 0
    assert len(list((out / "authorized_clients").iterdir())) >= 5  # actor, learner, monitor, actor-0, actor-1
    assert f"buffer.curve.keys_dir={out}" in capsys.readouterr().out
    secret = (out / "learner.key_secret").read_bytes()
    assert main([str(out)]) == 2
    assert (out / "learner.key_secret").read_bytes() == secret
    assert main([str(out), "--force"]) == 0
    assert (out / "learner.key_secret").read_bytes() != secret


def test_a_negative_actor_count_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "k"), "--actors", "-1"])
    assert e.value.code == 2
