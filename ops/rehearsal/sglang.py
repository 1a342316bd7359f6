"""The rehearsal with live SGLang engines (``ops/rehearse.sh --engine sglang``): the runs' overrides, the
engines' admin key, and what the rehearsal reads from the engines themselves.

    overrides("sglang")                  # -> config overrides every run of the rehearsal gets
    write_admin_key()                    # runs/_rehearsal/engine-admin.key (0600), fresh per rehearsal
    expected_digest(version_dir)         # -> what /weights_checker of an engine holding that version answers
    engine_start_seconds(run_dir)        # -> per engine, seconds from its start to SGLang's "ready to roll"

SGLang has no ``/weights_digest`` (rollout_server's); its ``/weights_checker`` (``action: checksum``, an admin
endpoint) answers one sha256 per parameter as SGLang holds it: Qwen2's q/k/v projections fused into
``qkv_proj`` and gate/up into ``gate_up_proj`` (concatenated along dim 0 at tensor-parallel size 1), the
vocabulary embedding padded with zero rows to a multiple of 64, the tied ``lm_head`` absent. ``expected_digest`` builds the same from a version on disk, so an engine's answer
equals it exactly when the engine holds that version's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

ADMIN_KEY = "runs/_rehearsal/engine-admin.key"  # relative to the repository: every host sees the same file
ENGINE_MODULE = "sglang.launch_server"
# SGLang's fused parameters (its Qwen2/Llama ``stacked_params_mapping``), parts in the order they are stacked.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# SGLang's vocabulary embeddings hold rows up to a multiple of this (its DEFAULT_VOCAB_PADDING_SIZE at
# tensor-parallel 1), the rows past the vocabulary zero (its weight loader fills them on every load).
VOCAB_PADDING = 64
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")
_READY = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] The server is fired up and ready to roll!")
_START = re.compile(r"^=== (\d\d:\d\d:\d\d) start: ")  # written by the launcher at each (re)start of a child


def overrides(engine: str) -> list[str]:
    """Config overrides of every run for ``engine``: rollout_server needs none (rehearsal.yaml's engine).
    SGLang binds 0.0.0.0 as rehearsal.yaml says (engine 0 on h2 serves the evaluation to h0), so its
    control endpoints take the admin key, which reaches each engine through the shared filesystem
    (``--config <key>.sglang.yaml``, written by the launcher)."""
    if engine == "rollout_server":
        return []
    return ["engine.kind=sglang", f"engine.admin_api_key_file={ADMIN_KEY}"]


def write_admin_key(root: Path) -> Path:
    """A fresh admin key for this rehearsal's engines, readable by root only."""
    path = root / ADMIN_KEY
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")  # hex: a urlsafe key may start with '-', which SGLang refuses
    return path


def admin_key(root: Path) -> str:
    try:
        return (root / ADMIN_KEY).read_text().strip()
    except OSError:
        return ""


def is_engine(argv: list[str]) -> bool:
    """An SGLang engine's HTTP server process (not its scheduler or detokenizer, not the ssh guard around it)."""
    return ENGINE_MODULE in argv and "--port" in argv and "common.remote" not in argv


def is_engine_part(cmdline: bytes) -> bool:
    """Any process of an SGLang engine (server, scheduler, detokenizer), the ssh guard around it excluded."""
    return (ENGINE_MODULE.encode() in cmdline or cmdline.startswith(b"sglang::")) and b"common.remote" not in cmdline


def _hash(t: Any) -> str:
    """SGLang's ``tensor_hash`` of a CPU tensor, as ``/weights_checker`` prints it."""
    import torch  # noqa: PLC0415 - here, as in rehearsal.push: the cluster's own stages need no torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(raw)).digest()[:8], 'big'):016x}"


def sglang_state(state: dict[str, Any], tied: bool) -> dict[str, Any]:
    """An HF checkpoint's tensors under SGLang's names (fused as SGLang loads them, at tensor-parallel 1)."""
    import torch  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    out: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, t in state.items():
        fused = next(((f, p) for f, ps in FUSED.items() for p in ps if f".{p}." in name), None)
        if fused is None:
            if not (tied and name == "lm_head.weight"):
                out[name] = _pad_vocab(t) if name in VOCAB_PARAMS else t
            continue
        parts.setdefault(name.replace(f".{fused[1]}.", f".{fused[0]}."), {})[fused[1]] = t
    for name, got in parts.items():
        order = next(ps for f, ps in FUSED.items() if f".{f}." in name)
        if set(got) != set(order):
            raise ValueError(f"{name}: parts {sorted(got)} of {list(order)} (a checkpoint SGLang would not load)")
        out[name] = torch.cat([got[p] for p in order], 0)
    return out


def _pad_vocab(t: Any) -> Any:
    import torch  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    rows = -t.shape[0] % VOCAB_PADDING
    return torch.cat([t, t.new_zeros((rows, *t.shape[1:]))], 0) if rows else t


def checksums(version_dir: Path) -> dict[str, str]:
    """Per SGLang parameter name, the hash ``/weights_checker`` answers for a version on disk."""
    from common.generation.weights import read_state_dict  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    cfg = version_dir / "config.json"  # every published version carries its model's config
    tied = cfg.exists() and bool(json.loads(cfg.read_text()).get("tie_word_embeddings", False))
    return {n: _hash(t) for n, t in sglang_state(read_state_dict(version_dir), tied).items()}


def engine_digest(per_name: dict[str, str]) -> str:
    """``per_engine_checksum`` of one tensor-parallel rank holding ``per_name`` (SGLang's ``overall_checksum``
    of the rank, then the engine's sha256 over its ranks' checksums)."""
    h = hashlib.sha256()
    for name in sorted(per_name):
        h.update(name.encode())
        h.update(per_name[name].encode())
    return hashlib.sha256(h.hexdigest().encode()).hexdigest()


def expected_digest(version_dir: Path) -> str:
    """What an engine holding the version at ``version_dir`` answers as ``per_engine_checksum``."""
    return engine_digest(checksums(version_dir))


# Run on an engine's host: each engine in $VAPO_DIGEST_QUERY ([url, key] pairs; keys travel in the
# environment, never on a command line): its /weights_checker checksum between two /model_info reads of its
# weight version, kept only when both reads agree (a push landing in between is left to the next poll). One
# JSON line of [url, version | null, per_engine_checksum | null].
QUERY = """import json, os, urllib.request
def call(url, key, body=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())
out = []
for url, key in json.loads(os.environ["VAPO_DIGEST_QUERY"]):
    try:
        before = call(url + "/model_info", key)["weight_version"]
        sha = call(url + "/weights_checker", key, {"action": "checksum"})["per_engine_checksum"]
        after = call(url + "/model_info", key)["weight_version"]
        out.append([url, int(after), sha] if before == after else [url, None, None])
    except Exception:
        out.append([url, None, None])
print(json.dumps(out))
"""

# Run on another host than the engine's: the status of /weights_checker without the key and with it.
AUTH_PROBE = """import json, os, urllib.error, urllib.request
url, key = json.loads(os.environ["VAPO_AUTH_PROBE"])
codes = []
for k in ("", key):
    req = urllib.request.Request(url + "/weights_checker", data=b'{"action": "checksum"}',
                                 headers={"Content-Type": "application/json", **({"Authorization": "Bearer " + k} if k else {})})
    try:
        codes.append(urllib.request.urlopen(req, timeout=30).status)
    except urllib.error.HTTPError as e:
        codes.append(e.code)
    except Exception:
        codes.append(None)
print(json.dumps(codes))
"""


def engine_start_seconds(run_dir: Path) -> dict[str, float | None]:
    """Per engine log of the run, seconds from the launcher's first start of it to SGLang's first "ready
    to roll" after it (None: never ready). Both stamps are the machine's local time, to the second."""
    out: dict[str, float | None] = {}
    for log in sorted((run_dir / "logs").glob("engine-*.log")):
        start = ready = None
        for line in log.read_text(errors="replace").splitlines():
            m = _START.match(line)
            if m and start is None:
                start = m.group(1)
            m = _READY.match(line)
            if m and start is not None:
                ready = m.group(1)
                break
        out[log.stem] = _seconds_between(start, ready) if start and ready else None
    return out


def _seconds_between(hms: str, stamp: str) -> float:
    """``stamp`` (date and time) minus ``hms`` (a time on the same or the previous day), in seconds."""
    t1 = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    t0 = time.mktime(time.strptime(f"{stamp[:10]} {hms}", "%Y-%m-%d %H:%M:%S"))
    return t1 - t0 if t1 >= t0 else t1 - t0 + 86400
