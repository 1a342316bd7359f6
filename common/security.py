"""CurveZMQ helpers shared by every vapo server socket (buffer ingest/serve, learner weight publisher).

Every client of a run authenticates, loopback included: the launcher writes a key set into
``<run dir>/keys`` (``generate_run_keys``) when the config names none and points ``buffer.curve.keys_dir``
at it, so any other local process (another user's job on a shared node) is refused at the handshake.
A key's *role* is its file name in ``authorized_clients/``: ``actor*.key``, ``learner*.key``,
``monitor*.key`` (the launcher's health probe). Servers look the role up from the ZAP User-Id (the client's
z85 public key) of each frame and serve each message type to its role only (``buffer.server``).
A key named ``actor-<i>.key`` (i an integer) is actor i's own: the buffer takes credit requests and groups for
actor id i from that key only, and that key for no other id (``ServerCurve.actor_refusal``). The launcher
writes one such pair per actor; an actor picks ``actor-<i>.key_secret`` from ``keys_dir`` when it exists and
the shared ``actor.key_secret`` otherwise (a hand-started actor of a key set made without ``--actors``).

Without any key configured a server still binds a *local* endpoint unauthenticated (``tcp://`` on a
loopback address, ``ipc://``, ``inproc://``): that is for a component started by hand, and it logs a
warning. Anything else (a routable address, ``*``, ``0.0.0.0``, ``::``, a host name) needs keys; without
them :func:`server_curve` raises :class:`SecurityError`, whose message says what is missing; callers turn
it into a refusal to start.

Keys are pyzmq's certificate files (``zmq.auth.create_certificates``): ``<name>.key`` holds the public
key, ``<name>.key_secret`` both (mode 0600). ``python -m buffer.keys DIR`` writes the same set as the
launcher. Keys come from ``curve.keys_dir`` (``server.key_secret``, ``authorized_clients/``,
``server.key``, ``<role>.key_secret``) unless a path of its own is set (``server_secret_key`` ...).

Usage (server)::

    sec = server_curve(ctx, [cfg.buffer.ingest_addr, cfg.buffer.serve_addr], cfg.buffer.curve)
    sock = ctx.socket(zmq.ROUTER); sec.apply(sock); sock.bind(addr)
    role = sec.role(frame.get("User-Id"))            # "actor" | "learner" | "monitor"; None = unknown

Usage (client)::

    keys = client_curve_keys(cfg.buffer.curve, "actor")   # None when no keys are configured
    sock = ctx.socket(zmq.DEALER); apply_client_curve(sock, keys); sock.connect(addr)
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("vapo.security")


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


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: an IPv6 address in brackets (``::`` -> ``[::]``), anything else as is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


ROLES = ("actor", "learner", "monitor")


def key_actor_id(name: str) -> int | None:
    """The actor id a key's file name binds it to (``actor-3`` or ``actor-3.key`` -> 3); None for any other name."""
    stem = name[: -len(".key")] if name.endswith(".key") else name
    suffix = stem[len("actor-"):] if stem.startswith("actor-") else ""
    return int(suffix) if suffix.isdigit() and len(suffix) <= 7 else None


def key_role(name: str) -> str | None:
    """The role a key's file name gives it: ``actor``, ``actor-3``, ``learner``, ``monitor-a`` ...; None
    for any other name."""
    stem = name[: -len(".key")] if name.endswith(".key") else name
    for role in ROLES:
        if stem == role or stem.startswith(role + "-"):
            return role
    return None


@dataclass
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_dir: Path
    roles: dict[str, str]  # client public key (z85, the ZAP User-Id) -> role
    actor_ids: dict[str, int] = field(default_factory=dict)  # public key of an actor-<i>.key -> i


@dataclass
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _load(path: str | Path, what: str, need_secret: bool) -> tuple[bytes, bytes | None]:
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


def _key_path(explicit: str, keys_dir: str, name: str) -> str:
    """An explicitly configured key path, else ``keys_dir/name`` (``""`` when neither is set)."""
    if explicit:
        return explicit
    return str(Path(keys_dir) / name) if keys_dir else ""


def _roles(d: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Each authorised key's role, and the actor id of each per-actor key (both by z85 public key)."""
    roles: dict[str, str] = {}
    actor_ids: dict[str, int] = {}
    for f in sorted(d.glob("*.key")):
        role = key_role(f.name)
        if role is None:
            raise SecurityError(f"authorised client key {f}: its file name must say its role "
                                f"({', '.join(r + '*.key' for r in ROLES)}); `python -m buffer.keys DIR` names them")
        public, _ = _load(f, "authorised client key", need_secret=False)
        roles[public.decode("ascii")] = role
        actor_id = key_actor_id(f.name)
        if actor_id is not None:
            if actor_id in actor_ids.values() or public.decode("ascii") in actor_ids:
                raise SecurityError(f"authorised client key {f}: actor id {actor_id} or this key is already bound "
                                    "(one key per actor id)")
            actor_ids[public.decode("ascii")] = actor_id
    return roles, actor_ids


def server_keys(curve: Any) -> ServerKeys | None:
    """Load the server keys named by a CurveConfig (or found in its keys_dir); None when none are configured."""
    keys_dir = getattr(curve, "keys_dir", "")
    secret_path = _key_path(curve.server_secret_key, keys_dir, "server.key_secret")
    auth_dir = _key_path(curve.authorized_clients_dir, keys_dir, "authorized_clients")
    if not secret_path and not auth_dir:
        return None
    if not secret_path:
        raise SecurityError("curve.server_secret_key is empty but curve.authorized_clients_dir is set")
    if not auth_dir:
        raise SecurityError("curve.authorized_clients_dir is empty: no client could ever connect")
    public, secret = _load(secret_path, "curve.server_secret_key", need_secret=True)
    d = Path(auth_dir)
    if not d.is_dir() or not any(d.glob("*.key")):
        raise SecurityError(f"curve.authorized_clients_dir {d} has no client public keys (*.key)")
    assert secret is not None
    roles, actor_ids = _roles(d)
    return ServerKeys(public=public, secret=secret, authorized_dir=d, roles=roles, actor_ids=actor_ids)


def client_curve_keys(curve: Any, role: str = "", actor_id: int | None = None) -> ClientKeys | None:
    """Load a client's keys (own secret + server public) from a CurveConfig; None when not configured.

    With ``curve.keys_dir`` the client's secret is ``<keys_dir>/<role>.key_secret`` (``role`` one of ROLES)
    unless ``curve.client_secret_key`` names one; an actor given its ``actor_id`` takes its own
    ``actor-<id>.key_secret`` there when it exists."""
    keys_dir = getattr(curve, "keys_dir", "")
    if keys_dir and not curve.client_secret_key and role not in ROLES:
        raise SecurityError(f"curve.keys_dir is set: a client must name its role ({', '.join(ROLES)}), got {role!r}")
    name = role
    if role == "actor" and actor_id is not None and keys_dir and (Path(keys_dir) / f"actor-{actor_id}.key_secret").is_file():
        name = f"actor-{actor_id}"
    client_path = _key_path(curve.client_secret_key, keys_dir, f"{name}.key_secret")
    server_path = _key_path(curve.server_public_key, keys_dir, "server.key")
    if not client_path and not server_path:
        return None
    if not client_path or not server_path:
        raise SecurityError("CURVE client needs both curve.client_secret_key and curve.server_public_key")
    public, secret = _load(client_path, "curve.client_secret_key", need_secret=True)
    server_public, _ = _load(server_path, "curve.server_public_key", need_secret=False)
    assert secret is not None
    return ClientKeys(public=public, secret=secret, server_public=server_public)


class ServerCurve:
    """What a server applies to each of its sockets before binding; owns the ZAP authenticator."""

    def __init__(self, keys: ServerKeys | None, auth: ThreadAuthenticator | None) -> None:
        self.keys = keys
        self._auth = auth
        self._ids: set[int] | None = None

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def role(self, user_id: str | None) -> str | None:
        """The role of the client key a frame came with (its ZAP User-Id); None when unknown or CURVE is off."""
        if self.keys is None or not user_id:
            return None
        return self.keys.roles.get(user_id)

    def actor_refusal(self, user_id: str | None, actor_id: int) -> str | None:
        """Why the client key ``user_id`` may not act for ``actor_id`` (credit, groups); None when it may.

        An ``actor-<i>.key`` acts for actor id i only, and an id with a key of its own for that key only;
        other ids are left to the first key that asks (``buffer.credits``)."""
        if self.keys is None or not user_id:
            return None
        bound = self.keys.actor_ids.get(user_id)
        if bound is not None and bound != actor_id:
            return f"this client key is actor {bound}'s (authorized_clients/actor-{bound}.key), not actor {actor_id}'s"
        if bound is None and actor_id in self._owned_ids():
            return f"actor_id {actor_id} has a key of its own (authorized_clients/actor-{actor_id}.key)"
        return None

    def _owned_ids(self) -> set[int]:
        if self._ids is None:
            self._ids = set(self.keys.actor_ids.values()) if self.keys is not None else set()
        return self._ids

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
        log.warning("no CurveZMQ keys configured: %s accept any local client (the launcher always generates "
                    "keys; a component started by hand without them is open to every local process)",
                    ", ".join(bind_addrs))
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


# Socket monitor events of a connection whose handshake failed: no key, a key not authorised, a wrong server
# key, or a client without CURVE. Servers count them (their clients never get a frame through).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_monitor_ids = itertools.count()


def open_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s monitor ``events``; end it with ``close_monitor``.

    pyzmq's default endpoint is named after the socket's file descriptor, which a socket opened after one
    closed gets again while the old monitor's endpoint may still be bound ("Address already in use"); an
    endpoint unique in the process cannot collide."""
    return sock.get_monitor_socket(events, addr=f"inproc://vapo-monitor-{os.getpid()}-{next(_monitor_ids)}")


def close_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop monitoring ``sock`` and close the PAIR socket, before ``sock`` itself is closed (from the thread
    that owns ``sock``). A socket closed while still monitored is never reaped: its context runs out of
    sockets ("Too many open files") after a few hundred."""
    if not sock.closed:
        sock.disable_monitor()
    monitor.close(linger=0)


def generate_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.key`` (public) and ``<name>.key_secret`` into ``directory``; returns both paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret is never readable by others, not even between write and chmod
    try:
        public, secret = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def generate_run_keys(directory: str | Path, actors: int = 0) -> Path:
    """A run's key set in ``directory`` (mode 0700): the server pair, one pair per role (``actor``,
    ``learner``, ``monitor``; plus ``actor-<i>`` for i < ``actors``), and ``authorized_clients/`` holding
    every client's public key. Existing pairs are kept (a resumed run keeps its keys). Returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    auth = d / "authorized_clients"
    auth.mkdir(exist_ok=True)
    for name in ["server", *ROLES, *(f"actor-{i}" for i in range(actors))]:
        if not (d / f"{name}.key_secret").is_file() or not (d / f"{name}.key").is_file():
            generate_keypair(d, name)
        if name != "server":
            shutil.copyfile(d / f"{name}.key", auth / f"{name}.key")
    return d


class RefusalLog:
    """Log lines about refused connections, rate-limited: the first refusal at once, then at most one summary
    line per ``interval_s`` with the count since the last line (a stranger reconnecting every 100 ms would
    otherwise write ten warnings a second). Call ``note(n, now)`` every loop turn, ``n`` = refusals seen since
    the previous call (0 too: a pending summary comes out when its interval is over)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self.total = 0
        self.pending = 0  # refusals not yet in a line
        self._last: float | None = None  # when the last line was written

    def note(self, n: int, now: float) -> None:
        self.total += n
        self.pending += n
        if self.pending <= 0:
            return
        if self._last is None:
            self.logger.warning("%s: refused %d connection(s) at the CurveZMQ handshake (no key of this run); "
                                "further refusals are summarised every %.0f s", self.what, self.pending,
                                self.interval_s)
        elif now - self._last >= self.interval_s:
            self.logger.warning("%s: refused %d more connection(s) at the CurveZMQ handshake in the last %.0f s "
                                "(%d in all)", self.what, self.pending, now - self._last, self.total)
        else:
            return
        self.pending = 0
        self._last = now


__all__ = [
    "SecurityError", "is_local_endpoint", "is_loopback_host", "endpoint_host", "ServerKeys", "ClientKeys",
    "ServerCurve", "server_keys", "client_curve_keys", "server_curve", "apply_client_curve", "generate_keypair",
    "generate_run_keys", "ROLES", "key_role", "key_actor_id", "HANDSHAKE_FAILED", "RefusalLog", "url_host",
]
