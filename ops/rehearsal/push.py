"""The weight sync in the rehearsal: the figures of each transport read back from a run's own records
(``--push`` adds a run with the distributed push; the shaped link of ``--link`` is ``ops.rehearsal.link``).

    sync_figures(run_dir, "distributed", seen)   # -> the transport's figures as one dict
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ops.rehearsal.cluster import Cluster


def actor_summaries(run_dir: Path) -> list[dict[str, Any]]:
    """Each actor's ``ACTOR DONE`` json (its last one) from the run's actor logs."""
    out = []
    for log in sorted((run_dir / "logs").glob("actor-*.log")):
        done = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("ACTOR DONE ")]
        if done:
            try:
                out.append(json.loads(done[-1][len("ACTOR DONE "):]))
            except json.JSONDecodeError:
                continue
    return out


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "learner_step":
            out.append(rec)
    return out


def disk_versions(run_dir: Path) -> list[int]:
    """The complete (``STABLE``) weight versions on disk, oldest first."""
    return sorted(int(p.name[1:]) for p in (run_dir / "weights").glob("v[0-9]*") if (p / "STABLE").exists())


def version_bytes(version_dir: Path) -> int:
    """The tensors' bytes of one version (its safetensors files): what either transport moves per engine."""
    return sum(p.stat().st_size for p in version_dir.glob("*.safetensors"))


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def bitwise(run_dir: Path, seen: dict[str, dict[int, str]], digest: Callable[[Path], str]) -> dict[str, Any]:
    """Each engine's digests (``seen``: engine -> version -> sha256 as it served them) against ``digest``
    (a version directory -> its param digest) of the same version on disk; ok when every engine was seen
    serving the newest disk version and each of its versions still on disk matches byte for byte."""
    versions = disk_versions(run_dir)
    newest = versions[-1] if versions else None
    want = {v: digest(run_dir / "weights" / f"v{v}") for v in versions if any(v in s for s in seen.values())}
    mismatched = sorted({f"{e}@v{v}" for e, s in seen.items() for v, sha in s.items() if v in want and sha != want[v]})
    at_newest = {e: newest in s for e, s in seen.items()}
    ok = bool(seen) and newest is not None and all(at_newest.values()) and not mismatched
    return {"ok": ok, "newest_disk_version": newest, "engines": len(seen), "engines_at_newest": sum(at_newest.values()),
            "versions_compared": sum(1 for s in seen.values() for v in s if v in want), "mismatched": mismatched}


def sync_figures(run_dir: Path, transport: str, seen: dict[str, dict[int, str]] | None = None,
                 digest: Callable[[Path], str] | None = None) -> dict[str, Any]:
    """One transport's figures from a run's records: the learner's ``publish`` phase per step (rank 0 blocked;
    the other ranks wait for it), the actors' ``ACTOR DONE`` counters (the push's engine pause, the disk
    path's publish-to-serving latency), bytes per version, and the engines' digests when ``seen``."""
    steps = _steps(run_dir)
    blocked = [float(r["phase_seconds"]["publish"]) for r in steps if "publish" in r.get("phase_seconds", {})]
    actors = actor_summaries(run_dir)
    pushes = sum(int(a.get("weight_pushes", 0)) for a in actors)
    pause_ms = sum(int(a.get("push_pause_ms", 0)) for a in actors)
    latencies = [float(x) for a in actors for x in a.get("weight_sync_latency_s", [])]
    versions = disk_versions(run_dir)
    out: dict[str, Any] = {
        "transport": transport, "publishes": len(blocked), "learner_blocked_s_mean": _mean(blocked),
        "learner_blocked_s_max": round(max(blocked), 4) if blocked else None,
        "engine_pause_s_mean": round(pause_ms / 1000 / pushes, 4) if pushes else None, "engine_pushes": pushes,
        "disk_syncs": len(latencies), "disk_sync_latency_s_mean": _mean(latencies),
        "bytes_per_version": version_bytes(run_dir / "weights" / f"v{versions[-1]}") if versions else None,
        "actors": [{k: a.get(k) for k in ("actor_id", "weight_version", "weight_loads", "weight_pushes",
                                          "weight_sync_failures", "push_pause_ms", "fatal")} for a in actors]}
    if seen is not None and digest is not None:
        out["bitwise"] = bitwise(run_dir, seen, digest)
    return out


def param_digest_of(version_dir: Path) -> str:
    """``param_digest`` of a published version's tensors (as ``ops/bench/weight_sync.py`` computes it)."""
    from actors.rollout_server.dist_update import param_digest  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it
    from common.generation.weights import read_state_dict  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    return param_digest(read_state_dict(version_dir).items())


# Run on an engine's host: GET /weights_digest of each engine in $VAPO_DIGEST_QUERY ([url, key] pairs; the
# keys travel in the environment, never on a command line), one JSON line of [url, version, sha256 | null].
_QUERY = """import json, os, urllib.request
out = []
for url, key in json.loads(os.environ["VAPO_DIGEST_QUERY"]):
    req = urllib.request.Request(url + "/weights_digest", headers={"Authorization": "Bearer " + key} if key else {})
    try:
        body = json.loads(urllib.request.urlopen(req, timeout=5).read())
        out.append([url, int(body["weight_version"]), body["sha256"]])
    except Exception as e:
        out.append([url, None, None])
print(json.dumps(out))
"""


class DigestPoller:
    """Polls every engine's ``/weights_digest`` while a run goes on (the engines stop with the run, so the
    digests are taken while they serve): ``seen`` maps an engine (host:port) to version -> sha256. ``query``
    is the script run on the engine's host (SGLang's: ``rehearsal.sglang.QUERY``), printing one JSON line of
    ``[url, version, digest]``."""

    def __init__(self, cluster: Cluster, engines: Callable[[], list[tuple[str, int, str]]], every_s: float = 0.5,
                 query: str = _QUERY) -> None:
        self.cluster, self.engines, self.every_s, self.query = cluster, engines, every_s, query
        self.seen: dict[str, dict[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="digest-poller", daemon=True)

    def __enter__(self) -> DigestPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except Exception:  # an engine restarting or gone: the next poll tries again
                continue

    def poll(self) -> None:
        """One round: ``engines()`` gives (host, port, admin key) of each engine running now."""
        for host, port, key in self.engines():
            query = json.dumps([[f"http://{host}:{port}", key]])
            r = self.cluster.run(host, ["python3", "-c", self.query], timeout=20, env=self.cluster.env(VAPO_DIGEST_QUERY=query))
            for _url, version, sha in json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else []:
                if version is not None:
                    self.seen.setdefault(f"{host}:{port}", {})[version] = sha
