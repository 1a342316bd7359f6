"""Plain-urllib HTTP calls to a rollout server under test, and the message of SGLang's error bodies
(shared by the hostile-input and guard tests; no tests here)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


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
