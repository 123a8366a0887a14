"""The server's logging: one format, and repeated lines summed up instead of written each time.

A flood of refused connections wrote a warning per connection (490,370 lines, 76 MB in 75 s; issue 63).
`Repeats` is a logging filter on the handlers: each kind of line (its logger, level and message template)
is written BURST times per WINDOW seconds; the rest are counted, and the next one written after the window
says how many were left out. Our own filter: the standard library has none that rate-limits.
"""

from __future__ import annotations

import logging
import threading

WINDOW_S = 5.0
BURST = 5
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class Repeats(logging.Filter):
    def __init__(self, window: float = WINDOW_S, burst: int = BURST):
        super().__init__()
        self.window, self.burst = window, burst
        self._lock = threading.Lock()
        self._kinds: dict[tuple, list] = {}  # kind -> [window's start, written in it, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg)[:200])
        with self._lock:
            entry = self._kinds.get(kind)
            if entry is None or record.created - entry[0] >= self.window:
                left_out = entry[2] if entry else 0
                if len(self._kinds) > 1000:  # kinds whose windows are over are forgotten
                    self._kinds = {k: v for k, v in self._kinds.items()
                                   if record.created - v[0] < self.window}
                self._kinds[kind] = [record.created, 1, 0]
                if left_out:
                    record.msg = f"{record.msg} [{left_out:,} more like this were not written in the last " \
                                 f"{record.created - entry[0]:.0f} s]"
                return True
            if entry[1] < self.burst:
                entry[1] += 1
                return True
            entry[2] += 1
            return False


def configure(level: str) -> None:
    """The root logger's format and level, and `Repeats` on its handler (app.py, at start-up)."""
    logging.basicConfig(level=level, format=FORMAT)
    calm(logging.getLogger())


def calm(*loggers: logging.Logger) -> None:
    """`Repeats` on every handler of these loggers (uvicorn's own, once uvicorn has configured them)."""
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, Repeats) for f in handler.filters):
                handler.addFilter(Repeats())
