"""``python -m buffer.keys DIR [--clients N]``: generate CurveZMQ key pairs for non-loopback binds.

Writes ``DIR/server.key`` + ``DIR/server.key_secret``, ``DIR/client-<i>.key`` + ``.key_secret`` for
i = 0..N-1, and copies every client public key into ``DIR/authorized_clients/``. Prints the config
overrides that use them. Existing files are never overwritten (``--force`` replaces them). Keys are
pyzmq certificate files (``zmq.auth``); secret files are created with mode 0600.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common.security import generate_keypair


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m buffer.keys",
        description="Generate CurveZMQ keys for the buffer and the learner's weight publisher "
        "(needed to bind to any non-loopback address).",
    )
    ap.add_argument("dir", help="output directory")
    ap.add_argument("--clients", type=int, default=1, help="number of client key pairs (actors, learner); default 1")
    ap.add_argument("--force", action="store_true", help="overwrite existing key files")
    args = ap.parse_args(argv)
    if args.clients < 1:
        ap.error("--clients must be >= 1")
    out = Path(args.dir)
    names = ["server"] + [f"client-{i}" for i in range(args.clients)]
    existing = [out / f"{n}.key_secret" for n in names if (out / f"{n}.key_secret").exists()]
    if existing and not args.force:
        print(f"buffer.keys: {existing[0]} exists; use --force to replace keys", file=sys.stderr)
        return 2
    auth = out / "authorized_clients"
    auth.mkdir(parents=True, exist_ok=True)
    for n in names:
        public, _secret = generate_keypair(out, n)
        if n != "server":
            shutil.copy(public, auth / public.name)
    print(f"wrote {len(names)} key pairs to {out}")
    print("server overrides:")
    print(f"  buffer.curve.server_secret_key={out / 'server.key_secret'} buffer.curve.authorized_clients_dir={auth}")
    print("client overrides (client i):")
    print(f"  buffer.curve.server_public_key={out / 'server.key'} buffer.curve.client_secret_key={out / 'client-0.key_secret'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
