"""``python -m buffer.inspect PATH``: print a JSON summary of a buffer's LMDB directory; repair its learner version.

Fields: groups, samples, group_bytes (waiting to be served), positives, min/max_weight_version (null when
empty), learner_version, bytes_on_disk (allocated blocks of data.mdb), file_size, map_size (the current LMDB
map size, as grown by the server), and every durable counter. Opens a read-only transaction, so it is safe
(and consistent) while the server runs.

``--set-learner-version N`` is the operator's repair when the durable learner version is wrong (a client
raised it, or a learner resumed against a fresh buffer directory and the buffer refuses its version): it
sets ``learner_version`` and ``served_version`` to N, prints ``learner_version OLD -> N``, then the summary.
Only while no buffer server runs on PATH (it holds ``server.lock``); refused with exit status 2 otherwise.
Exit status 2 when PATH is not a buffer directory.
"""

from __future__ import annotations

import argparse
import json
import sys

from buffer.directory import inspect, repair_learner_version

EPILOG = """repair:
  The buffer serves only groups with weight_version >= learner_version - buffer.max_staleness and accepts
  a BatchRequest that raises learner_version at most buffer.learner_version_max_step past the version of
  the last full batch it served. If the stored version is wrong (every group is dropped as stale, or the
  learner's requests are refused with reason learner_version), stop the buffer server, then run
    python -m buffer.inspect PATH --set-learner-version N
  with N = the learner's current version (or one less: the learner may always ask one step ahead).
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m buffer.inspect", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Summarise a vapo buffer directory (LMDB) as JSON; safe while it is served.")
    ap.add_argument("path", help="buffer directory (buffer.path, default <run dir>/buffer)")
    ap.add_argument("--indent", type=int, default=None, help="pretty-print with this indent")
    ap.add_argument("--set-learner-version", type=int, default=None, metavar="N",
                    help="repair: set the durable learner version to N (the buffer server must be stopped)")
    args = ap.parse_args(argv)
    if args.set_learner_version is not None and args.set_learner_version < 0:
        ap.error("--set-learner-version must be >= 0")
    try:
        if args.set_learner_version is not None:
            old = repair_learner_version(args.path, args.set_learner_version)
            print(f"buffer.inspect: learner_version {old} -> {args.set_learner_version} in {args.path}")
        info = inspect(args.path)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"buffer.inspect: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the server lock is held
        print(f"buffer.inspect: refusing to repair: {e.strerror or e}; stop the buffer server first", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=args.indent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
