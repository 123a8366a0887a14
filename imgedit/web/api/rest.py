"""REST for operators and OpenAI clients: /health, /metrics, /v1/images/edits and /v1/images/generations.

`/v1/images/edits` speaks OpenAI's Images API (multipart; `image` or `image[]`, `prompt`, `n`, `size`,
`response_format=b64_json`) plus our declared extensions, each by its REST name (imgedit.protocol's
declaration, listed in docs/PARAMETERS.md; the openai SDK sends extensions through `extra_body`).
OpenAI's `output_format` (png | jpeg | webp) and `output_compression` (0-100, the JPEG/WebP quality) pick
the reply's encoding: PNG by default (lossless), JPEG the fastest.
OpenAI's `mask` is taken (imgedit.engine.masks), with `mask_grow`, `mask_feather` and `strength`. Jobs go
to the same manager line and workers as the UI. Errors come back in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.

`/v1/masks` outlines `mask_prompt` in an image and returns the mask alone (for a caller to adjust before its
edit); `mask_prompt` on `/v1/images/edits` does the same inside the edit's job.

`/v1/images/generations` is OpenAI's text to image (a JSON body: `prompt`, `n`, `size`, `response_format`,
`output_format`, `output_compression`, and the same extensions) for a model that makes images from a prompt
alone (Qwen-Image-2.1); the edit-only models answer it with a 400 that says so.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from imgedit.config.settings import Settings
from imgedit.engine.images import frame_notices
from imgedit.engine.interface import Engine
from imgedit.engine.jobs.history import HistoryStore
from imgedit.engine.outputs import encoded
from imgedit.engine.workers.gpus import GpuMonitor
from imgedit.errors import ImgEditError, InvalidInput
from imgedit.protocol import EditRequest, EditResult, Resolved, WorkerState, param
from imgedit.web.api.errors import ApiError, openai_error, rejected
from imgedit.web.api.image_urls import build_image_urls_router, image_urls
from imgedit.web.api.rest_requests import edit_form, parse_edit, parse_generation, read_images
from imgedit.web.api.schema import edit_body, generation_body
from imgedit.web.identity import key_holder
from imgedit.web.metrics import CONTENT_TYPE, Metrics
from imgedit.web.public import full_snapshot, open_snapshot

log = logging.getLogger(__name__)

# every /v1 route and its methods, for the 404/405 fallback
V1_ROUTES = {"/v1/images/edits": ("POST",), "/v1/images/generations": ("POST",),
             "/v1/prompts/enhance": ("POST",), "/v1/masks": ("POST",), "/v1/status": ("GET",),
             "/v1/models": ("GET",)}
HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class InternalError(ImgEditError):
    """An unexpected failure, answered as a 500 naming the request (the traceback goes to the log)."""

    kind = "internal_error"


def build_router(settings: Settings, manager: Engine, metrics: Metrics, monitor: GpuMonitor,
                 history: HistoryStore | None = None) -> APIRouter:
    router = APIRouter()
    started = int(time.time())  # a model's `created`: when this server came up
    # the key check, once: every route below takes its owner from it (a 401 before the route runs)
    key = Depends(key_holder(settings))

    @router.get("/health")
    def health() -> JSONResponse:
        """Liveness + readiness: 200 once every worker has loaded and one is healthy; 503 otherwise. A
        worker being restarted does not make a server with another healthy worker unready."""
        status = manager.status()
        first_load = not status.workers or any(w.state is WorkerState.LOADING and not w.restarts
                                               for w in status.workers)
        coming_back = any(w.state.coming and w.restarts for w in status.workers)
        ready = status.ready and not first_load
        if ready:
            state = "ok"
        elif status.error:
            state = "failed"
        elif first_load:
            state = "loading"
        else:
            state = "restarting" if coming_back else "failed"
        body = open_snapshot(monitor, status)  # no job ids, pids, paths: imgedit.web.public
        body["status"] = state
        return JSONResponse(body, status_code=200 if ready else 503)

    @router.get("/gpu_status")
    def gpu_status() -> JSONResponse:
        """The GPU panel's numbers over plain HTTP, as the gradio API's /gpu_status returns them (open, as
        /health)."""
        return JSONResponse(open_snapshot(monitor, manager.status()))

    @router.get("/v1/status")
    def details(owner: str = key) -> JSONResponse:
        """What /health leaves out (job ids, process ids, the checkpoint, LoRA files), for key holders."""
        return JSONResponse(full_snapshot(monitor, manager.status(), owner))

    @router.get("/metrics")
    def prometheus(owner: str = key) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/v1/images/edits", openapi_extra=edit_body())
    async def images_edits(request: Request, owner: str = key) -> Response:
        began = time.perf_counter()  # the upload: the body read, the images decoded and checked
        parsed = await rejected(metrics, "/v1/images/edits", parse_edit(request, settings, manager))
        metrics.observe_phase("upload", time.perf_counter() - began)
        return await _image_reply(request, owner, *parsed)

    @router.post("/v1/images/generations", openapi_extra=generation_body())
    async def images_generations(request: Request, owner: str = key) -> Response:
        """OpenAI's text to image, for a model that generates (imgedit.planning.families)."""
        parsed = await rejected(metrics, "/v1/images/generations", parse_generation(request, manager))
        return await _image_reply(request, owner, *parsed)

    async def _image_reply(request: Request, owner: str, req: EditRequest, params: Resolved,
                           reply: tuple[str, int, list[str]], answer: str) -> Response:
        """Run the job through the line and answer with its images, or (`answer` url) their stored results'
        URLs (OpenAI's shape, our extensions)."""
        output_format, quality, notices = reply
        if answer == "url" and history is None:
            raise InvalidInput("response_format url needs the stored results (OUTPUT_DIR): use b64_json",
                               "response_format")
        req = replace(req, client=owner)
        result = await _run(request, req, lambda cancel: manager.run(req, cancel=cancel, params=params))
        # The images are encoded once, off the event loop, for the reply and (PNGs) for the stored result
        # (engine.jobs.history), which the reply does not wait for unless it names the stored images. The
        # encoding is on the critical path of every REST edit: a noisy 1024x1024 PNG takes 0.14-0.17 s on a
        # 2-core CPU, a JPEG 5-19 ms.
        began = time.perf_counter()
        files = await asyncio.to_thread(lambda: [encoded(image, "png" if answer == "url" else output_format,
                                                         quality) for image in result.images])
        metrics.observe_phase("reply", time.perf_counter() - began)
        pngs = files if output_format == "png" or answer == "url" else None  # the store keeps PNGs
        if answer == "url":
            entry = await history.record(owner, req.request_id, 0, req, result, pngs=pngs)
            if entry is None:
                raise InternalError(f"storing the result failed (request {req.request_id}): use b64_json")
            items = [{"url": url} for url in image_urls(request, entry, reply[:2])]
        else:
            if history is not None:
                _in_background(history.record(owner, req.request_id, 0, req, result, pngs=pngs))
            items = [{"b64_json": base64.b64encode(file).decode()} for file in files]
        # Extension: each image's own seed (image i is drawn from seed + i; that seed alone makes it again).
        data = [{**item, "revised_prompt": result.prompt, "seed": int(image.info["seed"])}
                for item, image in zip(items, result.images, strict=True)]
        body = {"created": int(time.time()), "data": data, "output_format": output_format,
                "size": f"{result.width}x{result.height}", "seed": result.seed,
                "request_id": result.request_id}
        # e.g. an animated GIF: its first frame was edited; an OpenAI field not used
        notices = [*frame_notices(req.images), *notices]
        asked = (req.width, req.height)
        if req.mask is None and all(asked) and asked != (result.width, result.height):
            notices.append(f"size {asked[0]}x{asked[1]} became {result.width}x{result.height}: the model's "
                           "sides are multiples of 16 (Qwen-Image-2.1: 32)")
        if result.notice:  # an asked-for prompt rewrite that was not used
            notices.append(result.notice)
        if notices:
            body["notices"] = notices
        if result.weights:  # FAST_QUANTIZE: the lossy copy this fast edit ran on
            body["weights"] = result.weights
        if result.boxes:  # mask_prompt: what the model outlined (the first image's pixels)
            body["mask_boxes"] = [list(box) for box in result.boxes]
        return JSONResponse(body)

    @router.post("/v1/prompts/enhance")
    async def prompts_enhance(request: Request, owner: str = key) -> Response:
        """The model's text encoder rewrites `prompt` for the `image` file(s): {"prompt", "original_prompt"},
        with "notice" when the original is kept (the rewrite came back empty or was cut at its limit)."""

        async def parse() -> EditRequest:
            form = await edit_form(request, settings, manager.family)
            images = await read_images(form, settings, manager)
            prompt = form.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidInput("prompt is required (a text field)", "prompt")
            return EditRequest(images=tuple(images), prompt=prompt, source="rest", client=owner)

        req = await rejected(metrics, "/v1/prompts/enhance", parse(), "enhance")
        prompt = req.prompt
        result = await _run(request, req, lambda cancel: manager.run_enhance(req, cancel=cancel))
        body = {"prompt": result.prompt or prompt, "original_prompt": prompt, "request_id": req.request_id}
        if result.notice:
            body["notice"] = result.notice
        return JSONResponse(body)

    @router.post("/v1/masks")
    async def masks(request: Request, owner: str = key) -> Response:
        """mask_prompt's outline alone: the model's text encoder boxes `mask_prompt` in the first `image`;
        the mask (a black-and-white PNG the first image's size, white = edit: send it back, adjusted or not,
        as /v1/images/edits' `mask`) and the boxes. A 400 naming mask_prompt when it found nothing."""

        async def parse() -> EditRequest:
            form = await edit_form(request, settings, manager.family)
            images = await read_images(form, settings, manager)
            if not images:
                raise InvalidInput("no input image: send the image to select in as 'image'", "image")
            phrase = param("mask_prompt").parse(form.get("mask_prompt"))
            # checked by the manager before the job waits (resolve_outline), as a rewrite is
            return EditRequest(images=tuple(images), prompt="", mask_prompt=phrase, source="rest",
                               client=owner)

        req = await rejected(metrics, "/v1/masks", parse(), "outline")
        result = await _run(request, req, lambda cancel: manager.run_outline(req, cancel=cancel))
        mask = await asyncio.to_thread(encoded, result.mask, "png", 100)
        return JSONResponse({"created": int(time.time()),
                             "data": [{"b64_json": base64.b64encode(mask).decode()}],
                             "boxes": [list(box) for box in result.boxes],
                             "size": f"{result.width}x{result.height}", "request_id": req.request_id})

    @router.get("/v1/models")
    def list_models(owner: str = key) -> JSONResponse:
        """OpenAI's model list (front ends ask for it first): the one model this server serves, by its public
        name (a hub id, a local checkpoint's folder name, `imgedit-demo`). Requests may name any model:
        this server runs its own."""
        return JSONResponse({"object": "list", "data": [_model_card()]})

    @router.get("/v1/models/{model_id:path}")
    def get_model(model_id: str, owner: str = key) -> JSONResponse:
        """OpenAI's model lookup: this server's model, or 404."""
        card = _model_card()
        if model_id != card["id"]:
            raise ApiError(404, f"the model {model_id[:80]!r} does not exist; this server serves "
                           f"{card['id']!r}",
                           "model_not_found", "model")
        return JSONResponse(card)

    def _model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": started, "owned_by": "imgedit"}

    if history is not None:  # response_format=url's images, before the /v1 fallback below
        router.include_router(build_image_urls_router(history, key))

    @router.api_route("/v1", methods=HTTP_METHODS, include_in_schema=False)
    @router.api_route("/v1/{rest:path}", methods=HTTP_METHODS, include_in_schema=False)
    async def v1_fallback(request: Request) -> JSONResponse:
        """Wrong methods and unknown paths under /v1 answer in OpenAI's shape (the Gradio app mounted
        at "/" would otherwise answer them with its own {"detail": "Not Found"})."""
        path = request.url.path
        allowed = V1_ROUTES.get(path)
        if allowed:
            return openai_error(405, f"{request.method} is not allowed on {path}; use {', '.join(allowed)}",
                                "method_not_allowed", headers={"allow": ", ".join(allowed)})
        return openai_error(404, f"Invalid URL ({request.method} {path[:200]})", "not_found")

    return router


_BACKGROUND: set[asyncio.Task] = set()  # the event loop keeps only weak references to its tasks


def _in_background(work) -> None:
    """Run a coroutine after the reply (HistoryStore.record logs its own failures)."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def _run(request: Request, req: EditRequest, through_line) -> EditResult:
    """`through_line(cancel)`: the job through the line (manager.run or run_enhance), cancelled if the client
    goes away: its EditResult; its error raised for the handler."""
    cancel = threading.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, cancel))
    try:
        return await through_line(cancel)
    except ImgEditError:
        raise
    except Exception:
        log.exception("%s failed", req.request_id)
        raise InternalError(f"internal error (request {req.request_id})") from None
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, cancel: threading.Event) -> None:
    """Servers do not cancel a handler when its client goes away: watch (until the handler cancels
    this task), and stop the GPU work."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    cancel.set()
