"""Free TCP ports for tests that start real servers, so they never collide with a run on the default ports."""

from __future__ import annotations

from common.ports import free_port


def port_overrides() -> list[str]:
    """Config overrides that give every socket and /metrics server of one launch its own fresh port."""
    p = [free_port() for _ in range(10)]
    return [
        f"buffer.ingest_addr=tcp://127.0.0.1:{p[0]}", f"buffer.serve_addr=tcp://127.0.0.1:{p[1]}",
        f"learner.publish_addr=tcp://127.0.0.1:{p[2]}", f"learner.query_addr=tcp://127.0.0.1:{p[3]}",
        f"buffer.metrics_port={p[4]}", f"learner.metrics_port={p[5]}", f"actors.metrics_base_port={p[6]}",
        f"metrics.launcher_port={p[7]}", f"engine.base_port={p[8]}", f"learner.push_addr=tcp://127.0.0.1:{p[9]}",
    ]
