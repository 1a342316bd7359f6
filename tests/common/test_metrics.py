"""common.metrics: declared once, documented, served over HTTP with the vapo_ prefix."""

from __future__ import annotations

import re
import select
import socket
import threading
import urllib.request
from pathlib import Path

import pytest

from common.metrics import COMPONENTS, SPECS, Metrics, specs
from tests.polling import wait_for


def test_every_metric_is_declared_once_with_help_and_prefix() -> None:
    names = [s.full_name for s in SPECS]
    assert len(names) == len(set(names))
    for s in SPECS:
        assert s.full_name.startswith(f"vapo_{s.component}_")
        assert s.component in COMPONENTS
        assert len(s.help) > 10, s.full_name
        assert not s.name.endswith("_total"), "counters get _total from prometheus_client"


def test_component_registries_are_separate_and_served() -> None:
    m = Metrics("buffer")
    m.depth_groups.set(7)
    m.rejected_frames.labels(reason="oversized").inc(3)
    port = m.serve(0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "vapo_buffer_depth_groups 7.0" in body
    assert 'vapo_buffer_rejected_frames_total{reason="oversized"} 3.0' in body
    assert "vapo_learner_" not in body  # only this component's metrics
    assert {s.exposed_name for s in specs("buffer")} <= {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line.startswith("vapo_")} | {
        s.exposed_name for s in specs("buffer") if s.labels or s.kind == "histogram"
    }


def test_undeclared_metric_is_a_clear_error() -> None:
    with pytest.raises(AttributeError, match="vapo_learner_nope"):
        Metrics("learner").nope  # noqa: B018
    with pytest.raises(ValueError):
        Metrics("nobody")


def test_wait_for_scrape_returns_once_an_http_scrape_comes_after_the_mark() -> None:
    import time

    m = Metrics("learner")
    port = m.serve(0)
    assert m.last_scrape == 0.0
    assert m.wait_for_scrape(time.time(), timeout_s=0.05) is False  # nobody scraping: bounded, no hang
    mark = time.time()
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()))
    t.start()
    assert m.wait_for_scrape(mark, timeout_s=10) is True
    t.join(timeout=10)
    assert m.last_scrape >= mark
    assert "vapo_learner_weight_version" in got[0]
    assert m.wait_for_scrape(mark, timeout_s=0) is True  # already satisfied: no wait


def test_stay_for_last_scrape_waits_only_where_someone_scrapes() -> None:
    import time

    m = Metrics("actor")
    port = m.serve(0)
    t0 = time.monotonic()
    assert m.stay_for_last_scrape(30) is None  # never scraped: nobody to wait for, returns at once
    assert time.monotonic() - t0 < 5
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    wait_for(lambda: m.last_scrape > 0, 10, "the scrape to be noted")
    assert m.stay_for_last_scrape(0) is None  # switched off
    assert m.stay_for_last_scrape(0.05) is False  # scraped before, but not since: bounded
    done = threading.Event()

    def scrape_until_done() -> None:  # as Prometheus does: one scrape may begin before the wait's mark
        while not done.is_set():
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()

    t = threading.Thread(target=scrape_until_done)
    t.start()
    try:
        assert m.stay_for_last_scrape(10) is True
    finally:
        done.set()
        t.join(timeout=10)


def test_a_process_that_exits_right_after_the_final_scrape_has_sent_it() -> None:
    # The learner calls wait_for_scrape and exits: if the wait returned when the values were collected
    # rather than when the response was written, the exit would cut the response and Prometheus would
    # keep only older values (a Grafana panel missing the last steps).
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from common.metrics import Metrics\n"
        "m = Metrics('learner'); port = m.serve(0); print(port, flush=True)\n"
        "sys.stdin.readline()\n"  # the scraper is running
        "m.weight_version.set(7); mark = time.time()\n"
        "ok = m.wait_for_scrape(mark, timeout_s=20)\n"
        "os._exit(0 if ok else 3)\n")], cwd=Path(__file__).resolve().parents[2], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    port = int(child.stdout.readline())
    bodies: list[str] = []
    failures = 0
    child.stdin.write("go\n")
    child.stdin.flush()
    while child.poll() is None:  # scrape back to back, as a Prometheus with a tiny interval would
        try:
            bodies.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        except OSError:
            failures += 1
    assert child.wait(timeout=20) == 0
    assert any("vapo_learner_weight_version 7.0" in b for b in bodies), (len(bodies), failures)


def _documented_metrics() -> dict[str, tuple[str, str]]:
    """docs/METRICS.md's table ("Every metric"): full metric name -> (type, labels cell). A name written
    `_x` after a full `vapo_<component>_...` name abbreviates `vapo_<component>_x`."""

    text = (Path(__file__).resolve().parents[2] / "docs" / "METRICS.md").read_text()
    section = text.split("\n## Every metric", 1)[1].split("\n## ", 1)[0]
    out: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`vapo_"):
            continue
        component = ""
        for tok in re.findall(r"`([^`]+)`", cells[0]):
            if tok.startswith("vapo_"):
                component = tok.split("_")[1]
                out[tok] = (cells[1], cells[2])
            else:
                out[f"vapo_{component}{tok}"] = (cells[1], cells[2])
    return out


def test_metrics_page_matches_the_declared_metrics() -> None:
    """Every metric declared in common/metrics.py is in docs/METRICS.md's table with its type and labels,
    and the table names nothing that is not declared."""
    doc = _documented_metrics()
    declared = {s.full_name: s for s in SPECS}
    assert sorted(set(declared) - set(doc)) == [], "declared but not in docs/METRICS.md"
    assert sorted(set(doc) - set(declared)) == [], "in docs/METRICS.md but not declared"
    for name, (kind, labels) in doc.items():
        s = declared[name]
        assert kind == s.kind, (name, kind, s.kind)
        names = {x.strip() for x in re.sub(r"\([^)]*\)", "", labels).split(",") if x.strip()}
        assert names == set(s.labels), (name, labels, s.labels)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed this connection (EOF, or a reset), without blocking."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_metrics_server_drops_half_requests_after_its_read_timeout_and_bounds_its_threads() -> None:
    m = Metrics("actor")
    port = m.serve(0, read_timeout_s=0.5, max_connections=4)
    baseline = threading.active_count()
    slow: list[socket.socket] = []
    closed: set[int] = set()

    def count_closed() -> int:
        closed.update(i for i, s in enumerate(slow) if i not in closed and _closed_by_server(s))
        return len(closed)

    try:
        for _ in range(30):  # each sends half a request line, then nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metr")
            slow.append(s)
        # Four are being read, one thread each; the other 26 are closed at once, unserved.
        wait_for(lambda: count_closed() >= 26, 10, "connections past the bound closed")
        assert threading.active_count() <= baseline + 4
        # The four half requests are dropped after the read timeout, and a scrape is served again.
        wait_for(lambda: count_closed() == 30, 10, "half requests dropped after the read timeout")
        wait_for(lambda: threading.active_count() <= baseline, 10, "their threads to end")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "vapo_actor_" in body
    finally:
        for s in slow:
            s.close()
