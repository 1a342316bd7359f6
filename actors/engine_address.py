"""Where a worker's engine is (``engine_url``), the key its control endpoints take (``engine_api_key``),
and how SGLang's weight versions read as vapo's (``as_version``, defined in ``common.sglang_output``); used
by ``actors.engine_link`` and its parts (``actors.engine_supervisor``, ``actors.weight_follower``) and by the
worker before any startup work (a missing engine address fails at once)."""

from __future__ import annotations

import secrets
from pathlib import Path

from common.config import Config
from common.security import url_host
from common.sglang_output import as_version  # re-exported: the link's parts read versions through here


class EngineLinkError(RuntimeError):
    """No engine address for this actor (``engine.kind = external`` with too few ``engine.urls``)."""


def engine_url(cfg: Config, actor_id: int) -> str | None:
    """The URL of an engine vapo does not start itself (None for rollout_server: known once started)."""
    e = cfg.engine
    if e.kind == "external":
        if actor_id >= len(e.urls):
            raise EngineLinkError(f"engine.kind=external: engine.urls has {len(e.urls)} URLs, actor {actor_id} needs one")
        return e.urls[actor_id].rstrip("/")
    if e.kind == "sglang":
        return f"http://{url_host(e.host)}:{e.base_port + actor_id}"
    return None


def engine_api_key(cfg: Config) -> str:
    """The key this worker's engine requires on its control endpoints (weight updates, pause, continue,
    abort, flush; SGLang's ``--admin-api-key``): a fresh random one for our own rollout_server, the content
    of ``engine.admin_api_key_file`` for an engine started by someone else ('' without one: that engine
    takes anyone's control requests)."""
    if cfg.engine.kind == "rollout_server":
        return secrets.token_urlsafe(32)
    if not cfg.engine.admin_api_key_file:
        return ""
    try:
        return Path(cfg.engine.admin_api_key_file).read_text().strip()
    except OSError as e:
        raise EngineLinkError(f"engine.admin_api_key_file: cannot read {cfg.engine.admin_api_key_file}: {e}") from e


__all__ = ["EngineLinkError", "as_version", "engine_api_key", "engine_url"]
