"""``python -m buffer.inspect PATH``: print a JSON summary of a buffer's LMDB directory.

Fields: groups, samples, group_bytes (waiting to be served), positives, min/max_weight_version (null when
empty), learner_version, bytes_on_disk (allocated blocks of data.mdb), file_size, map_size, and every
durable counter. Opens a read-only transaction, so it is safe (and consistent) while the server runs.
Exit status 2 when PATH is not a buffer directory.
"""

from __future__ import annotations

import argparse
import json
import sys

from buffer.store import inspect


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m buffer.inspect",
                                 description="Summarise a vapo buffer directory (LMDB) as JSON; safe while it is served.")
    ap.add_argument("path", help="buffer directory (buffer.path, default <run dir>/buffer)")
    ap.add_argument("--indent", type=int, default=None, help="pretty-print with this indent")
    args = ap.parse_args(argv)
    try:
        info = inspect(args.path)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"buffer.inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=args.indent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
