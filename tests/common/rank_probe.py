"""A stand-in learner rank for tests of the multi-host start (``tests/common/test_remote.py``): records the
rank variables and environment it was started with in ``$PROBE_OUT/rank<RANK>.txt``, then waits to be
stopped. Not a test module."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR", "GLOO_SOCKET_IFNAME",
        "VAPO_DS_SHM")

if __name__ == "__main__":
    out = Path(os.environ["PROBE_OUT"])
    record = {k: os.environ.get(k) for k in KEYS} | {"pid": os.getpid()}
    tmp = out / f".rank{os.environ.get('RANK')}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(out / f"rank{os.environ.get('RANK')}.json")
    time.sleep(600)
