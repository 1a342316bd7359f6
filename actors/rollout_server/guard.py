"""Request guards of ``actors.rollout_server`` that run before a request's JSON becomes Python objects.

- **Admin API key** (``--admin-api-key``, SGLang's flag of that name): the control endpoints
  (``ADMIN_ENDPOINTS``: weight updates (disk and distributed, the update group and its session), pause, continue, abort, cache flush; SGLang marks the same ones
  ``AuthLevel.ADMIN_OPTIONAL``) need ``Authorization: Bearer <key>``; without it the answer is SGLang's
  ``401 {"error": "Unauthorized"}``. ``/generate``, ``/model_info``, ``/health*``, ``/ready`` and
  ``/metrics`` stay open, as in SGLang with only ``--admin-api-key`` set.
- **Body census** (``check_generate_body``): the number of JSON arrays and of value separators in a
  body, counted outside strings at C speed, bound the prompts and values a request can hold. A /generate body with more
  prompts than ``--max-prompts-per-request`` or more values than any admissible request could carry is
  refused before ``json.loads`` builds millions of small objects (seconds of a blocked event loop and
  gigabytes of memory for a 27 MiB body of one-token prompts).
- **One log line per rejected malformed request**: aiohttp logs each request its HTTP parser rejects
  with a full traceback at ERROR; ``quiet_protocol_errors`` turns those into one WARNING line each.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from typing import Any

from aiohttp import web

ADMIN_ENDPOINTS = frozenset({"/update_weights_from_disk", "/pause_generation", "/continue_generation",
                             "/abort_request", "/flush_cache", "/init_weights_update_group",
                             "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
                             "/destroy_weights_update_group", "/weights_digest"})
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# Values a /generate request may carry besides its prompt tokens, per array it holds (each prompt's
# sampling_params object has ~20 fields, a stop_token_ids list, a rid and flags) and for the top level.
VALUES_PER_ARRAY = 64
FEW_STRINGS = 4096
BODY_SLACK = 256

log = logging.getLogger("vapo.rollout_server")


def _outside_strings(raw: bytes, ch: bytes, total: int) -> int:
    """How many of the ``total`` ``ch`` bytes of a JSON body lie outside its strings: string by string
    when there are few (no copy of the body), else on a copy with every string emptied."""
    if raw.count(b'"') > 2 * FEW_STRINGS:
        return _STRING.sub(b'""', raw).count(ch)
    for m in _STRING.finditer(raw):
        total -= raw.count(ch, m.start(), m.end())
    return total


def check_generate_body(raw: bytes, max_prompts: int, max_tokens: int) -> str | None:
    """Why this /generate body cannot be admissible (None when it might be). Every prompt is an array, so
    arrays bound the prompts; every token but the first of a prompt follows a separator, so separators
    beyond what the arrays' other fields can use are prompt tokens, and a request whose prompt tokens
    alone pass ``max_tokens`` (the queue bound) is refused after parsing anyway. Plain byte counts are
    upper bounds; only a count over its bound is redone outside strings."""
    arrays_cap = 4 * max_prompts + BODY_SLACK  # input_ids, stop_token_ids, rid and flag lists per prompt
    arrays = raw.count(b"[")
    if arrays > arrays_cap:
        arrays = _outside_strings(raw, b"[", arrays)
        if arrays > arrays_cap:
            return (f"The request holds {arrays} JSON arrays: more prompts than the server takes in one "
                    f"request ({max_prompts}, --max-prompts-per-request).")
    values_cap = max_tokens + VALUES_PER_ARRAY * arrays + BODY_SLACK
    seps = raw.count(b",")
    if seps > values_cap and _outside_strings(raw, b",", seps) > values_cap:
        return (f"The request holds more than {values_cap} values: more prompt tokens than the server "
                f"queues ({max_tokens}, --max-queued-tokens).")
    return None


def _bearer_ok(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def admin_auth_middleware(admin_api_key: str, on_refused: Callable[[web.Request], None]) -> Any:
    """SGLang's admin-key check for ``ADMIN_ENDPOINTS`` (constant-time comparison)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.path in ADMIN_ENDPOINTS and not _bearer_ok(request.headers.get("Authorization"), admin_api_key):
            on_refused(request)
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return middleware


class _OneLine(logging.Filter):
    """aiohttp.server's 'Error handling request' records: one line naming the error, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            peer = ""
            if isinstance(record.args, tuple) and record.args:
                peer = f" from {record.args[0]}"
            record.msg = f"rejected a malformed request{peer}: {type(e).__name__}: {str(e)[:200]}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_protocol_errors() -> None:
    """Install the one-line filter on aiohttp's server logger (idempotent)."""
    lg = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLine) for f in lg.filters):
        lg.addFilter(_OneLine())
