"""Freed memory handed back to the system (glibc's `malloc_trim`), after a job's decoded images go.

A job's inputs are decoded in the manager's threads (tens to hundreds of MB each); glibc keeps what they
freed in the threads' arenas, so the server stayed at 4.4 GB after a burst that peaked at 6.6 GB
(issue 63). `malloc_trim(0)` returns the free pages of every arena. Our own call through ctypes: neither
the standard library nor a dependency of ours exposes it. Elsewhere than glibc it does nothing.
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
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators return memory their own way
    pass


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
