"""actors.rollout_server.guard: the admin API key on the control endpoints (SGLang's 401 shape, the open
endpoints stay open), the body census that refuses a /generate body before it is parsed, and one warning
line per malformed request. An aiohttp app on a real loopback socket."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from actors.rollout_server.guard import (
    ADMIN_ENDPOINTS,
    BODY_SLACK,
    FEW_STRINGS,
    admin_auth_middleware,
    check_generate_body,
    quiet_protocol_errors,
)
from tests.actors.http_fixtures import serving

KEY = "k3y-for-this-test"


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"served": request.path})


def _requests(calls: list[tuple[str, dict[str, str]]]) -> tuple[list[tuple[int, object]], list[str]]:
    """Each (path, headers) posted to an app behind the admin middleware: (status, body) each, and the
    paths the middleware reported refused."""
    refused: list[str] = []

    async def go() -> list[tuple[int, object]]:
        app = web.Application(middlewares=[admin_auth_middleware(KEY, lambda r: refused.append(r.path))])
        for path in ["/generate", "/health", *ADMIN_ENDPOINTS]:
            app.router.add_post(path, _ok)
        out = []
        async with serving(app) as url, aiohttp.ClientSession() as session:
            for path, headers in calls:
                async with session.post(url + path, headers=headers) as r:
                    out.append((r.status, await r.json()))
        return out

    return asyncio.run(go()), refused


def test_control_endpoints_need_the_admin_key() -> None:
    bad = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY},
           {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer "}]
    answers, refused = _requests([("/pause_generation", h) for h in bad])
    assert answers == [(401, {"error": "Unauthorized"})] * len(bad)
    assert refused == ["/pause_generation"] * len(bad)


def test_the_right_key_passes_and_open_endpoints_need_none() -> None:
    good = {"Authorization": f"Bearer {KEY}"}
    calls = [(p, good) for p in sorted(ADMIN_ENDPOINTS)] + [("/update_weights_from_disk", {"Authorization": f"bearer {KEY}"}),
                                                            ("/generate", {}), ("/health", {})]
    answers, refused = _requests(calls)
    assert answers == [(200, {"served": p}) for p, _ in calls]
    assert refused == []


def test_admin_endpoints_are_sglangs_control_endpoints() -> None:
    assert {"/update_weights_from_disk", "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
            "/init_weights_update_group", "/update_weights_from_distributed",
            "/destroy_weights_update_group"} <= ADMIN_ENDPOINTS
    assert not {"/generate", "/model_info", "/health", "/health_generate", "/ready", "/metrics"} & ADMIN_ENDPOINTS


def _body(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_an_ordinary_generate_body_passes_the_census() -> None:
    body = _body({"input_ids": [[5, 6, 7], [8, 9]], "rid": ["a", "b"],
                  "sampling_params": [{"temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": [1, 2]}] * 2,
                  "return_logprob": True})
    assert check_generate_body(body, max_prompts=2, max_tokens=100) is None


def test_more_prompts_than_allowed_are_refused_before_parsing() -> None:
    max_prompts = 8
    arrays_cap = 4 * max_prompts + BODY_SLACK
    within = _body({"input_ids": [[1]] * (arrays_cap - 1)})  # the outer list is an array too
    assert check_generate_body(within, max_prompts, max_tokens=10**6) is None
    over = _body({"input_ids": [[1]] * arrays_cap})
    why = check_generate_body(over, max_prompts, max_tokens=10**6)
    assert why is not None and f"holds {arrays_cap + 1} JSON arrays" in why and "(8, --max-prompts-per-request)" in why


def test_more_tokens_than_the_queue_takes_are_refused_before_parsing() -> None:
    why = check_generate_body(_body({"input_ids": list(range(5000))}), max_prompts=4, max_tokens=1000)
    assert why is not None and "(1000, --max-queued-tokens)" in why
    assert check_generate_body(_body({"input_ids": list(range(900))}), max_prompts=4, max_tokens=1000) is None


@pytest.mark.parametrize("repeats", [300, 2 * FEW_STRINGS])  # string by string, and on an emptied copy
def test_brackets_and_commas_inside_strings_do_not_count(repeats: int) -> None:
    text = '[,"\\' * repeats  # escaped quotes and backslashes must not end the string early
    body = _body({"text": text, "rid": "x"})
    assert body.count(b"[") == repeats > 4 + BODY_SLACK  # over the cap until counted outside strings
    assert check_generate_body(body, max_prompts=1, max_tokens=10) is None
    outside = _body({"text": text, "input_ids": [[1]] * 300})
    assert check_generate_body(outside, max_prompts=1, max_tokens=10**6) is not None  # the real arrays still count


def test_a_rejected_request_is_one_warning_line_without_traceback() -> None:
    lg = logging.getLogger("aiohttp.server")
    filters_before = list(lg.filters)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    lg.addHandler(handler)
    try:
        quiet_protocol_errors()
        quiet_protocol_errors()
        assert sum(type(f).__name__ == "_OneLine" for f in lg.filters) == 1  # installed once
        try:
            raise ValueError("Invalid method encountered " + "x" * 500)
        except ValueError:
            lg.exception("Error handling request from %s", "10.1.2.3")
        lg.error("an unrelated error with %s", "args")
    finally:
        lg.removeHandler(handler)
        for f in list(lg.filters):
            if f not in filters_before:
                lg.removeFilter(f)
    first, second = records
    assert first.levelname == "WARNING" and first.exc_info is None
    assert first.getMessage().startswith("rejected a malformed request from 10.1.2.3: ValueError: Invalid method")
    assert len(first.getMessage()) < 300
    assert second.levelname == "ERROR" and second.getMessage() == "an unrelated error with args"
