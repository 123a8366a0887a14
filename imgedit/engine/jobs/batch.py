"""Jobs that outlive a request: one prompt and settings over one or many input sets (a batch).

Both the async REST API (`/v1/jobs`) and the page's Batch tab submit here. Each item is an ordinary
edit in the manager's one FIFO line. Fairness: a job keeps at most one item per worker in the line
at a time; the next item joins at the back only when one finishes, so an edit submitted while a
batch runs waits for at most the batch items already in line (one per worker), never for the rest
of the batch. Two batches alternate the same way. Finished items are stored in the history, and
results are read back from there.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import secrets
import threading
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath

from imgedit.config.settings import Settings
from imgedit.engine.images import encoded_image
from imgedit.engine.interface import Engine
from imgedit.engine.jobs.history import HistoryEntry, HistoryStore
from imgedit.engine.jobs.records import JobRecords, job_state
from imgedit.engine.outputs import SUFFIXES, mask_digest, reencoded
from imgedit.errors import Cancelled, ImgEditError, InputTooLarge, InvalidInput, QueueFull
from imgedit.planning.families import FAMILIES
from imgedit.protocol import (
    JOBS,
    EditRequest,
    ItemState,
    JobState,
    Progress,
    WorkerState,
    new_request_id,
    parameters,
)

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".heic", ".heif",
                  ".avif")
KEEP_FINISHED_S = 3600.0  # finished jobs stay in memory this long; afterwards the history answers
RETRY_BUSY_S = 1.0


@dataclass
class Item:
    index: int
    name: str
    inputs: list[bytes] | None  # encoded images; dropped once the item has run
    state: ItemState = ItemState.QUEUED
    error: str | None = None
    seed: int | None = None
    progress: Progress = Progress()  # of the steps it runs (a speed preset's where one is chosen)
    position: int | None = None  # jobs ahead in line, while waiting there
    entry: HistoryEntry | None = None
    notice: str | None = None  # why an asked-for prompt rewrite was not used (the prompt as sent ran)
    request_id: str | None = None  # its edit's, once it runs (a watched job's live preview is found by it)

    def view(self) -> dict:
        return {"index": self.index, "name": self.name, "state": self.state, "seed": self.seed,
                **self.progress.view(), "error": self.error,
                "outputs": self.entry.outputs if self.entry else 0,
                # enhance_prompt: each item's own rewrite (its images differ), None where the user's
                # prompt ran
                "revised_prompt": self.entry.prompt if self.entry and self.entry.original_prompt else None,
                "notice": self.notice, "weights": self.entry.weights if self.entry else None}


@dataclass
class Job:
    id: str
    owner: str
    source: str
    template: EditRequest  # the prompt and settings; images=() here, per item below
    items: list[Item]
    created: float = field(default_factory=time.time)
    finished_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state(self) -> JobState:
        return job_state([i.state for i in self.items], self.cancel.is_set())

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def position(self) -> int | None:
        waiting = [i.position for i in self.items if i.state is ItemState.QUEUED and i.position is not None]
        return min(waiting) if waiting else None

    def touch(self) -> None:
        self._changed.set()

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._changed.clear()

    def settings(self) -> dict:
        return job_settings(self.template)

    def view(self) -> dict:
        return job_view(self.id, self.state, self.created, self.position, self.settings(),
                        [i.view() for i in self.items])

    def entries(self) -> list[HistoryEntry]:
        return [i.entry for i in self.items if i.entry is not None]


def job_settings(template: EditRequest) -> dict:
    """The settings a job's status shows (every item runs with them), by their REST names: for a job in memory
    and for one read back from the history alike."""
    shown = {}
    for p in parameters(JOBS):
        if p.status:  # declared as shown in a job's status; a file (the mask) by its hash
            value = template.value(p.name)
            if p.kind == "file" and value is not None:
                value = f"sha256:{mask_digest(value)}"
            shown[p.form_name] = value
    return shown


def job_view(job_id: str, state: JobState, created: float, position: int | None, settings: dict,
             items: list[dict]) -> dict:
    """What GET /v1/jobs/<id> answers, for a job in memory or one read back from disk. Items are numbered
    from 1 (`item`), as `?item=N` fetches them (the records' own `index` counts from 0)."""
    shown = [{"item": i["index"] + 1, **{k: v for k, v in i.items() if k != "index"}} for i in items]
    return {"id": job_id, "object": "job", "state": state, "created": int(created), "position": position,
            **settings, "items": shown, "done": sum(i["state"] == ItemState.SUCCEEDED for i in items),
            "failed": sum(i["state"] in (ItemState.FAILED, ItemState.CANCELLED) for i in items)}


def expand_uploads(files: list[tuple[str, bytes]], max_items: int,
                   max_file_size: int) -> list[tuple[str, bytes]]:
    """Uploaded files to one (name, bytes) per item: a zip gives its images, in name order."""
    out: list[tuple[str, bytes]] = []
    for name, data in files:
        if data[:4] == b"PK\x03\x04" or name.lower().endswith(".zip"):
            out += _zip_members(name, data, max_items - len(out), max_file_size)
        else:
            out.append((name, data))
        if len(out) > max_items:
            raise InvalidInput(f"more than {max_items} images in one batch (BATCH_MAX_ITEMS)", "images")
    if not out:
        raise InvalidInput("no input image: upload the images to edit (or a zip of them)", "images")
    return out


def _zip_members(name: str, data: bytes, room: int, max_file_size: int) -> list[tuple[str, bytes]]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = sorted((i for i in archive.infolist() if not i.is_dir()), key=lambda i: i.filename)
        out = []
        for info in members:
            path = PurePosixPath(info.filename)
            hidden = path.name.startswith(".") or "__MACOSX" in path.parts
            if hidden or path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if len(out) >= room:
                out.append((path.name, b""))  # one over: the caller reports the limit
                break
            if info.file_size > max_file_size:
                raise InputTooLarge(f"{path.name} in {name} is larger than {max_file_size:,} bytes "
                                    "(MAX_FILE_SIZE)")
            with archive.open(info) as member:
                raw = member.read(max_file_size + 1)  # the header's size is not trusted
            if len(raw) > max_file_size:
                raise InputTooLarge(f"{path.name} in {name} is larger than {max_file_size:,} bytes "
                                    "(MAX_FILE_SIZE)")
            out.append((path.name, raw))
        return out
    except ImgEditError:
        raise
    except Exception:
        raise InvalidInput(f"{name} is not a readable zip file", "images") from None


def clean_name(name: str, index: int) -> str:
    """File names come from users and end up in messages, the page and zip entries: keep them plain."""
    clean = re.sub(r"[^\w.\- ]", "_", PurePosixPath(name.replace("\\", "/")).name)[:80].strip(" .")
    return clean or f"item-{index + 1}"


def results_zip(items: list[tuple[str, HistoryEntry | None, str | None]], output_format: str = "png",
                quality: int = 100) -> bytes:
    """A zip of every stored output, named after its item, plus errors.txt for items without one; the stored
    PNGs as they are, or each made a JPEG or WebP (`outputs.encoded`, the settings in its EXIF)."""
    buffer = io.BytesIO()
    errors = []
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:  # the images are compressed already
        for n, (name, entry, error) in enumerate(items, 1):
            stem = PurePosixPath(name).stem or f"item-{n}"
            if entry is None:
                errors.append(f"{n:03d} {name}: {error or 'no result'}")
                continue
            for k, path in enumerate(entry.output_paths):
                member = f"{n:03d}-{stem}{f'-{k + 1}' if entry.outputs > 1 else ''}{SUFFIXES[output_format]}"
                if output_format == "png":
                    archive.write(path, member)
                else:
                    archive.writestr(member, reencoded(path, output_format, quality))
        if errors:
            archive.writestr("errors.txt", "\n".join(errors) + "\n")
    return buffer.getvalue()


class JobService:
    """Accepts jobs, runs their items through the manager and keeps them (by owner) for lookups."""

    def __init__(self, settings: Settings, manager: Engine, history: HistoryStore):
        self.manager = manager
        self.settings = settings
        self.history = history
        self._jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task] = set()
        self.records = JobRecords(history.root)  # every item's state on disk, for after a restart

    @property
    def alpha(self) -> bool:
        """Whether inputs keep their transparency (a model that takes RGBA, planning.families)."""
        return FAMILIES[self.manager.family].rgba

    def pending_items(self, owner: str | None = None) -> int:
        # a copy: the panel's thread reads while the event loop adds and drops jobs
        return sum(not i.state.finished for j in list(self._jobs.values()) for i in j.items
                   if owner is None or j.owner == owner)

    def client_items(self) -> int:
        """The most unfinished items one client may hold: CLIENT_SHARE of JOBS_MAX_PENDING, but never
        less than one full job (BATCH_MAX_ITEMS) and, where there is room for two, always one place
        left for somebody else."""
        total = self.settings.jobs_max_pending
        most = max(int(total * self.settings.client_share), min(self.settings.batch_max_items, total))
        return min(most, total - 1) if total > 1 else total

    def submit(self, owner: str, template: EditRequest, inputs: list[tuple[str, list[bytes]]],
               source: str) -> Job:
        """Start a job (on the running event loop). Raises InvalidInput or QueueFull."""
        settings = self.settings
        if len(inputs) > settings.batch_max_items:
            raise InvalidInput(f"{len(inputs)} input sets; a job takes at most {settings.batch_max_items} "
                               "(BATCH_MAX_ITEMS)", "images")
        self._forget_old()
        pending = self.pending_items()
        if pending + len(inputs) > settings.jobs_max_pending:
            raise QueueFull(f"the server is busy ({pending} batch items unfinished); try again later")
        mine, most = self.pending_items(owner), self.client_items()
        if mine + len(inputs) > most:
            raise QueueFull(f"you already have {mine} batch item(s) unfinished; with these {len(inputs)} "
                            f"one client would hold more than {most} of the {settings.jobs_max_pending} "
                            "places (CLIENT_SHARE of JOBS_MAX_PENDING); try again when some have finished")
        status = self.manager.status()
        idle = any(w.state is WorkerState.IDLE for w in status.workers)
        if status.waiting >= settings.queue_max_size and not idle:
            raise QueueFull(f"the server is busy ({status.waiting} jobs waiting); try again later")
        job = Job("job_" + secrets.token_urlsafe(12), owner, source, template,
                  [Item(n, clean_name(name, n), data) for n, (name, data) in enumerate(inputs)])
        ahead = status.waiting + sum(w.state is WorkerState.BUSY for w in status.workers)
        job.items[0].position = ahead
        self._jobs[job.id] = job
        self._persist(job)
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("%s source=%s items=%d accepted", job.id, source, len(inputs))
        return job

    def get(self, owner: str, job_id: str) -> Job | None:
        job = self._jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def delete(self, owner: str, job_id: str) -> int | None:
        """A finished job of `owner` and its stored results, gone: how many results were deleted (None: no
        such finished job). An unfinished one is left as it is (cancel it first)."""
        job = self.get(owner, job_id)
        if job is not None and not job.finished:
            return None
        record = self.records.read(owner, job_id)
        entries = self.history.job(owner, job_id)
        if job is None and record is None and not entries:
            return None
        for entry in entries:
            self.history.delete(owner, entry.id)
        self.records.forget(owner, job_id)
        self._jobs.pop(job_id, None)
        log.info("%s deleted with its %d result(s)", job_id, len(entries))
        return len(entries)

    def _persist(self, job: Job) -> None:
        try:
            self.records.write(job.id, job.owner, job.source, job.created, job.settings(),
                               [i.view() for i in job.items], job.finished_at, job.cancel.is_set())
        except Exception:  # a full disk must not fail the job itself; its record is stale
            log.exception("%s: writing the job's state failed", job.id)

    def _forget_old(self) -> None:
        now = time.time()
        old = [j.id for j in self._jobs.values() if j.finished_at and now - j.finished_at > KEEP_FINISHED_S]
        for job_id in old:
            del self._jobs[job_id]
        if self.settings.output_retention_hours > 0:  # their results are gone by then
            self.records.forget_before(now - self.settings.output_retention_hours * 3600)

    async def _run(self, job: Job) -> None:
        slots = asyncio.Semaphore(max(1, len(self.manager.status().workers)))

        async def one(item: Item) -> None:
            async with slots:  # FIFO: items join the line in order, one per worker at a time
                await self._run_item(job, item)
                job.touch()
                await asyncio.to_thread(self._persist, job)

        try:
            await asyncio.gather(*(one(item) for item in job.items))
        finally:
            for item in job.items:  # the task itself was cancelled (server stopping)
                if not item.state.finished:
                    item.state, item.error, item.inputs = ItemState.CANCELLED, "stopped", None
            job.finished_at = time.time()
            job.touch()
            self._persist(job)  # not in a thread: the task may be being cancelled (server stopping)
            log.info("%s %s: %d/%d succeeded", job.id, job.state,
                     sum(i.state is ItemState.SUCCEEDED for i in job.items), len(job.items))

    async def _run_item(self, job: Job, item: Item) -> None:
        settings = self.settings
        try:
            if job.cancel.is_set():
                raise Cancelled("cancelled before it started")
            alpha = self.alpha
            images = await asyncio.to_thread(
                lambda: tuple(encoded_image(raw, settings.max_input_pixels, f"{item.name}", alpha)
                              for raw in item.inputs))
            # The template's prompt and every setting (speed, lora and lora_scale included) carry over.
            req = replace(job.template, images=images, request_id=new_request_id(), source=job.source,
                          client=job.owner, background=True)
            item.request_id = req.request_id

            def on_wait(ahead: int) -> None:
                if item.state is ItemState.RUNNING:  # paused for an edit someone waits on: in line again
                    item.state = ItemState.QUEUED
                item.position = ahead

            def on_step(step: int, steps: int) -> None:
                item.state, item.position = ItemState.RUNNING, None
                item.progress = Progress(step, steps)

            while True:
                try:
                    result = await self.manager.run(req, on_step=on_step, on_wait=on_wait, cancel=job.cancel)
                    break
                except QueueFull:  # the job was accepted: wait for room instead of failing the item
                    if job.cancel.is_set():
                        raise Cancelled("cancelled while waiting") from None
                    await asyncio.sleep(RETRY_BUSY_S)
            item.seed, item.notice = result.seed, result.notice
            item.entry = await asyncio.to_thread(self.history.save, job.owner, job.id, item.index, req,
                                                 result, item.name)
            item.state = ItemState.SUCCEEDED
        except Cancelled as exc:
            item.state, item.error = ItemState.CANCELLED, exc.message
        except ImgEditError as exc:
            item.state, item.error = ItemState.FAILED, exc.message
        except Exception:
            log.exception("%s item %d failed", job.id, item.index)
            item.state, item.error = ItemState.FAILED, f"internal error (job {job.id}, item {item.index + 1})"
        finally:
            item.inputs, item.position = None, None
