"""actors.rollout_server.body: request bodies read within the size limit (413) and the read deadline (408),
undecodable encodings a 400, JSON parsed without converting huge integers, and SGLang's error shapes; the
error middleware keeps tracebacks from clients. An aiohttp app on a real loopback socket."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from actors.rollout_server.body import (
    MAX_INT_DIGITS,
    BadRequest,
    HttpError,
    check_text,
    errors_middleware,
    is_int_list,
    json_body,
    validation_error,
    value_error,
)
from common.generation.sampling import RequestError
from tests.actors.http_fixtures import serving

LIMIT = 1000
READ_TIMEOUT_S = 0.5


def _refuse_forbidden(raw: bytes) -> str | None:
    return "the word is forbidden" if b"forbidden" in raw else None


async def _echo(request: web.Request) -> web.Response:
    """The parsed body's values as their repr, or the error response http.py gives each refusal."""
    try:
        body = await json_body(request, required=request.query.get("required") != "0", check=_refuse_forbidden)
    except BadRequest as e:
        return validation_error(str(e))
    except RequestError as e:
        return value_error(str(e))
    return web.json_response({k: repr(v) for k, v in body.items()})


async def _boom(request: web.Request) -> web.Response:
    if request.query.get("kind") == "http":
        raise HttpError(409, "a refusal of our own")
    raise RuntimeError("a detail the client must not see")


def _app(limit: int) -> web.Application:
    app = web.Application(client_max_size=limit, middlewares=[errors_middleware])
    app["max_body_bytes"] = limit
    app["read_timeout_s"] = READ_TIMEOUT_S
    app.router.add_post("/echo", _echo)
    app.router.add_post("/boom", _boom)
    return app


def _post(path: str, data: Any = None, headers: dict[str, str] | None = None, limit: int = LIMIT) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with serving(_app(limit)) as url, aiohttp.ClientSession() as session:
            async with session.post(url + path, data=data, headers=headers or {}) as r:
                return r.status, await r.json(content_type=None)
    return asyncio.run(go())


def test_a_json_object_is_parsed_and_a_huge_integer_is_never_converted() -> None:
    digits = "9" * (MAX_INT_DIGITS + 1)
    raw = f'{{"n": {"1" * MAX_INT_DIGITS}, "big": {digits}, "neg": -{digits}, "x": [1.5]}}'
    status, body = _post("/echo", raw)
    assert status == 200
    assert body == {"n": "1" * MAX_INT_DIGITS, "big": f"<integer of {MAX_INT_DIGITS + 1} digits>",
                    "neg": f"<integer of {MAX_INT_DIGITS + 1} digits>", "x": "[1.5]"}


def test_a_declared_length_over_the_limit_is_a_413_in_sglangs_shape() -> None:
    status, body = _post("/echo", b"{" + b" " * LIMIT + b"}")
    assert status == 413
    assert body["object"] == "error" and body["type"] == "413" and body["code"] == 413 and body["param"] is None
    assert f"{LIMIT + 2} bytes is more than the server accepts ({LIMIT}, --max-body-bytes)" in body["message"]


def test_a_chunked_body_over_the_limit_is_a_413() -> None:
    async def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(5):
            yield b" " * 400

    status, body = _post("/echo", chunks())
    assert status == 413 and "--max-body-bytes" in body["message"]


def test_an_undecodable_gzip_body_is_a_400() -> None:
    status, body = _post("/echo", b"this is not gzip", headers={"Content-Encoding": "gzip"})
    assert status == 400 and body["code"] == 400
    assert "request body: cannot decode it (Content-Encoding 'gzip')" in body["message"]


def test_a_body_that_stops_arriving_is_a_408_after_the_read_deadline() -> None:
    async def go() -> bytes:
        async with serving(_app(LIMIT)) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"a\": ")  # 6 of the 100 bytes, then nothing
            await writer.drain()
            try:
                return await asyncio.wait_for(reader.read(4096), 20)
            finally:
                writer.close()

    head, _, body = asyncio.run(go()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert f"not received within {READ_TIMEOUT_S} s (--http-read-timeout-s)" in json.loads(body)["message"]


@pytest.mark.parametrize("raw, message", [
    ("", "Field required: request body is empty"),
    ("[1, 2]", "Input should be a JSON object, got list"),
    ('{"a": ', "JSON decode error: "),
    ("[" * 100_000 + "]" * 100_000, "JSON decode error: the body is nested too deeply"),
    (b'{"a": "\xff"}', "JSON decode error: "),
])
def test_malformed_bodies_are_sglangs_validation_errors(raw: str | bytes, message: str) -> None:
    status, body = _post("/echo", raw if isinstance(raw, bytes) else raw.encode(), limit=1 << 20)
    assert status == 400 and body["type"] == "Bad Request" and body["message"].startswith(message), body


def test_an_empty_body_is_an_empty_object_where_none_is_required() -> None:
    assert _post("/echo?required=0", b"  ") == (200, {})


def test_the_check_refuses_before_parsing_with_a_value_error() -> None:
    status, body = _post("/echo", b'{"text": "forbidden", ')  # malformed too: the check comes first
    assert status == 400 and body == {"error": {"message": "the word is forbidden"}}


def test_unexpected_errors_are_a_500_that_names_only_the_type() -> None:
    status, body = _post("/boom")
    assert status == 500 and body["message"] == "internal error: RuntimeError"
    assert "must not see" not in json.dumps(body)
    status, body = _post("/boom?kind=http")
    assert status == 409 and body["message"] == "a refusal of our own" and body["type"] == "409"


def test_check_text_refuses_a_lone_surrogate_by_position() -> None:
    check_text("fine ✓", "text")
    with pytest.raises(BadRequest, match=r"text: Input should be a valid string \(lone surrogate at position 3\)"):
        check_text("abc\ud800", "text")


def test_is_int_list() -> None:
    assert is_int_list([1, 2, -3]) and is_int_list([])
    assert not is_int_list([1, True]) and not is_int_list([1.0]) and not is_int_list((1, 2)) and not is_int_list("12")
