"""Plain-urllib HTTP calls to a rollout server under test, the message of SGLang's error bodies, and an
aiohttp app served on a real loopback socket in the test's own event loop (shared by the rollout server's
tests; no tests here)."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web


def call(url: str, path: str, payload: Any = None, raw: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else None)
    req = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body) if body else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return status, body.decode(errors="replace")


def message(body: Any) -> str:
    """The message of either SGLang error shape."""
    if isinstance(body, dict):
        err = body.get("error")
        return str(err["message"] if isinstance(err, dict) else body.get("message"))
    return str(body)


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` listening on a free loopback port for the block; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()
        sock.close()
