"""actors.engine_address: where each engine kind's engine is for actor i, the admin key its control
endpoints take, and how SGLang's weight versions read as vapo's integers."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine_address import EngineLinkError, as_version, engine_api_key, engine_url
from common.config import load_config


def test_each_engine_kind_is_found_where_it_runs() -> None:
    ext = load_config(None, ["engine.kind=external", "engine.urls=[http://a:1/,http://b:2]"])
    assert [engine_url(ext, i) for i in (0, 1)] == ["http://a:1", "http://b:2"]  # trailing slash dropped
    with pytest.raises(EngineLinkError, match="engine.urls has 2 URLs, actor 2 needs one"):
        engine_url(ext, 2)
    sgl = load_config(None, ["engine.kind=sglang", "engine.host=10.0.0.5", "engine.base_port=31000",
                             "engine.bind_protection=firewall"])
    assert engine_url(sgl, 3) == "http://10.0.0.5:31003"  # base_port + actor id
    v6 = load_config(None, ["engine.kind=sglang", "engine.host=::1", "engine.base_port=31000"])
    assert engine_url(v6, 0) == "http://[::1]:31000"  # an IPv6 host in brackets
    assert engine_url(load_config(None, ["engine.kind=rollout_server"]), 0) is None  # known once started


def test_the_admin_key_is_fresh_for_our_engine_and_read_from_the_file_for_anothers(tmp_path: Path) -> None:
    ours = load_config(None, ["engine.kind=rollout_server"])
    a, b = engine_api_key(ours), engine_api_key(ours)
    assert a != b and len(a) >= 40  # 32 random bytes, url-safe base64: a new one per worker
    key = tmp_path / "admin.key"
    key.write_text("s3cret\n")
    theirs = load_config(None, ["engine.kind=sglang", f"engine.admin_api_key_file={key}"])
    assert engine_api_key(theirs) == "s3cret"  # the file's content, stripped
    assert engine_api_key(load_config(None, ["engine.kind=sglang"])) == ""  # none: the engine takes anyone's
    missing = load_config(None, ["engine.kind=external", "engine.urls=[http://a:1]",
                                 f"engine.admin_api_key_file={tmp_path / 'nope'}"])
    with pytest.raises(EngineLinkError, match="engine.admin_api_key_file: cannot read"):
        engine_api_key(missing)


@pytest.mark.parametrize(("served", "version"), [("7", 7), (7, 7), ("default", 0), (None, 0), ("-3", 0), ("2.5", 0)])
def test_sglang_versions_read_as_non_negative_integers(served: object, version: int) -> None:
    assert as_version(served) == version
