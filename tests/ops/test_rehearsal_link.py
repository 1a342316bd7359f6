"""The rehearsal's shaped link (``--link``): its spec and the tc command for it, no root needed."""

from __future__ import annotations

import pytest

from ops.rehearsal.link import MIN_BURST_BYTES, Link, parse_link, tc_argv


def test_parse_link_rate_and_delay() -> None:
    assert parse_link("1gbit,2ms") == Link("1gbit", "2ms")
    assert parse_link("100Mbit") == Link("100mbit", "")
    assert parse_link("1gbit").bits_per_second == 1e9
    assert parse_link("10mbps").bits_per_second == 80e6
    for bad in ("fast", "1gb", "0mbit", "1gbit,2", "1gbit,soon", ""):
        with pytest.raises(ValueError):
            parse_link(bad)


def test_tc_rate_alone_is_tbf_with_a_bucket_above_one_offloaded_packet() -> None:
    argv = tc_argv(parse_link("1gbit"), "vapo-h2")
    assert argv[:10] == ["ip", "netns", "exec", "vapo-h2", "tc", "qdisc", "replace", "dev", "eth0", "root"]
    assert argv[10:13] == ["tbf", "rate", "1gbit"]
    burst = int(argv[argv.index("burst") + 1])
    assert burst == 1_250_000  # 10 ms at 1 Gbit/s
    slow = tc_argv(parse_link("1mbit"), "vapo-h0")
    assert int(slow[slow.index("burst") + 1]) == MIN_BURST_BYTES
    assert "latency" in argv and "netem" not in argv


def test_tc_with_delay_is_netem_rate_and_delay() -> None:
    argv = tc_argv(parse_link("1gbit,2ms"), "vapo-h1")
    assert argv[3] == "vapo-h1"
    assert argv[10:15] == ["netem", "rate", "1gbit", "delay", "2ms"]
    assert int(argv[argv.index("limit") + 1]) > 1000  # netem's default queue would drop a bucket in flight
