"""The shaped link between the rehearsal's hosts (``--link``): its spec and the tc command that applies it.

    link = parse_link("1gbit,2ms")          # -> Link(rate="1gbit", delay="2ms")
    tc_argv(link, "vapo-h2")                # the qdisc on h2's side of its veth (its egress)

Every packet between two hosts leaves one host's ``eth0`` once, so a qdisc on each host's ``eth0`` shapes
every path between hosts exactly once (a host's own loopback stays unshaped, as on a real machine). The
qdiscs live in the hosts' namespaces and go with them on teardown. Its own module because both the cluster
(which applies it) and the entry point (which parses it) need it, and the push figures need neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
_DELAY = re.compile(r"^\d+(?:\.\d+)?(us|ms|s)$")
# tc's units: SI prefixes, *bit in bits and *bps in bytes per second.
_BITS_PER_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
# tbf drops a packet larger than its bucket, and veth hands it segmentation-offloaded packets up to 64 KiB.
MIN_BURST_BYTES = 1 << 17
TBF_LATENCY = "50ms"  # how long a packet may queue before tbf drops it


@dataclass(frozen=True)
class Link:
    rate: str
    delay: str = ""

    @property
    def bits_per_second(self) -> float:
        m = _RATE.match(self.rate)
        assert m is not None
        return float(m.group(1)) * _BITS_PER_UNIT[m.group(2)]

    def describe(self) -> str:
        return self.rate + (f",{self.delay}" if self.delay else "")


def parse_link(spec: str) -> Link:
    """``RATE[,DELAY]`` in tc's units (``1gbit``, ``100mbit``, ``2ms``); ValueError naming what is wrong."""
    rate, _, delay = spec.strip().lower().partition(",")
    if not (m := _RATE.match(rate)) or float(m.group(1)) <= 0:
        raise ValueError(f"--link {spec!r}: the rate must be a number and a tc unit (bit kbit mbit gbit bps kbps mbps gbps)")
    if delay and not _DELAY.match(delay):
        raise ValueError(f"--link {spec!r}: the delay must be a number and us, ms or s")
    return Link(rate, delay)


def tc_argv(link: Link, netns: str, dev: str = "eth0") -> list[str]:
    """The command that shapes ``dev`` in ``netns``: tbf for a rate alone, netem (rate and delay) with a delay."""
    head = ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root"]
    if link.delay:
        # netem's queue holds the packets in flight for the delay; the default 1000 packets would drop some.
        return [*head, "netem", "rate", link.rate, "delay", link.delay, "limit", "100000"]
    burst = max(int(link.bits_per_second / 8 / 100), MIN_BURST_BYTES)  # 10 ms of the rate, at least 128 KiB
    return [*head, "tbf", "rate", link.rate, "burst", str(burst), "latency", TBF_LATENCY]
