"""Finished edits on disk: PNGs and inputs under OUTPUT_DIR, indexed in SQLite, pruned by age and size.

One folder per stored item (`<day>/<id>/`: `out-N.png`, `in-N.png`, `thumb.png`) and one row in
`history.sqlite3`. Rows are keyed by an owner (a browser, a user or an API token, see
`imgedit.web.identity`), so a lookup always names the owner too: another owner's id is simply not found.
Only successful jobs are stored; nothing is written for a failed or cancelled one.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import shutil
import sqlite3
import threading
import time
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from imgedit.config.settings import Settings
from imgedit.engine import heap
from imgedit.engine.images import decoded
from imgedit.engine.outputs import save_png
from imgedit.protocol import EditRequest, EditResult, Param, as_declared, parameters

log = logging.getLogger(__name__)

DB_NAME = "history.sqlite3"
THUMB_SIDE = 256
@dataclass(frozen=True)
class HistoryEntry:
    """One stored item: the settings that made it (enough to re-run it) and where its files are."""

    id: str
    job_id: str
    item: int
    owner: str
    created: float
    source: str
    name: str
    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    true_cfg_scale: float | None  # None: the server's default at the time
    num_images: int
    width: int | None  # as asked for; None = automatic
    height: int | None
    out_width: int
    out_height: int
    outputs: int
    inputs: int
    folder: Path
    bytes: int
    speed: str | None = None  # as asked for: None = quality
    lora: str | None = None  # the picked LoRA's name; None = none
    lora_scale: float | None = None  # its strength as asked for; None = 1
    # the user's words when the model rewrote them (`prompt` is the one used)
    original_prompt: str | None = None
    # FAST_QUANTIZE's lossy copy the edit ran on (fp8 | int8); None = the model's own
    weights: str | None = None
    # the declared parameters without a column of their own, as asked for: those declared `history` (expand,
    # mask_prompt) and those without an EditRequest attribute (EditRequest.options); JSON in the store
    options: dict = field(default_factory=dict)

    def kept(self) -> dict:
        """{declared parameter: value} as this entry keeps them (enough to re-run it): each one declared
        `history`, from its column (by its name or its `resolved` one), else from `options`, else its default
        (the edit did not ask for it); then the rest of `options`."""
        declared = [p for p in parameters() if p.history]
        columns = as_declared(self, declared)
        return {**{p.name: columns.get(p.name, self.options.get(p.name, p.default)) for p in declared},
                **self.options}

    @property
    def output_paths(self) -> list[Path]:
        return [self.folder / f"out-{i}.png" for i in range(self.outputs)]

    @property
    def input_paths(self) -> list[Path]:
        return [self.folder / f"in-{i}.png" for i in range(self.inputs)]

    @property
    def thumb_path(self) -> Path:
        return self.folder / "thumb.png"


# The table's columns: HistoryEntry's fields, by name (folder: relative to the store; options: JSON)
COLUMNS = tuple(f.name for f in fields(HistoryEntry))
_COLUMNS = ", ".join(COLUMNS)
_SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL", Path: "TEXT", dict: "TEXT"}


def _column_types() -> dict[str, str]:
    """Each column's SQLite type, from HistoryEntry's annotations: `X | None` may be NULL, and so may a field
    with a default (added after the first release: an older version's rows hold NULL there)."""
    hints = typing.get_type_hints(HistoryEntry)
    types = {}
    for f in fields(HistoryEntry):
        args = typing.get_args(hints[f.name])
        base = next(a for a in args if a is not type(None)) if args else hints[f.name]
        required = not args and f.default is MISSING and f.default_factory is MISSING
        types[f.name] = _SQL_TYPES[typing.get_origin(base) or base] + (" NOT NULL" if required else "")
    return types


COLUMN_TYPES = _column_types()
_COLUMN_LIST = ", ".join(f"{column} {kind}" for column, kind in COLUMN_TYPES.items())
_SCHEMA = (f"CREATE TABLE IF NOT EXISTS results ({_COLUMN_LIST}, PRIMARY KEY (id));\n"
           "CREATE INDEX IF NOT EXISTS results_owner ON results (owner, created);\n"
           "CREATE INDEX IF NOT EXISTS results_job ON results (job_id, item);\n"
           "CREATE INDEX IF NOT EXISTS results_created ON results (created);\n")


class HistoryStore:
    """Thread-safe: one SQLite connection behind a lock (writes are a few rows per finished job)."""

    def __init__(self, root: str | Path, retention_hours: float = 0.0, max_bytes: int = 0):
        self.root = Path(root).expanduser().resolve()
        self.retention_s = retention_hours * 3600.0
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob("*/.partial-*"):  # a crash while writing: never indexed
            shutil.rmtree(leftover, ignore_errors=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / DB_NAME, check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._add_missing_columns()
        self.prune()

    @classmethod
    def from_settings(cls, settings: Settings) -> HistoryStore:
        return cls(settings.output_dir, settings.output_retention_hours, int(settings.output_max_gb * 1e9))

    def _add_missing_columns(self) -> None:
        """CREATE TABLE IF NOT EXISTS leaves an older version's table as it was: add what it lacks."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(results)")}
        for name, kind in COLUMN_TYPES.items():
            if name not in have:  # a field added after that version: never NOT NULL (its rows have none)
                try:
                    nullable = kind.removesuffix(" NOT NULL")
                    self._db.execute(f"ALTER TABLE results ADD COLUMN {name} {nullable}")
                except sqlite3.OperationalError as exc:  # another process opening the same folder added it
                    if "duplicate column" not in str(exc):
                        raise
                log.info("history: added column %s to %s", name, self.root / DB_NAME)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- writing ----
    def save(self, owner: str, job_id: str, item: int, req: EditRequest, result: EditResult,
             name: str = "", pngs: list[bytes] | None = None) -> HistoryEntry:
        """Write the result's PNGs, the inputs (for a re-run) and a thumbnail, then index them.
        `pngs`: the results already encoded (with their settings), written as they are."""
        entry_id = secrets.token_hex(8)  # request ids repeat across restarts; these never collide
        created = time.time()
        day = self.root / time.strftime("%Y-%m-%d", time.gmtime(created))
        day.mkdir(parents=True, exist_ok=True)
        partial = day / f".partial-{entry_id}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            for i, image in enumerate(result.images):
                if pngs is not None:
                    (partial / f"out-{i}.png").write_bytes(pngs[i])
                else:
                    save_png(image, partial / f"out-{i}.png")  # with the settings that made it
            for i, image in enumerate(req.images):  # one decoded at a time
                decoded(image).save(partial / f"in-{i}.png", format="PNG", compress_level=1)
            heap.give_back()  # their pixels' pages, which this thread's arena would keep
            thumb = result.images[0].copy()
            thumb.thumbnail((THUMB_SIDE, THUMB_SIDE))
            thumb.save(partial / "thumb.png", format="PNG")
            size = sum(p.stat().st_size for p in partial.iterdir())
            folder = day / entry_id
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)  # atomic: a folder is either complete or absent
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        entry = HistoryEntry(
            id=entry_id, job_id=job_id, item=item, owner=owner, created=created, source=req.source,
            name=name or f"item {item + 1}", **_columns_of(req, result),
            out_width=result.width, out_height=result.height, outputs=len(result.images),
            inputs=len(req.images), folder=folder, bytes=size,
            original_prompt=req.prompt if result.prompt else None, weights=result.weights,
            options=_options_of(req))
        stored = {**vars(entry), "folder": str(folder.relative_to(self.root)),
                  "options": json.dumps(entry.options) if entry.options else None}
        row = tuple(stored[column] for column in COLUMNS)
        places = ", ".join("?" * len(row))
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO results ({_COLUMNS}) VALUES ({places})", row)
        self.prune()
        return entry

    async def record(self, owner: str, job_id: str, item: int, req: EditRequest, result: EditResult,
                     name: str = "", pngs: list[bytes] | None = None) -> HistoryEntry | None:
        """`save` off the event loop; a full disk is logged, never turned into a failed edit."""
        try:
            return await asyncio.to_thread(self.save, owner, job_id, item, req, result, name, pngs)
        except Exception:
            log.exception("%s: storing the result failed", job_id)
            return None

    rows = "results"  # what merge_owner moves, in its log line

    def merge_owner(self, old: str, new: str) -> int:
        """Every result of `old` now `new`'s (web.identity.merge_login_keys); how many moved."""
        with self._lock:
            return self._db.execute("UPDATE results SET owner = ? WHERE owner = ?", (new, old)).rowcount

    # ---- reading (always by owner) ----
    def list(self, owner: str, limit: int = 200) -> list[HistoryEntry]:
        return self._select("WHERE owner = ? ORDER BY created DESC, item LIMIT ?", (owner, limit))

    def get(self, owner: str, entry_id: str) -> HistoryEntry | None:
        found = self._select("WHERE owner = ? AND id = ?", (owner, entry_id))
        return found[0] if found else None

    def job(self, owner: str, job_id: str) -> list[HistoryEntry]:
        return self._select("WHERE owner = ? AND job_id = ? ORDER BY item", (owner, job_id))

    def delete(self, owner: str, entry_id: str) -> bool:
        entry = self.get(owner, entry_id)
        if entry is not None:
            self._remove([entry])
        return entry is not None

    def _select(self, where: str, args: tuple) -> list[HistoryEntry]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM results {where}", args).fetchall()
        entries = []
        for row in rows:
            stored = dict(zip(COLUMNS, row, strict=True))
            stored.update(folder=self.root / stored["folder"], options=_options(stored["options"]))
            entries.append(HistoryEntry(**stored))
        return entries

    # ---- pruning ----
    def total_bytes(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM results").fetchone()[0]

    def prune(self, now: float | None = None) -> int:
        """Drop items older than the retention, then, until under the size cap, the oldest item of
        whoever holds the most bytes. Returns how many were removed."""
        now = time.time() if now is None else now
        removed: list[HistoryEntry] = []
        if self.retention_s > 0:
            removed += self._select("WHERE created < ?", (now - self.retention_s,))
        if self.max_bytes > 0:
            over = self.total_bytes() - sum(e.bytes for e in removed) - self.max_bytes
            if over > 0:  # the heaviest owner's oldest first: one client's edits cannot push out everyone's
                gone = {e.id for e in removed}
                queues: dict[str, collections.deque[HistoryEntry]] = {}
                for entry in self._select("ORDER BY created, item", ()):
                    if entry.id not in gone:
                        queues.setdefault(entry.owner, collections.deque()).append(entry)
                weight = {owner: sum(e.bytes for e in queue) for owner, queue in queues.items()}
                while over > 0 and weight:
                    owner = max(weight, key=weight.__getitem__)
                    entry = queues[owner].popleft()
                    removed.append(entry)
                    over -= entry.bytes
                    weight[owner] -= entry.bytes
                    if not queues[owner]:
                        del weight[owner]
        if removed:
            self._remove(removed)
            log.info("history: pruned %d stored result(s)", len(removed))
        return len(removed)

    def _remove(self, entries: list[HistoryEntry]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM results WHERE id = ?", [(e.id,) for e in entries])
        for entry in entries:
            shutil.rmtree(entry.folder, ignore_errors=True)


def _in_options(p: Param) -> bool:
    """A declared `history` parameter without a column (by its name or its `resolved` one): kept in
    `options`."""
    return p.history and p.name not in COLUMNS and p.worker_name not in COLUMNS


def _columns_of(req: EditRequest, result: EditResult) -> dict:
    """The entry's parameter columns: each declared `history` parameter with a column (by its name or its
    `resolved` one), as asked for, or where declared `kept_as_ran` as the edit ran (the result's value where
    it has one: the rewritten prompt, the seed drawn, the steps and images made); an empty text, or the
    parameter's `none_word`, is kept as its default (no LoRA: None)."""
    kept = [p for p in parameters() if p.history and not _in_options(p)]
    ran = as_declared(result, [p for p in kept if p.kept_as_ran])
    columns = {}
    for p in kept:
        value = req.value(p.name) if ran.get(p.name) is None else ran[p.name]
        if p.kind == "text" and value in ("", p.none_word):
            value = p.default
        columns[p.name if p.name in COLUMNS else p.worker_name] = value
    return columns


def _options_of(req: EditRequest) -> dict:
    """What the entry's `options` keep of a request: the declared parameters without a column that it asked
    for (a re-run pads again, outlines the same words again)."""
    asked = {p.name: req.value(p.name) for p in parameters()
             if _in_options(p) and req.value(p.name) not in (None, "", p.default)}
    return {**req.options, **asked}


def _options(stored: str | None) -> dict:
    """The options column as written by `save` (JSON of an object), {} for none or anything else."""
    try:
        options = json.loads(stored) if stored else {}
    except ValueError:
        return {}
    return options if isinstance(options, dict) else {}
