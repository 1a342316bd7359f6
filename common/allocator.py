"""glibc malloc settings for the processes that move sample groups one at a time (buffer, actors).

    from common.allocator import keep_freed_memory
    keep_freed_memory()   # first thing in a process's main; a no-op where the C library is not glibc

Why: a group of 16 x 1,000-token samples is a 137 KB frame, and each group passing through a process allocates
and frees a few of those (the encoded frame, the ZeroMQ message, msgpack's copies of the token arrays). glibc
serves an allocation of 128 KiB or more with a fresh ``mmap`` and gives the heap's free top back to the kernel
once it passes 128 KiB; both thresholds adapt upward only to the largest block freed so far. So the same
memory was returned and faulted in again for every group: 34 minor page faults a group in encode, a ZeroMQ
hop and decode, a third of their CPU time (270 -> 180 us a group measured on a 2-core EPYC VM, where a fault is
costly). Fixed thresholds keep up to ``TRIM_THRESHOLD`` of freed memory for the next group, and map only
blocks over ``MMAP_THRESHOLD`` (glibc's ceiling, 32 MiB on 64-bit) directly.

A setting the environment already makes (glibc's own ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``)
is left as the user set it. The learner does not call it: its large buffers are torch's, taken once a
step, and its memory figures (``ops/bench/memory.py``) were measured with glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 64 << 20  # freed heap kept for reuse: a commit batch of paper-sized groups is tens of MiB
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)

_SETTINGS = {
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
}


def keep_freed_memory() -> dict[str, int]:
    """Set glibc's trim and mmap thresholds (see the module docstring); returns what was set, by the name of
    the environment variable that would have set it. Empty off glibc, or when the environment set both."""
    if platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {}
    for env, (param, value) in _SETTINGS.items():
        if env not in os.environ and mallopt(param, value) == 1:  # mallopt answers 1 on success
            done[env] = value
    return done
