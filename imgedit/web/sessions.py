"""Gradio's per-session state, bounded: what API calls leave behind is dropped, and so are idle sessions.

Gradio (6.31, gradio/state_holder.py) makes a `SessionState` for every new session hash an event names, with
a copy of every component's config (~270 KB for our page), and keeps up to 10,000 of them: 10,000 anonymous
`/gpu_status` calls took the server from 0.19 to 2.89 GB, held (issue 63). A session whose page is open
(its browser holds `/gradio_api/heartbeat/<hash>`) is kept; one no page ever opened is dropped once idle for
a moment when it holds nothing of its own (every State at its default), or after API_IDLE_S otherwise; a
page's session after its page closed, after CLOSED_S. Our own sweep over Gradio's StateHolder (private
members of gradio 6.31: `session_data`, `time_last_used`, `lock`, `is_closed`, `state_data`): Gradio
offers only its capacity (`state_session_capacity`), which would drop the oldest open pages first.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

log = logging.getLogger(__name__)

SWEEP_S = 1.0
QUIET_S = 1.0  # an API-only session that holds nothing: dropped once idle this long (its call is over)
API_IDLE_S = 600.0  # an API-only session with State values of its own (a gradio_client's chain)
CLOSED_S = 600.0  # a page's session after its page closed (Gradio keeps its State for an hour)
HEARTBEAT = "/gradio_api/heartbeat/"


class SessionSweeper:
    """Drops sessions' state from Gradio's StateHolder (a thread, every SWEEP_S); `PageWatch` tells it which
    sessions a page opened."""

    def __init__(self, blocks=None):
        self.blocks = blocks
        self.paged: dict[str, float] = {}  # sessions whose page opened a heartbeat: when it was first seen

    def sweep(self, now: datetime.datetime | None = None) -> int:
        holder = getattr(self.blocks, "state_holder", None)
        if holder is None:
            return 0
        now = now or datetime.datetime.now()
        dropped = []
        for session_hash in list(holder.session_data):
            session = holder.session_data.get(session_hash)
            used = holder.time_last_used.get(session_hash)
            if session is None or used is None:
                continue
            idle = (now - used).total_seconds()
            if session_hash in self.paged:
                gone = session.is_closed and idle > CLOSED_S
            else:
                gone = idle > API_IDLE_S or (idle > QUIET_S and _holds_nothing(session))
            if gone:
                holder.delete_state(session_hash)  # each State's delete_callback, as Gradio's expiry does
                with holder.lock:
                    holder.session_data.pop(session_hash, None)
                    holder.time_last_used.pop(session_hash, None)
                self.paged.pop(session_hash, None)
                dropped.append(session_hash)
        # heartbeats of sessions that never held state (made-up hashes too) are forgotten after a while
        for session_hash, seen in list(self.paged.items()):
            if session_hash not in holder.session_data and time.monotonic() - seen > CLOSED_S:
                self.paged.pop(session_hash, None)
        if dropped:
            log.debug("dropped the state of %d idle Gradio session(s)", len(dropped))
        return len(dropped)

    def start(self, blocks) -> SessionSweeper:
        self.blocks = blocks

        def run():
            while True:  # a daemon thread: it ends with the server process
                time.sleep(SWEEP_S)
                try:
                    self.sweep()
                except Exception:  # noqa: BLE001 - a changed Gradio: say so once a sweep, keep serving
                    log.exception("sweeping Gradio's session state failed")

        threading.Thread(target=run, name="imgedit-session-sweeper", daemon=True).start()
        return self


def _holds_nothing(session) -> bool:
    """Every State value the session has is its component's default (read, never set)."""
    for key, value in list(session.state_data.items()):
        block = session.blocks_config.blocks.get(key)
        try:
            if block is None or value != getattr(block, "value", None):
                return False
        except Exception:  # noqa: BLE001 - values that cannot be compared (arrays): kept
            return False
    return True


class PageWatch:
    """ASGI middleware: a session whose page opens its heartbeat is a page's (kept while the page is open)."""

    def __init__(self, app, sweeper: SessionSweeper):
        self.app = app
        self.sweeper = sweeper

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith(HEARTBEAT):
            self.sweeper.paged.setdefault(scope["path"][len(HEARTBEAT):].strip("/")[:100], time.monotonic())
        await self.app(scope, receive, send)
