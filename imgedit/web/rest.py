"""REST for operators and OpenAI clients: /health, /metrics, /v1/images/edits and /v1/images/generations.

`/v1/images/edits` speaks OpenAI's Images API (multipart; `image` or `image[]`, `prompt`, `n`, `size`,
`response_format=b64_json`) plus the extensions `negative_prompt`, `seed`, `num_inference_steps`,
`true_cfg_scale`, `speed` (quality | fast | fastest), `lora` and `lora_scale` (the openai SDK sends
extensions through `extra_body`). OpenAI's `output_format` (png | jpeg | webp) and `output_compression`
(0-100, the JPEG/WebP quality) pick the reply's encoding: PNG by default (lossless), JPEG the fastest.
OpenAI's `mask` is taken (imgedit.engine.masks), with `mask_grow`, `mask_feather` and `strength`. Jobs go
to the same manager line and workers as the UI. Errors come back in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.

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

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from imgedit.config.settings import Settings
from imgedit.engine.gpus import GpuMonitor
from imgedit.engine.images import encoded, frame_notices
from imgedit.errors import ImgEditError, InvalidInput
from imgedit.protocol import EditRequest, Resolved, WorkerState
from imgedit.web.identity import rest_owner
from imgedit.web.metrics import CONTENT_TYPE, Metrics
from imgedit.web.public import full_snapshot, open_snapshot
from imgedit.web.rest_requests import edit_form, parse_edit, parse_generation, read_images

log = logging.getLogger(__name__)

STATUS = {"invalid_input": 400, "too_large": 413, "busy": 429, "cancelled": 499, "out_of_memory": 507,
          "worker_failed": 503, "not_ready": 503, "shutting_down": 503}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
              405: "invalid_request_error", 413: "invalid_request_error",
              429: "rate_limit_error", 503: "server_error", 507: "server_error", 500: "server_error"}
# every /v1 route and its methods, for the 404/405 fallback
V1_ROUTES = {"/v1/images/edits": ("POST",), "/v1/images/generations": ("POST",),
             "/v1/prompts/enhance": ("POST",), "/v1/status": ("GET",)}
HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


# The request's fields as REST callers name them (OpenAI's words), where the shared checks use ours.
REST_NAMES = {"num_images": "n", "images": "image"}


def rest_words(message: str, param: str | None) -> tuple[str, str | None]:
    """A shared check's message and parameter in the REST caller's words ("n 5 is out of range", param n);
    a message that names the parameter first is reworded, one in plain words ("3 input images given") is
    not."""
    if param in REST_NAMES:
        if message.startswith(param + " "):
            message = REST_NAMES[param] + message[len(param):]
        return message, REST_NAMES[param]
    return message, param


def openai_error(status: int, message: str, code: str | None = None,
                 param: str | None = None) -> JSONResponse:
    message, param = rest_words(message, param)
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status)


def owner_of(request: Request, settings: Settings) -> str | None:
    """Who makes this call (imgedit.web.identity), or None: a key is required and it sent none of them."""
    return rest_owner(request, settings.api_key, settings.api_keys)


UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer <key>)"


def build_router(settings: Settings, manager, metrics: Metrics, monitor: GpuMonitor) -> APIRouter:
    router = APIRouter()

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
    def details(request: Request) -> JSONResponse:
        """What /health leaves out (job ids, process ids, the checkpoint, LoRA files), for key holders."""
        if (caller := owner_of(request, settings)) is None:
            return openai_error(401, UNAUTHORIZED, "invalid_api_key")
        return JSONResponse(full_snapshot(monitor, manager.status(), caller))

    @router.get("/metrics")
    def prometheus(request: Request) -> Response:
        if owner_of(request, settings) is None:
            return openai_error(401, UNAUTHORIZED, "invalid_api_key")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/v1/images/edits")
    async def images_edits(request: Request) -> Response:
        return await _images_route(request, "/v1/images/edits",
                                   lambda: parse_edit(request, settings, manager))

    @router.post("/v1/images/generations")
    async def images_generations(request: Request) -> Response:
        """OpenAI's text to image, for a model that generates (imgedit.planning.families)."""
        return await _images_route(request, "/v1/images/generations",
                                   lambda: parse_generation(request, manager))

    async def _images_route(request: Request, route: str, parse) -> Response:
        """An images route: the key, the request parsed and resolved by `parse()`, then the job and its
        reply."""
        if (owner := owner_of(request, settings)) is None:
            return openai_error(401, UNAUTHORIZED, "invalid_api_key")
        try:
            req, params, (output_format, quality) = await parse()
        except ImgEditError as exc:
            metrics.record_rejected("rest", exc.kind)
            return openai_error(STATUS.get(exc.kind, 400), exc.message, exc.kind, exc.field)
        except Exception:
            log.exception("unreadable %s request", route)
            metrics.record_rejected("rest", "invalid_input")
            return openai_error(400, "the request could not be read", "invalid_input")
        return await _image_reply(request, replace(req, client=owner), params, output_format, quality)

    async def _image_reply(request: Request, req: EditRequest, params: Resolved, output_format: str,
                           quality: int) -> Response:
        """Run the job through the line and answer with its images (OpenAI's shape, our extensions)."""
        owner = req.client
        result = await _run(request, req, lambda cancel: manager.run(req, cancel=cancel, params=params))
        if isinstance(result, JSONResponse):
            return result
        # The images are encoded once, off the event loop, for the reply and (PNGs) for the stored result
        # (imgedit.engine.history), which the reply does not wait for. The encoding is on the critical path
        # of every REST edit: a noisy 1024x1024 PNG takes 0.14-0.17 s on a 2-core CPU, a JPEG 5-19 ms.
        files = await asyncio.to_thread(
            lambda: [encoded(image, output_format, quality) for image in result.images])
        if (history := getattr(request.app.state, "history", None)) is not None:
            pngs = files if output_format == "png" else None  # the store keeps PNGs: it encodes its own
            _in_background(history.record(owner, req.request_id, 0, req, result, pngs=pngs))
        # Extension: each image's own seed (image i is drawn from seed + i; that seed alone makes it again).
        data = [{"b64_json": base64.b64encode(file).decode(), "revised_prompt": result.prompt,
                 "seed": int(image.info["seed"])}
                for file, image in zip(files, result.images, strict=True)]
        body = {"created": int(time.time()), "data": data, "output_format": output_format,
                "size": f"{result.width}x{result.height}", "seed": result.seed,
                "request_id": result.request_id}
        notices = frame_notices(req.images)  # e.g. an animated GIF: its first frame was edited
        if result.notice:  # an asked-for prompt rewrite that was not used
            notices.append(result.notice)
        if notices:
            body["notices"] = notices
        if result.weights:  # FAST_QUANTIZE: the lossy copy this fast edit ran on
            body["weights"] = result.weights
        return JSONResponse(body)

    @router.post("/v1/prompts/enhance")
    async def prompts_enhance(request: Request) -> Response:
        """The model's text encoder rewrites `prompt` for the `image` file(s): {"prompt", "original_prompt"},
        with "notice" when the original is kept (the rewrite came back empty or was cut at its limit)."""
        if (owner := owner_of(request, settings)) is None:
            return openai_error(401, UNAUTHORIZED, "invalid_api_key")
        try:
            form = await edit_form(request, settings, manager.family)
            images = await read_images(form, settings, manager)
            prompt = form.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidInput("prompt is required (a text field)", "prompt")
            req = EditRequest(images=tuple(images), prompt=prompt, source="rest", client=owner)
        except ImgEditError as exc:
            metrics.record_rejected("rest", exc.kind, "enhance")
            return openai_error(STATUS.get(exc.kind, 400), exc.message, exc.kind, exc.field)
        except Exception:
            log.exception("unreadable /v1/prompts/enhance request")
            metrics.record_rejected("rest", "invalid_input", "enhance")
            return openai_error(400, "the request could not be read", "invalid_input")
        result = await _run(request, req, lambda cancel: manager.run_enhance(req, cancel=cancel))
        if isinstance(result, JSONResponse):
            return result
        body = {"prompt": result.prompt or prompt, "original_prompt": prompt, "request_id": req.request_id}
        if result.notice:
            body["notice"] = result.notice
        return JSONResponse(body)

    @router.api_route("/v1", methods=HTTP_METHODS, include_in_schema=False)
    @router.api_route("/v1/{rest:path}", methods=HTTP_METHODS, include_in_schema=False)
    async def v1_fallback(request: Request) -> JSONResponse:
        """Wrong methods and unknown paths under /v1 answer in OpenAI's shape (the Gradio app mounted
        at "/" would otherwise answer them with its own {"detail": "Not Found"})."""
        path = request.url.path
        allowed = V1_ROUTES.get(path)
        if allowed:
            response = openai_error(405,
                                    f"{request.method} is not allowed on {path}; use {', '.join(allowed)}",
                                    "method_not_allowed")
            response.headers["allow"] = ", ".join(allowed)
            return response
        return openai_error(404, f"Invalid URL ({request.method} {path[:200]})", "not_found")

    return router


_BACKGROUND: set[asyncio.Task] = set()  # the event loop keeps only weak references to its tasks


def _in_background(work) -> None:
    """Run a coroutine after the reply (HistoryStore.record logs its own failures)."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def _run(request: Request, req: EditRequest, through_line):
    """`through_line(cancel)`: the job through the line (manager.run or run_enhance), cancelled if the client
    goes away: its EditResult, or its error as OpenAI's error response."""
    cancel = threading.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, cancel))
    try:
        return await through_line(cancel)
    except ImgEditError as exc:
        return openai_error(STATUS.get(exc.kind, 500), exc.message, exc.kind, exc.field)
    except Exception:
        log.exception("%s failed", req.request_id)
        return openai_error(500, f"internal error (request {req.request_id})", "internal_error")
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, cancel: threading.Event) -> None:
    """Servers do not cancel a handler when its client goes away: watch (until the handler cancels
    this task), and stop the GPU work."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    cancel.set()
