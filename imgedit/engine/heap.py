"""Freed memory handed back to the system (glibc's `malloc_trim`), after a job's decoded images go.

A job's inputs are decoded in the manager's threads (tens to hundreds of MB each); glibc keeps what they
freed in the threads' arenas, so the server stayed at 4.4 GB after a burst that peaked at 6.6 GB
(issue 63). `malloc_trim(0)` returns the free pages of every arena. Our own call through ctypes: neither
the standard library nor a dependency of ours exposes it. Elsewhere than glibc it does nothing.

`malloc_trim` does not return the free top of a thread's arena, which glibc gives back only when a free
leaves it over the trim threshold. That threshold is high in two cases: glibc raises it (to twice the mmap
threshold, up to 64 MiB) the first time a large mapped block is freed, after which decoded images are carved
from the threads' arenas; and the test suite gives its children a 256 MiB one (for the workers' VAE). A test
server kept 100-220 MiB of freed pixels for good that way (`malloc_info`: four thread arenas of 32.1 MiB,
32.0 of each free and 16 MiB of that resident; its return to idle failed in 4 of 15 runs on the 2-core
machine); with glibc's defaults, two 12 MiB blocks freed in a thread stay (tests/test_memory.py).
`map_large_blocks` fixes both thresholds (glibc's `mallopt`, over any MALLOC_ setting) as app.py starts
the workers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()  # one trim at a time
_asked = threading.Event()  # a trim asked for since the running one began
_trim = None
_mallopt = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
    _mallopt = _libc.mallopt
    _mallopt.argtypes, _mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators return memory their own way
    pass

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
LARGE = 1 << 20  # bytes: a block this large gets a mapping of its own; a free top this large goes back


def map_large_blocks(size: int = LARGE) -> bool:
    """Give every block of `size` bytes or more a mapping of its own (unmapped when freed) and return an
    arena's free top once it passes `size`, for the rest of the process (a no-op without glibc). Setting
    either threshold stops glibc raising them. A decoded image then costs a mapping and its page faults
    (milliseconds for 12 MiB) and leaves nothing behind once freed. False where glibc refused."""
    if _mallopt is None:
        return False
    return bool(_mallopt(M_MMAP_THRESHOLD, size)) and bool(_mallopt(M_TRIM_THRESHOLD, size))


def give_back() -> None:
    """Return the pages freed memory no longer needs (milliseconds; a no-op without glibc). A call while a
    trim runs has that thread trim once more after it (what was freed after it began is then returned too)
    rather than wait."""
    if _trim is None:
        return
    _asked.set()
    while _asked.is_set() and _lock.acquire(blocking=False):
        try:
            while _asked.is_set():
                _asked.clear()
                _trim(0)
        finally:
            _lock.release()


def keep_giving_back(every: float) -> threading.Event:
    """Also give memory back every `every` seconds, in a thread of its own, until the returned event is set:
    what is freed after a job's own call (a History entry's inputs decoded in the background, a reply's bytes
    dropped once sent) can otherwise stay in its thread's arena until the next job (the likely reason one full
    test run on the 2-core machine ended 228 MiB above idle 150 s after the jobs, 2026-11-29)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            give_back()

    threading.Thread(target=run, name="heap-give-back", daemon=True).start()
    return stop
