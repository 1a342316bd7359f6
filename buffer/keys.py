"""``python -m buffer.keys DIR [--actors N]``: generate a run's CurveZMQ keys (what the launcher does itself).

Writes ``DIR/server.key`` + ``DIR/server.key_secret``, a pair per role (``actor``, ``learner``, ``monitor``;
with ``--actors N`` also ``actor-<i>`` for i = 0..N-1) and ``DIR/authorized_clients/`` with every client's
public key, whose file name is its role (``common.security``). A pair ``actor-<i>`` is actor i's own: the
buffer takes credit and groups for actor id i from it alone, and actor i picks it from ``keys_dir`` (the
launcher adds the pairs a run's ``actors.num_actors`` needs to the keys directory it uses). Prints the config override that uses them:
``buffer.curve.keys_dir=DIR`` (each process then picks the key of its role). Existing files are never
overwritten (``--force`` replaces them). Keys are pyzmq certificate files (``zmq.auth``); the directory is
mode 0700 and secret files 0600.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common.security import ROLES, generate_run_keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m buffer.keys",
        description="Generate CurveZMQ keys for the buffer and the learner's weight publisher "
        "(the launcher writes them into <run dir>/keys when the config names none).",
    )
    ap.add_argument("dir", help="output directory")
    ap.add_argument("--actors", type=int, default=0,
                    help="also write N per-actor pairs actor-0 .. actor-<N-1>, each binding its actor id "
                         "(default: the shared 'actor' pair only)")
    ap.add_argument("--force", action="store_true", help="overwrite existing key files")
    args = ap.parse_args(argv)
    if args.actors < 0:
        ap.error("--actors must be >= 0")
    out = Path(args.dir)
    names = ["server", *ROLES, *(f"actor-{i}" for i in range(args.actors))]
    existing = [out / f"{n}.key_secret" for n in names if (out / f"{n}.key_secret").exists()]
    if existing and not args.force:
        print(f"buffer.keys: {existing[0]} exists; use --force to replace keys", file=sys.stderr)
        return 2
    if args.force:
        for n in names:
            for suffix in (".key", ".key_secret"):
                (out / f"{n}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(out / "authorized_clients", ignore_errors=True)
    generate_run_keys(out, args.actors)
    print(f"wrote {len(names)} key pairs to {out}")
    print("override (every process of the run; each uses the key of its role):")
    print(f"  buffer.curve.keys_dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
