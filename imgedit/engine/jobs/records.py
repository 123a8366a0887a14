"""Every job's items and their states on disk (the `jobs` table beside the history's results), so a
job reads back truthfully after a restart: written when the job is accepted and at each item's
change. A job its server never finished (kill -9, a crash, the power) is closed when the next
server on this host opens the folder and finds that process gone: its unfinished items become
`failed`, "the server stopped before this item finished", and the job's state follows.

One server process per OUTPUT_DIR and host; a job is closed only when the process that ran it is
gone (same host, its pid no longer running the same process), never because another server opened
the folder.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path

from imgedit.protocol import ItemState, JobState, Progress

log = logging.getLogger(__name__)

STOPPED = "the server stopped before this item finished"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    source TEXT NOT NULL,
    created REAL NOT NULL,
    finished REAL,
    cancelled INTEGER NOT NULL DEFAULT 0,
    process TEXT NOT NULL,
    settings TEXT NOT NULL,
    items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created);
"""


def job_state(states: list[str], cancelled: bool) -> JobState:
    """A job's state from its items' (ItemState, or their values as read back from disk)."""
    states = [ItemState(s) for s in states]
    if not all(s.finished for s in states):
        if cancelled:
            # asked to stop: waiting items are leaving the line, a running one stops at a step
            return JobState.CANCELLING
        return JobState.RUNNING if any(s is not ItemState.QUEUED for s in states) else JobState.QUEUED
    if cancelled and ItemState.CANCELLED in states:
        return JobState.CANCELLED  # the items that finished before it was cancelled can still be fetched
    # A cancel that came after every item had ended took nothing away: the job stays as it ended (a DELETE
    # of a finished job, or the page's batch handler closing, once made a succeeded job "cancelled").
    ok = states.count(ItemState.SUCCEEDED)
    return JobState.SUCCEEDED if ok == len(states) else (JobState.FAILED if ok == 0 else JobState.PARTIAL)


def _items(raw: str) -> list[dict]:
    """A record's items as written, an older record's with today's keys (Progress.upgraded)."""
    return [Progress.upgraded(item) for item in json.loads(raw)]


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None if there is none: with the pid
    it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _gone(process: str) -> bool:
    host, _, rest = process.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdecimal():
        return False  # another machine's server (a shared volume): it cannot be told from here
    return _start_time(int(pid)) != started


class JobRecords:
    """Thread-safe: its own SQLite connection to the history's database, behind a lock."""

    def __init__(self, root: str | Path, db_name: str = "history.sqlite3"):
        self._lock = threading.Lock()
        self._process = this_process()
        self._db = sqlite3.connect(Path(root).expanduser() / db_name, check_same_thread=False,
                                   isolation_level=None, timeout=30)
        self._db.executescript(_SCHEMA)
        self.closed_on_open = self._close_abandoned()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def write(self, job_id: str, owner: str, source: str, created: float, settings: dict, items: list[dict],
              finished: float | None = None, cancelled: bool = False) -> None:
        row = (job_id, owner, source, created, finished, int(cancelled), self._process, json.dumps(settings),
               json.dumps(items))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)

    rows = "jobs"  # what merge_owner moves, in its log line

    def merge_owner(self, old: str, new: str) -> int:
        """Every job of `old` now `new`'s (web.identity.merge_login_keys); how many moved."""
        with self._lock:
            return self._db.execute("UPDATE jobs SET owner = ? WHERE owner = ?", (new, old)).rowcount

    def read(self, owner: str, job_id: str) -> dict | None:
        """The job as last written, for its owner only: created, finished, cancelled, settings, items,
        state."""
        with self._lock:
            row = self._db.execute("SELECT created, finished, cancelled, settings, items FROM jobs "
                                   "WHERE id = ? AND owner = ?", (job_id, owner)).fetchone()
        if row is None:
            return None
        items = _items(row[4])
        return {"created": row[0], "finished": row[1], "cancelled": bool(row[2]),
                "settings": json.loads(row[3]), "items": items,
                "state": job_state([i["state"] for i in items], bool(row[2]))}

    def newest(self, owner: str, limit: int, after: str | None = None) -> tuple[list[dict], bool] | None:
        """The owner's jobs, newest first: `limit` of them after the job `after` (None: from the newest),
        and whether there are more. None when `after` is not one of the owner's jobs."""
        with self._lock:
            where, args = "owner = ?", [owner]
            if after is not None:
                row = self._db.execute("SELECT created FROM jobs WHERE id = ? AND owner = ?",
                                       (after, owner)).fetchone()
                if row is None:
                    return None
                where += " AND (created < ? OR (created = ? AND id < ?))"
                args += [row[0], row[0], after]
            rows = self._db.execute("SELECT id, created, finished, cancelled, settings, items FROM jobs "
                                    f"WHERE {where} ORDER BY created DESC, id DESC LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        jobs = []
        for job_id, created, finished, cancelled, settings, raw in rows[:limit]:
            items = _items(raw)
            jobs.append({"id": job_id, "created": created, "finished": finished,
                         "settings": json.loads(settings), "items": items,
                         "state": job_state([i["state"] for i in items], bool(cancelled))})
        return jobs, len(rows) > limit

    def forget(self, owner: str, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ? AND owner = ?", (job_id, owner))

    def forget_before(self, when: float) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE created < ? AND finished IS NOT NULL", (when,))

    def _close_abandoned(self) -> int:
        with self._lock:
            rows = self._db.execute("SELECT id, process, items FROM jobs WHERE finished IS NULL").fetchall()
        closed = 0
        for job_id, process, raw in rows:
            if process == self._process or not _gone(process):
                continue
            items = [Progress.upgraded(item) for item in json.loads(raw)]
            for item in items:
                if not ItemState(item["state"]).finished:  # none of its steps runs on: back to step 0
                    stopped = Progress(0, Progress.read(item).steps)
                    item.update(state=ItemState.FAILED, error=STOPPED, **stopped.view())
            with self._lock:
                self._db.execute("UPDATE jobs SET items = ?, finished = ? WHERE id = ?",
                                 (json.dumps(items), time.time(), job_id))
            closed += 1
        if closed:
            log.warning("jobs: %d job(s) left unfinished by a server that stopped; their unfinished items "
                        "are reported failed", closed)
        return closed
