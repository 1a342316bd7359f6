"""The SGLang API contract vapo relies on: one scripted conversation with an engine, recorded, and the checks
that hold an engine's records to those captured from the real server.

    python -m ops.sglang_cpu.contract capture   # start real SGLang 0.5.23 on the CPU (ops/setup.sh --sglang),
                                                # run the conversation, rewrite tests/actors/fixtures/sglang_api.json

``conversation(url, admin_key, weights_dir, running)`` sends the same requests to any engine (real SGLang, or
``actors.rollout_server``) and returns ``{step: {"request", "status", "body" | "text"}}``. ``violations(records,
reference)`` lists where an engine's records break the contract of the reference (the captured fixture):
the same status for every step; every field vapo reads (``READ_FIELDS``) present with the same JSON type;
the same message where vapo or an operator acts on the message (``SAME_MESSAGE``). ``tests/actors/
test_sglang_contract.py`` runs it against rollout_server and, where SGLang is installed, the live server;
``tests/common/test_sglang_client.py`` replays the captured fixture to vapo's client.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.sglang_cpu.live import REPO, LiveSGLang

FIXTURE = REPO / "tests" / "actors" / "fixtures" / "sglang_api.json"
LONG = 200  # tokens of the request that is running while the engine is paused in place

# Fields of each step's JSON body that vapo reads (dotted; "0." = first list element).
READ_FIELDS: dict[str, tuple[str, ...]] = {
    "generate_single": ("output_ids", "meta_info.id", "meta_info.finish_reason.type", "meta_info.prompt_tokens",
                        "meta_info.completion_tokens", "meta_info.weight_version", "meta_info.output_token_logprobs",
                        "meta_info.weight_versions.0.version", "meta_info.weight_versions.0.start",
                        "meta_info.weight_versions.0.end"),
    "generate_batched": ("0.output_ids", "0.meta_info.finish_reason.type", "0.meta_info.weight_version",
                         "0.meta_info.output_token_logprobs", "0.meta_info.prompt_tokens"),
    "error_value_error": ("error.message",),
    "error_validation": ("message",),
    "model_info": ("weight_version", "model_path"),
    "update_weights_from_disk_ok": ("success", "message"),
    "update_weights_from_disk_failed": ("success", "message"),
    "update_weights_from_disk_flush_refused": ("success", "message"),
    "begin_weight_update_ok": ("success", "message"),
    "begin_weight_update_twice": ("success", "message"),
    "end_weight_update_ok": ("success", "message"),
    "end_weight_update_without_session": ("success", "message"),
    "update_weights_from_distributed_outside_session": ("success", "message"),
    "unauthorized": ("error",),
}
# Steps whose message must be the real server's, word for word: vapo matches on it, or it is the operator's clue.
SAME_MESSAGE = ("error_value_error", "begin_weight_update_twice", "end_weight_update_without_session",
                "update_weights_from_distributed_outside_session", "update_weights_from_disk_flush_refused",
                "unauthorized")


def _call(url: str, method: str, path: str, body: Any, key: str | None, timeout_s: float = 120.0) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    rec: dict[str, Any] = {"request": {"method": method, "path": path, "body": body}, "status": status}
    text = raw.decode(errors="replace")
    try:
        rec["body"] = json.loads(text)
    except ValueError:
        rec["text"] = text
    return rec


def running_requests(url: str) -> int:
    """Requests the engine's scheduler is running: SGLang's ``sglang:num_running_reqs`` gauge, or
    rollout_server's ``/get_server_info``."""
    info = _call(url, "GET", "/get_server_info", None, None, 10)
    if info["status"] == 200 and isinstance(info.get("body"), dict) and "running_requests" in info["body"]:
        return int(info["body"]["running_requests"])
    text = _call(url, "GET", "/metrics", None, None, 10).get("text", "")
    for line in text.splitlines():
        if line.startswith("sglang:num_running_reqs{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def _paused_in_place(url: str, key: str, steps: dict[str, Any], weights_dir: Path,
                     running: Callable[[str], int]) -> None:
    """A long request running, the engine paused in place: the flush is refused, and so is the flush after a
    disk update, which SGLang answers 400 with the weights written."""
    box: dict[str, Any] = {}
    long_body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.update(r=_call(url, "POST", "/generate", long_body, None)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while running(url) < 1:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the long request finished or never ran before the engine could be paused")
        time.sleep(0.02)
    steps["pause_in_place"] = _call(url, "POST", "/pause_generation", {"mode": "in_place"}, key)
    steps["flush_cache_refused"] = _call(url, "POST", "/flush_cache", None, key)
    steps["update_weights_from_disk_flush_refused"] = _call(
        url, "POST", "/update_weights_from_disk", {"model_path": str(weights_dir), "weight_version": "10"}, key)
    steps["continue_generation"] = _call(url, "POST", "/continue_generation", {}, key)
    t.join(120)
    steps["generate_spanning_update"] = box.get("r", {"status": None})


def conversation(url: str, admin_key: str, weights_dir: Path,
                 running: Callable[[str], int] = running_requests) -> dict[str, Any]:
    """Every step, in order, against the engine at ``url`` (started with ``admin_key`` and
    ``--weight-version 0``); ``weights_dir`` is a loadable checkpoint of the served model."""
    k = admin_key
    s: dict[str, Any] = {}
    s["health_ok"] = _call(url, "GET", "/health", None, None)
    s["model_info"] = _call(url, "GET", "/model_info", None, None)
    s["generate_single"] = _call(url, "POST", "/generate", {
        "input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 2}, "return_logprob": True}, None)
    s["generate_batched"] = _call(url, "POST", "/generate", {
        "input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "stop_token_ids": [], "n": 2}},
        None)
    s["error_value_error"] = _call(url, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"top_p": 1.5}}, None)
    s["error_validation"] = _call(url, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": 5}, None)
    s["unauthorized"] = _call(url, "POST", "/pause_generation", {"mode": "abort"}, None)
    s["update_weights_from_disk_ok"] = _call(url, "POST", "/update_weights_from_disk", {
        "model_path": str(weights_dir), "weight_version": "8", "abort_all_requests": False}, k)
    s["update_weights_from_disk_failed"] = _call(url, "POST", "/update_weights_from_disk", {
        "model_path": str(weights_dir / "missing"), "weight_version": "9"}, k)
    s["pause_generation"] = _call(url, "POST", "/pause_generation", {"mode": "abort"}, k)
    s["continue_generation_after_abort"] = _call(url, "POST", "/continue_generation", {}, k)
    s["update_weights_from_distributed_outside_session"] = _call(url, "POST", "/update_weights_from_distributed", {
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "never_made",
        "load_format": "flattened_bucket"}, k)
    s["begin_weight_update_ok"] = _call(url, "POST", "/begin_weight_update", {}, k)
    s["begin_weight_update_twice"] = _call(url, "POST", "/begin_weight_update", {}, k)
    s["end_weight_update_ok"] = _call(url, "POST", "/end_weight_update", {}, k)
    s["end_weight_update_without_session"] = _call(url, "POST", "/end_weight_update", {}, k)
    s["flush_cache_ok"] = _call(url, "POST", "/flush_cache", None, k)
    _paused_in_place(url, k, s, weights_dir, running)
    return s


def _field(body: Any, dotted: str) -> tuple[bool, Any]:
    cur = body
    for part in dotted.split("."):
        if isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return False, None
    return True, cur


def _json_type(v: Any) -> str:
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__


def _message(rec: dict[str, Any]) -> Any:
    body = rec.get("body")
    if isinstance(body, dict):
        err = body.get("error")
        return err.get("message") if isinstance(err, dict) else err if err is not None else body.get("message")
    return rec.get("text")


def violations(records: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """Where ``records`` break the contract of ``reference`` (both from ``conversation``); empty when none."""
    out: list[str] = []
    for step, ref in reference.items():
        if not isinstance(ref, dict) or "status" not in ref:
            continue  # _about and other notes
        rec = records.get(step)
        if rec is None:
            out.append(f"{step}: not recorded")
            continue
        if rec["status"] != ref["status"]:
            out.append(f"{step}: status {rec['status']}, the real server answers {ref['status']}")
        for f in READ_FIELDS.get(step, ()):
            ok_ref, v_ref = _field(ref.get("body"), f)
            ok, v = _field(rec.get("body"), f)
            if ok_ref and not ok:
                out.append(f"{step}: no field {f}")
            elif ok_ref and _json_type(v) != _json_type(v_ref):
                out.append(f"{step}: {f} is {_json_type(v)}, the real server's is {_json_type(v_ref)}")
        if step in SAME_MESSAGE and _message(rec) != _message(ref):
            out.append(f"{step}: message {_message(rec)!r}, the real server's {_message(ref)!r}")
    return out


def capture(out: Path = FIXTURE) -> dict[str, Any]:
    """Start the real server (``ops.sglang_cpu.live``), run the conversation, write the fixture."""
    import sglang  # noqa: PLC0415 - optional dependency: SGLang's stack

    base = REPO / "ops" / "bases" / "addition-tiny"
    key = "contract-admin-key"
    with tempfile.TemporaryDirectory(prefix="vapo-contract-") as tmp:
        server = LiveSGLang.start(base, Path(tmp), admin_key=key)
        try:
            records = conversation(server.url, key, base)
        finally:
            server.stop()
    about = {"_about": ("Captured from the real SGLang server by `python -m ops.sglang_cpu.contract capture`, never "
                        "edited by hand: one conversation (ops/sglang_cpu/contract.py) with SGLang "
                        f"{sglang.__version__} serving ops/bases/addition-tiny on the CPU, started as vapo starts it, "
                        "with an admin key. Ids, log-probs and timings vary between captures; statuses, field names, "
                        "types and the messages listed in contract.SAME_MESSAGE do not."),
             "_captured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")}
    out.write_text(json.dumps({**about, **records}, indent=2, sort_keys=False) + "\n")
    return records


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) != ["capture"]:
        raise SystemExit(__doc__)
    capture()
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
