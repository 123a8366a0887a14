"""The async jobs API: POST /v1/jobs (202), GET /v1/jobs (the caller's, newest first), GET /v1/jobs/{id},
GET /v1/jobs/{id}/result (?item=N as soon as that item has finished), DELETE (state `cancelling`, then
`cancelled`, with the items finished before still downloadable; a finished job is deleted with its results).

Same fields (speed, lora and lora_scale included: every item runs with them), API key and limits as
/v1/images/edits. Input sets: `image` (1-3 files) is one set; each `batch` file is one set of one
image (a zip gives one set per image inside); `set1`, `set2`, ... are sets of images each (1-3 for
Qwen-Image-Edit-2509/2511, 1-10 for Qwen-Image-2.1; planning.families). A job
belongs to the owner that created it (imgedit.web.identity: a named key of API_KEYS, the shared
API_KEY, or without keys the bearer token sent): any other owner gets 404 for it. Finished jobs are
answered from the history after a restart.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from imgedit.config.parsers import human_size
from imgedit.config.settings import Settings
from imgedit.engine import heap
from imgedit.engine.images import open_image
from imgedit.engine.interface import Engine
from imgedit.engine.jobs.batch import (
    Item,
    Job,
    JobService,
    clean_name,
    expand_uploads,
    job_settings,
    job_view,
    results_zip,
)
from imgedit.engine.jobs.history import HistoryEntry
from imgedit.engine.outputs import reencoded
from imgedit.engine.validation import BOTH_MASKS, check_aspect, check_counts
from imgedit.errors import ImgEditError, InputTooLarge, InvalidInput
from imgedit.planning.families import FAMILIES
from imgedit.protocol import JOBS, EditRequest, ItemState, JobState, Progress, request_kwargs
from imgedit.web.api.errors import ApiError, rejected
from imgedit.web.api.rest_requests import (
    IMAGE_FIELDS,
    check_body,
    flag_field,
    form_fields,
    mask_fields,
    output_format,
    read_form,
)
from imgedit.web.identity import key_holder
from imgedit.web.metrics import Metrics

log = logging.getLogger(__name__)
SET_FIELD = re.compile(r"set(\d{1,4})(\[\])?")
BATCH_FIELDS = ("batch", "batch[]")


def _not_found(job_id: str) -> ApiError:
    return ApiError(404, f"no job {job_id[:40]!r} for this API key", "not_found")


def _links(view: dict) -> dict:
    view["status_url"] = f"/v1/jobs/{view['id']}"
    view["result_url"] = f"/v1/jobs/{view['id']}/result"
    return view


def _restored_view(job_id: str, entries: list[HistoryEntry]) -> dict:
    """A REST edit (/v1/images/edits), stored as a one-item job, or a job from before job records."""
    first = entries[0]
    # each item as a job in memory shows it (Item.view: one place lists an item's status)
    items = [Item(e.item, e.name, None, ItemState.SUCCEEDED, seed=e.seed,
                  progress=Progress(e.steps, e.steps), entry=e).view() for e in entries]
    # as it was asked for (the store keeps no mask)
    rewritten = first.original_prompt is not None
    asked = EditRequest(images=(), **request_kwargs(
        {**first.kept(), "prompt": first.original_prompt or first.prompt, "enhance_prompt": rewritten}))
    view = job_view(job_id, JobState.SUCCEEDED, first.created, None, job_settings(asked), items)
    return {**view, "restored": True}


def _with_previews(view: dict, job: Job, manager: Engine) -> dict:
    """A job made with preview=true: each running item's newest live preview as a data URL (`preview`, also at
    the top for the first running item); nothing for other jobs."""
    if not job.template.watch:
        return view
    for item, shown in zip(job.items, view["items"], strict=True):
        jpeg = manager.preview(item.request_id) if item.request_id and not item.state.finished else None
        if jpeg:
            shown["preview"] = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
            view.setdefault("preview", shown["preview"])
    return view


def _recorded_view(job_id: str, record: dict) -> dict:
    """A job this server no longer holds in memory (it restarted): as its record on disk says."""
    view = job_view(job_id, record["state"], record["created"], None, record["settings"], record["items"])
    return {**view, "restored": True}


def build_jobs_router(settings: Settings, manager: Engine, jobs: JobService, metrics: Metrics) -> APIRouter:
    router = APIRouter()
    # JPEG/WebP results are made from the stored PNGs at each request (a job may hold 1,000 images): one
    # thread, so such requests queue behind each other instead of taking every CPU from the server and the
    # workers.
    reencoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reencode")
    # the key check, once: every route below takes its owner from it (a 401 before the route runs)
    key = Depends(key_holder(settings))

    @router.post("/v1/jobs")
    async def create_job(request: Request, owner: str = key) -> Response:
        async def accepted() -> Job:
            template, inputs = await _parse(request, settings, manager)
            return jobs.submit(owner, template, inputs, source="rest")

        job = await rejected(metrics, "/v1/jobs", accepted())
        return JSONResponse(_links(job.view()), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})

    @router.get("/v1/jobs")
    async def list_jobs(limit: str = "20", after: str | None = None, owner: str = key) -> Response:
        """The caller's own jobs, newest first, `limit` (1-100) at a time; `after=<id>` gives the next
        page."""
        if not (limit.isdecimal() and 1 <= int(limit[:4]) <= 100):
            raise InvalidInput(f"limit must be a whole number from 1 to 100, got {limit[:40]!r}", "limit")
        page = await asyncio.to_thread(jobs.records.newest, owner, int(limit), after)
        if page is None:
            raise ApiError(404, f"after={str(after)[:40]!r} is not one of this API key's jobs", "not_found",
                           "after")
        records, more = page
        views = []
        for record in records:  # a job this server runs is shown as it is now; others as recorded
            live = jobs.get(owner, record["id"])
            views.append(_links(live.view() if live is not None else _recorded_view(record["id"], record)))
        return JSONResponse({"object": "list", "data": views, "has_more": more,
                             "first_id": views[0]["id"] if views else None,
                             "last_id": views[-1]["id"] if views else None})

    @router.get("/v1/jobs/{job_id}")
    async def job_status(job_id: str, owner: str = key) -> Response:
        job = jobs.get(owner, job_id)
        if job is not None:
            return JSONResponse(_links(_with_previews(job.view(), job, manager)))
        record = await asyncio.to_thread(jobs.records.read, owner, job_id)
        if record is not None:
            return JSONResponse(_links(_recorded_view(job_id, record)))
        entries = await asyncio.to_thread(jobs.history.job, owner, job_id)
        if not entries:
            raise _not_found(job_id)
        return JSONResponse(_links(_restored_view(job_id, entries)))

    @router.get("/v1/jobs/{job_id}/result")
    async def job_result(job_id: str, request: Request, item: str | None = None,
                         owner: str = key) -> Response:
        """The result as stored (PNG), or as `?output_format=jpeg|webp&output_compression=0-100` asks."""
        image_format, quality = output_format(request.query_params)
        job = jobs.get(owner, job_id)
        if job is not None:
            rows = [(i.name, i.entry, i.error) for i in job.items]
            one = int(item) if item is not None and item.isdecimal() and len(item) <= 9 else 0
            asked = job.items[one - 1] if 1 <= one <= len(rows) else None  # else: a 400/404 below
            asked_unfinished = asked is not None and not asked.state.finished
            if not job.finished and (item is None or asked_unfinished):
                what = f"item {one} is {asked.state}" if asked is not None else f"job {job.id} is {job.state}"
                raise ApiError(409, f"{what}; poll GET /v1/jobs/{job.id} until it has finished "
                               "(?item=N fetches an item as soon as it has)", "not_finished")
        else:
            record = await asyncio.to_thread(jobs.records.read, owner, job_id)
            entries = await asyncio.to_thread(jobs.history.job, owner, job_id)
            if record is not None:
                # another live server's (a shared folder)
                if not JobState(record["state"]).finished:
                    raise ApiError(409, f"job {job_id} is {record['state']}", "not_finished")
                stored = {e.item: e for e in entries}
                rows = [(i["name"], stored.get(i["index"]), i["error"]) for i in record["items"]]
            elif entries:
                rows = [(e.name, e, None) for e in entries]
            else:
                raise _not_found(job_id)
        if item is not None:
            if not (item.isdecimal() and len(item) <= 9):
                raise InvalidInput(f"item must be a whole number from 1, got {item[:40]!r}", "item")
            item = int(item)
            if not 1 <= item <= len(rows):
                raise ApiError(404, f"item {item} is out of range: 1 to {len(rows)}", "not_found", "item")
            rows = [rows[item - 1]]
        stored = [entry for _, entry, _ in rows if entry is not None]
        if not stored:
            reasons = "; ".join(f"{name}: {error}" for name, _, error in rows if error)[:500]
            raise ApiError(409, f"the job has no result ({reasons or 'nothing was stored'})", "no_result")
        try:
            loop = asyncio.get_running_loop()
            # None: the loop's own threads (file reads)
            executor = None if image_format == "png" else reencoding
            if len(rows) == 1 and stored[0].outputs == 1:
                path = stored[0].output_paths[0]
                if image_format == "png":
                    call = (path.read_bytes,)
                else:
                    call = (reencoded, path, image_format, quality)
                return Response(await loop.run_in_executor(executor, *call),
                                media_type=f"image/{image_format}")
            data = await loop.run_in_executor(executor, results_zip, rows, image_format, quality)
        except FileNotFoundError:  # pruned between the lookup and the read
            raise ApiError(410, "the stored result was deleted (OUTPUT_RETENTION_HOURS / OUTPUT_MAX_GB)",
                           "gone") from None
        return Response(data, media_type="application/zip",
                        headers={"Content-Disposition": f'attachment; filename="{job_id}.zip"'})

    @router.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str, owner: str = key) -> Response:
        """An unfinished job is cancelled; a finished one is deleted with its stored results."""
        job = jobs.get(owner, job_id)
        if job is not None and not job.finished:
            job.cancel.set()  # waiting items leave the line; a running one stops at its next step
            return JSONResponse(_links(job.view()))
        deleted = await asyncio.to_thread(jobs.delete, owner, job_id)
        if deleted is None:
            raise _not_found(job_id)
        return JSONResponse({"id": job_id, "deleted": True, "results_deleted": deleted})

    return router


async def _parse(request: Request, settings: Settings,
                 manager: Engine) -> tuple[EditRequest, list[tuple[str, list[bytes]]]]:
    limit = settings.max_file_size * (settings.batch_max_items + 2) + 1_000_000
    check_body(request, limit, "multipart/form-data",
               "send multipart/form-data with 'image' (or 'batch') files and a 'prompt'")
    most = FAMILIES[manager.family].max_images  # images in one set
    form = await read_form(request, most * settings.batch_max_items + 3,
                           f"a job takes at most {settings.batch_max_items} input sets: BATCH_MAX_ITEMS")

    # The cheap fields first: a request without a prompt (or with a bad number) costs no file read.
    # every item runs with these
    # preview=true: someone watches, and each running item's status carries a live preview (runtime.preview)
    template = EditRequest(images=(), **request_kwargs(form_fields(form, JOBS)), source="rest",
                           watch=flag_field(form, "preview"))
    manager.check(template)  # the values, and whether these workers can run them: as /v1/images/edits
    # Then count the input sets from the field names alone (a zip counts once here, its members below).
    numbered = sorted((int(m.group(1)), key) for key in set(form.keys()) if (m := SET_FIELD.fullmatch(key)))
    singles = [u for key in IMAGE_FIELDS for u in form.getlist(key)]
    batches = [u for key in BATCH_FIELDS for u in form.getlist(key)]
    counted = bool(singles) + len(batches) + len(numbered)
    if counted > settings.batch_max_items:
        raise InvalidInput(f"{counted} input sets; a job takes at most {settings.batch_max_items} "
                           "(BATCH_MAX_ITEMS)", "images")

    async def read(upload) -> tuple[str, bytes]:
        if not isinstance(upload, UploadFile):
            raise InvalidInput("images must be file uploads, not text fields", "images")
        raw = await upload.read(settings.max_file_size + 1)
        name = clean_name(upload.filename or "", 0)
        if len(raw) > settings.max_file_size:
            raise InputTooLarge(f"{name} is larger than {human_size(settings.max_file_size)} (MAX_FILE_SIZE)")
        return name, raw

    sets: list[tuple[str, list[bytes]]] = []
    single = [await read(u) for u in singles]
    if single:
        sets.append((single[0][0], [raw for _, raw in single]))
    batch = [await read(u) for u in batches]
    if batch:
        room = settings.batch_max_items - len(sets) - len(numbered)
        sets += [(name, [raw]) for name, raw in expand_uploads(batch, room, settings.max_file_size)]
    for _, key in numbered:
        files = [await read(u) for u in form.getlist(key)]
        sets.append((files[0][0], [raw for _, raw in files]))
    if not sets:
        raise InvalidInput("no input image: send 'image', 'batch' or 'set1', 'set2', ... files", "images")
    if len(sets) > settings.batch_max_items:
        raise InvalidInput(f"{len(sets)} input sets; a job takes at most {settings.batch_max_items} "
                           "(BATCH_MAX_ITEMS)", "images")
    for _, raws in sets:
        check_counts(len(raws), manager.family)
    # Check every image now, one at a time, its pixels dropped at once (the bytes are kept, not the pixels,
    # while items wait). As on the page's Batch tab, what can run runs: an item whose file cannot be read
    # fails alone, by name, when its turn comes; only a job of which nothing can run is refused.
    checked = await asyncio.to_thread(check_images, sets, settings, manager.family)
    if all(isinstance(c, ImgEditError) for c in checked):
        raise checked[0]
    firsts = [c for c in checked if not isinstance(c, ImgEditError)]
    if form.getlist("mask") and (template.mask_prompt or "").strip():  # each item would fail: refused now
        raise InvalidInput(BOTH_MASKS, "mask_prompt")
    if form.getlist("mask"):  # one mask for every item: each item's first image must have its size
        masking = await mask_fields(form, settings, firsts[0])
        for (name, _), size in zip(sets, checked, strict=True):
            if not isinstance(size, ImgEditError) and size != firsts[0]:
                raise InvalidInput(f"{name} is {size[0]}x{size[1]} but the mask is "
                                   f"{firsts[0][0]}x{firsts[0][1]}: one mask is used for every item, so each "
                                   "item's first image must be its size", "mask")
        template = replace(template, mask=masking["mask"])
    return template, sets


def check_images(sets: list[tuple[str, list[bytes]]], settings: Settings,
                 family: str) -> list[tuple[int, int] | ImgEditError]:
    """Decode each image alone (its header is checked against MAX_INPUT_PIXELS before any pixel is
    decoded) and check its aspect as /v1/images/edits does; never more than one image in memory.
    Returns per set its first image's size (a mask must match it), or why the set cannot run."""
    checked: list[tuple[int, int] | ImgEditError] = []
    for name, raws in sets:
        try:
            for k, raw in enumerate(raws):
                label = name if len(raws) == 1 else f"{name} (image {k + 1})"
                image = open_image(raw, settings.max_input_pixels, label, FAMILIES[family].rgba)
                check_aspect(image.size, family, label)
                if k == 0:
                    first = image.size
                del image
        except ImgEditError as exc:
            checked.append(exc)
            continue
        checked.append(first)
    heap.give_back()  # the decoded pixels are gone: their pages too (else each thread's arena keeps them)
    return checked
