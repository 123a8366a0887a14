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

_lock = threading.Lock()  # one trim at a time: jobs ending together need one
_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators return memory their own way
    pass


def give_back() -> None:
    """Return the pages freed memory no longer needs (milliseconds; a no-op without glibc)."""
    if _trim is None or not _lock.acquire(blocking=False):
        return
    try:
        _trim(0)
    finally:
        _lock.release()
