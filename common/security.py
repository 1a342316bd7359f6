"""CurveZMQ helpers shared by every vapo server socket (buffer ingest/serve, learner weight publisher).

The rule: a socket may bind without encryption only to a *local* endpoint —
``tcp://`` on a loopback address (127.0.0.0/8, ``::1``, ``localhost``), or ``ipc://`` / ``inproc://``.
Anything else (a routable address, ``*``, ``0.0.0.0``, ``::``, a host name) needs CurveZMQ keys: the
server's secret key and a directory of authorised client public keys. Without them
:func:`server_curve` raises :class:`SecurityError`, whose message says what is missing; callers turn it
into a refusal to start. When keys are configured they are used even on loopback binds.

Keys are pyzmq's certificate files (``zmq.auth.create_certificates``): ``<name>.key`` holds the public
key, ``<name>.key_secret`` both. ``python -m buffer.keys DIR`` writes a server pair, client pairs and an
``authorized_clients/`` directory.

Usage (server)::

    sec = server_curve(ctx, [cfg.buffer.ingest_addr, cfg.buffer.serve_addr], cfg.buffer.curve)
    sock = ctx.socket(zmq.ROUTER); sec.apply(sock); sock.bind(addr)

Usage (client)::

    keys = client_curve_keys(cfg.buffer.curve)        # None when no client keys are configured
    sock = ctx.socket(zmq.DEALER); apply_client_curve(sock, keys); sock.connect(addr)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class SecurityError(RuntimeError):
    """A server would bind to a non-local endpoint without CurveZMQ keys (or the keys are unusable)."""


def endpoint_host(addr: str) -> str:
    """The host part of a ``tcp://host:port`` endpoint (brackets stripped for IPv6)."""
    if not addr.startswith("tcp://"):
        raise ValueError(f"not a tcp endpoint: {addr!r}")
    rest = addr[len("tcp://"):]
    if rest.startswith("["):
        return rest[1:rest.index("]")]
    host = rest.rsplit(":", 1)[0]
    # "tcp://eth0;192.168.1.1:5555" style source/interface prefixes: the bind host is after ';'
    return host.split(";")[-1]


def is_local_endpoint(addr: str) -> bool:
    """True when binding ``addr`` cannot be reached from another machine (no CURVE needed)."""
    scheme = urlsplit(addr).scheme
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False  # pgm/epgm/udp/ws...: network transports
    return is_loopback_host(endpoint_host(addr))


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (brackets allowed: ``[::1]``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # "*", 0.0.0.0, interface names, host names: may be routable


@dataclass
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_dir: Path


@dataclass
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _load(path: str, what: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise SecurityError(f"{what}: key file {p} not found (generate keys with `python -m buffer.keys DIR`)")
    try:
        public, secret = zmq.auth.load_certificate(str(p))
    except Exception as e:  # malformed certificate files raise ValueError / KeyError / OSError
        raise SecurityError(f"{what}: cannot read key file {p}: {e}") from None
    if need_secret and not secret:
        raise SecurityError(f"{what}: {p} holds no secret key (use the .key_secret file)")
    return public, secret


def server_keys(curve: Any) -> ServerKeys | None:
    """Load the server keys named by a CurveConfig; None when none are configured."""
    if not curve.server_secret_key and not curve.authorized_clients_dir:
        return None
    if not curve.server_secret_key:
        raise SecurityError("curve.server_secret_key is empty but curve.authorized_clients_dir is set")
    if not curve.authorized_clients_dir:
        raise SecurityError("curve.authorized_clients_dir is empty: no client could ever connect")
    public, secret = _load(curve.server_secret_key, "curve.server_secret_key", need_secret=True)
    d = Path(curve.authorized_clients_dir)
    if not d.is_dir() or not any(d.glob("*.key")):
        raise SecurityError(f"curve.authorized_clients_dir {d} has no client public keys (*.key)")
    assert secret is not None
    return ServerKeys(public=public, secret=secret, authorized_dir=d)


def client_curve_keys(curve: Any) -> ClientKeys | None:
    """Load a client's keys (own secret + server public) from a CurveConfig; None when not configured."""
    if not curve.client_secret_key and not curve.server_public_key:
        return None
    if not curve.client_secret_key or not curve.server_public_key:
        raise SecurityError("CURVE client needs both curve.client_secret_key and curve.server_public_key")
    public, secret = _load(curve.client_secret_key, "curve.client_secret_key", need_secret=True)
    server_public, _ = _load(curve.server_public_key, "curve.server_public_key", need_secret=False)
    assert secret is not None
    return ClientKeys(public=public, secret=secret, server_public=server_public)


class ServerCurve:
    """What a server applies to each of its sockets before binding; owns the ZAP authenticator."""

    def __init__(self, keys: ServerKeys | None, auth: ThreadAuthenticator | None) -> None:
        self.keys = keys
        self._auth = auth

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def apply(self, sock: zmq.Socket) -> None:
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def server_curve(ctx: zmq.Context, bind_addrs: list[str], curve: Any) -> ServerCurve:
    """Check the bind rule and start CURVE authentication if keys are configured.

    Raises SecurityError if any of ``bind_addrs`` is non-local and no keys are configured.
    """
    keys = server_keys(curve)
    if keys is None:
        remote = [a for a in bind_addrs if not is_local_endpoint(a)]
        if remote:
            raise SecurityError(
                f"refusing to bind {', '.join(remote)} without CurveZMQ keys: a non-loopback bind would let any "
                "host push or pull data. Bind to 127.0.0.1, or generate keys with `python -m buffer.keys DIR` "
                "and set curve.server_secret_key and curve.authorized_clients_dir."
            )
        return ServerCurve(None, None)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    # Only clients whose public key is a file in authorized_dir pass the ZAP handshake.
    auth.configure_curve(domain="*", location=str(keys.authorized_dir))
    return ServerCurve(keys, auth)


def apply_client_curve(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is in ``keys`` (no-op for None)."""
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def generate_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.key`` (public) and ``<name>.key_secret`` into ``directory``; returns both paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


__all__ = [
    "SecurityError", "is_local_endpoint", "is_loopback_host", "endpoint_host", "ServerKeys", "ClientKeys",
    "ServerCurve", "server_keys", "client_curve_keys", "server_curve", "apply_client_curve", "generate_keypair",
]
