"""Request bodies of ``actors.rollout_server``: read within size and time limits, parsed as JSON without
quadratic integer conversions, and SGLang's error response shapes (``http.py`` uses these)."""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from common.generation.sampling import RequestError, short_repr

log = logging.getLogger("vapo.rollout_server")

MAX_INT_DIGITS = 30  # no field takes an integer this long; longer ones are parsed as _HugeInt, never int()


class BadRequest(Exception):
    """Request body that does not validate (SGLang: pydantic RequestValidationError)."""


class HttpError(Exception):
    """A request refused before it is parsed: body too large (413), too slow (408), undecodable (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _HugeInt:
    """An integer literal too long to be any field's value; converting it would cost quadratic time (or hit
    Python's 4300-digit limit). Field checks see a non-int and name the field."""

    def __init__(self, digits: str) -> None:
        self.n_digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<integer of {self.n_digits} digits>"


def _parse_int(digits: str) -> int | _HugeInt:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else _HugeInt(digits)


def error_response(status: int, message: str) -> web.Response:
    """SGLang's ErrorResponse shape for HTTPExceptions (type = the status code as a string)."""
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return web.json_response(body, status=status)


def validation_error(message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


def value_error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


async def _read_body(request: web.Request) -> bytes:
    """The request body within the size limit (413) and read deadline (408); undecodable
    Content-Encoding (a bad gzip stream) is a 400."""
    limit = request.app["max_body_bytes"]
    if request.content_length is not None and request.content_length > limit:
        raise HttpError(413, f"request body: {request.content_length} bytes is more than the server accepts "
                             f"({limit}, --max-body-bytes)")
    try:
        return await asyncio.wait_for(request.read(), request.app["read_timeout_s"])
    except TimeoutError:
        raise HttpError(408, f"request body: not received within {request.app['read_timeout_s']} s "
                             "(--http-read-timeout-s)") from None
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, f"request body: more than the server accepts ({limit} bytes, --max-body-bytes)") from None
    except (RequestPayloadError, HttpProcessingError, zlib.error, EOFError, OSError, ValueError) as e:
        raise HttpError(400, f"request body: cannot decode it (Content-Encoding "
                             f"{request.headers.get('Content-Encoding', 'identity')!r}): {short_repr(str(e), 200)}") from None


async def json_body(request: web.Request, required: bool = True,
                     check: Callable[[bytes], str | None] | None = None) -> dict[str, Any]:
    """The body as a JSON object; ``check(raw)`` may refuse it (RequestError) before it is parsed."""
    raw = await _read_body(request)
    if check is not None and (why := check(raw)) is not None:
        raise RequestError(why)
    if not raw.strip():
        if required:
            raise BadRequest("Field required: request body is empty")
        return {}
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise BadRequest("JSON decode error: the body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"JSON decode error: {short_repr(str(e), 200)}") from None
    except ValueError as e:  # e.g. an exponent float past the float range
        raise BadRequest(f"JSON decode error: {short_repr(str(e), 200)}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"Input should be a JSON object, got {type(body).__name__}")
    return body


def check_text(value: Any, field: str) -> None:
    """A client string must be valid Unicode: a lone surrogate ("\\ud800") passes json.loads but no
    tokenizer or encoder accepts it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{field}: Input should be a valid string (lone surrogate at position "
                         f"{_first_surrogate(value)})") from None


def _first_surrogate(s: str) -> int:
    return next((i for i, c in enumerate(s) if 0xD800 <= ord(c) <= 0xDFFF), -1)


def is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """HttpError -> its status with SGLang's error body; any other exception -> a logged 500 that names it
    (no traceback to the client), and the server keeps serving."""
    try:
        return await handler(request)
    except HttpError as e:
        return error_response(e.status, str(e))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}")
