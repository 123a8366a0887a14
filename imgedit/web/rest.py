"""REST for operators and OpenAI clients: /health, /metrics and /v1/images/edits.

`/v1/images/edits` speaks OpenAI's Images API (multipart; `image` or `image[]`, `prompt`, `n`, `size`,
`response_format=b64_json`) plus the extensions `negative_prompt`, `seed`, `num_inference_steps`,
`true_cfg_scale`, `speed` (quality | fast | fastest), `lora` and `lora_scale` (the openai SDK sends
extensions through `extra_body`). OpenAI's `output_format` (png | jpeg | webp) and `output_compression`
(0-100, the JPEG/WebP quality) pick the reply's encoding: PNG by default (lossless), JPEG the fastest.
OpenAI's `mask` is taken (imgedit.engine.masks), with `mask_grow`, `mask_feather` and `strength`. Jobs go
to the same manager line and workers as the UI. Errors come back in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import threading
import time
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from imgedit.config.parsers import human_size
from imgedit.config.settings import Settings
from imgedit.engine.gpus import GpuMonitor
from imgedit.engine.images import REPLY_FORMATS, encoded, frame_notices, image_label, open_image
from imgedit.engine.masks import open_mask
from imgedit.engine.validation import check_counts
from imgedit.errors import ImgEditError, InputTooLarge, InvalidInput
from imgedit.protocol import REST, EditRequest, Resolved, WorkerState, parameters, request_kwargs
from imgedit.web.identity import rest_owner
from imgedit.web.metrics import CONTENT_TYPE, Metrics
from imgedit.web.public import full_snapshot, open_snapshot

log = logging.getLogger(__name__)

STATUS = {"invalid_input": 400, "too_large": 413, "busy": 429, "cancelled": 499, "out_of_memory": 507,
          "worker_failed": 503, "not_ready": 503, "shutting_down": 503}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
              405: "invalid_request_error", 413: "invalid_request_error",
              429: "rate_limit_error", 503: "server_error", 507: "server_error", 500: "server_error"}
IMAGE_FIELDS = ("image", "image[]", "images", "images[]")
# every /v1 route and its methods, for the 404/405 fallback
V1_ROUTES = {"/v1/images/edits": ("POST",), "/v1/prompts/enhance": ("POST",), "/v1/status": ("GET",)}
HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


# The request's fields as REST callers name them (OpenAI's words), where the shared checks use ours.
REST_NAMES = {"num_images": "n", "images": "image"}


def rest_words(message: str, param: str | None) -> tuple[str, str | None]:
    """A shared check's message and parameter in the REST caller's words ("n 5 is out of range", param n);
    a message that names the parameter first is reworded, one in plain words ("3 input images given") is not."""
    if param in REST_NAMES:
        if message.startswith(param + " "):
            message = REST_NAMES[param] + message[len(param):]
        return message, REST_NAMES[param]
    return message, param


def openai_error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    message, param = rest_words(message, param)
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status)


def owner_of(request: Request, settings: Settings) -> str | None:
    """Who makes this call (imgedit.web.identity), or None: a key is required and it sent none of them."""
    return rest_owner(request, settings.api_key, settings.api_keys)


UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer <key>)"


def _int(form, name: str, default: int | None) -> int | None:
    raw = form.get(name)
    if raw is None or raw == "":
        return default
    try:
        text = str(raw).strip()
        if len(text) > 20:
            raise ValueError
        return int(text)
    except ValueError:
        raise InvalidInput(f"{name} must be a whole number, got {str(raw)[:40]!r}", name) from None


def _float(form, name: str) -> float | None:
    raw = form.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(str(raw))
    except ValueError:
        raise InvalidInput(f"{name} must be a number, got {str(raw)[:40]!r}", name) from None
    if not math.isfinite(value):  # nan, inf, 1e400: no setting takes them, and JSON cannot carry them
        raise InvalidInput(f"{name} must be a finite number, got {str(raw)[:40]!r}", name)
    return value


def _bool(form, name: str) -> bool:
    raw = form.get(name)
    if raw is None or raw == "":
        return False
    text = str(raw).strip().lower() if isinstance(raw, str) else None
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise InvalidInput(f"{name} must be true or false, got {str(raw)[:40]!r}", name)


def form_fields(form, entry: str) -> dict:
    """Every declared parameter `entry` (REST or JOBS) takes as a plain form field, parsed by its kind, as
    EditRequest fields (protocol.PARAMETERS; validation.resolve checks the values). Files are read apart."""
    out: dict = {}
    for param in parameters(entry):
        raw = form.get(param.form_name)
        if param.kind == "file":
            continue
        if param.kind == "size":
            out["width"], out["height"] = _size(raw)
        elif param.kind == "text":
            if raw is not None and not isinstance(raw, str):
                raise InvalidInput(f"{param.form_name} must be a text field", param.form_name)
            if param.required and raw is None:
                raise InvalidInput(f"{param.form_name} is required (a text field)", param.form_name)
            out[param.request_field] = raw or param.default  # an empty field is an absent one
        elif param.kind == "whole":
            out[param.request_field] = _int(form, param.form_name, param.default)
        elif param.kind == "number":
            out[param.request_field] = _float(form, param.form_name)
        elif param.kind == "flag":
            out[param.request_field] = _bool(form, param.form_name)
    return out


def _size(raw: str | None) -> tuple[int | None, int | None]:
    if raw is None or raw in ("", "auto"):
        return None, None
    w, sep, h = str(raw).lower().partition("x")
    if not sep or not (w.isdecimal() and h.isdecimal() and len(w) <= 6 and len(h) <= 6):
        raise InvalidInput(f"size must be 'auto' or WIDTHxHEIGHT such as 1024x1024, got {str(raw)[:40]!r}")
    return int(w), int(h)


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
        """The GPU panel's numbers over plain HTTP, as the gradio API's /gpu_status returns them (open, as /health)."""
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
        if (owner := owner_of(request, settings)) is None:
            return openai_error(401, UNAUTHORIZED, "invalid_api_key")
        try:
            req, params, (output_format, quality) = await _parse(request, settings, manager)
        except ImgEditError as exc:
            metrics.record_rejected("rest", exc.kind)
            return openai_error(STATUS.get(exc.kind, 400), exc.message, exc.kind, exc.field)
        except Exception:
            log.exception("unreadable /v1/images/edits request")
            metrics.record_rejected("rest", "invalid_input")
            return openai_error(400, "the request could not be read", "invalid_input")
        req = replace(req, client=owner)  # the line's share is per key (or token)
        result = await _run(request, req, lambda cancel: manager.run(req, cancel=cancel, params=params))
        if isinstance(result, JSONResponse):
            return result
        # The images are encoded once, off the event loop, for the reply and (PNGs) for the stored result
        # (imgedit.engine.history), which the reply does not wait for. The encoding is on the critical path
        # of every REST edit: a noisy 1024x1024 PNG takes 0.14-0.17 s on a 2-core CPU, a JPEG 5-19 ms.
        files = await asyncio.to_thread(lambda: [encoded(image, output_format, quality) for image in result.images])
        if (history := getattr(request.app.state, "history", None)) is not None:
            pngs = files if output_format == "png" else None  # the store keeps PNGs: it encodes its own
            _in_background(history.record(owner, req.request_id, 0, req, result, pngs=pngs))
        # Extension: each image's own seed (image i is drawn from seed + i; that seed alone makes it again).
        data = [{"b64_json": base64.b64encode(file).decode(), "revised_prompt": result.prompt,
                 "seed": int(image.info["seed"])}
                for file, image in zip(files, result.images, strict=True)]
        body = {"created": int(time.time()), "data": data, "output_format": output_format,
                "size": f"{result.width}x{result.height}", "seed": result.seed, "request_id": result.request_id}
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
            form = await _form(request, settings)
            images = await _images(form, settings, manager)
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
            response = openai_error(405, f"{request.method} is not allowed on {path}; use {', '.join(allowed)}",
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
    """`through_line(cancel)`: the job through the line (manager.run or run_enhance), cancelled if the client goes
    away: its EditResult, or its error as OpenAI's error response."""
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


async def _parse(request: Request, settings: Settings, manager) -> tuple[EditRequest, Resolved, tuple[str, int]]:
    """The edit request, its exact parameters (every check, once), and the reply's format and quality."""
    form = await _form(request, settings)
    images = await _images(form, settings, manager)
    masking = await mask_fields(form, settings, images[0].size)
    response_format = str(form.get("response_format") or "b64_json")
    if response_format != "b64_json":
        raise InvalidInput("response_format must be b64_json (this server does not host image URLs)")
    req = EditRequest(images=tuple(images), **request_kwargs({**form_fields(form, REST), **masking}), source="rest")
    return req, manager.resolve(req), output_format(form)


def output_format(form) -> tuple[str, int]:
    """OpenAI's `output_format` and `output_compression` (ignored for PNG, which is lossless), from a form or
    (`/v1/jobs/{id}/result`) the query string."""
    name = str(form.get("output_format") or "png").strip().lower()
    name = "jpeg" if name == "jpg" else name
    if name not in REPLY_FORMATS:
        raise InvalidInput(f"output_format must be one of {', '.join(REPLY_FORMATS)}, got {name[:20]!r}",
                           "output_format")
    quality = _int(form, "output_compression", 100)
    if not 0 <= quality <= 100:
        raise InvalidInput(f"output_compression must be 0 to 100, got {quality}", "output_compression")
    return name, quality


async def _form(request: Request, settings: Settings):
    """The multipart form, its size checked before it is read."""
    length = request.headers.get("content-length", "")
    limit = settings.max_file_size * 4 + 1_000_000  # up to three images and a mask, plus the text fields
    if not length.isdecimal() or len(length) > 15:
        raise InvalidInput("send the body with a Content-Length (chunked uploads are not accepted)")
    if int(length) > limit:
        raise InputTooLarge(f"request body is {int(length):,} bytes; the limit is {limit:,}")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidInput("send multipart/form-data with one or more 'image' files and a 'prompt'")
    return await read_form(request, 8, "an edit takes at most three 'image' files and a 'mask'")


MAX_FORM_FIELDS = 64  # text fields of one REST request: every parameter of ours fits many times over


async def read_form(request: Request, max_files: int, files_why: str):
    """The multipart form, or InvalidInput naming the limit a request went over (Starlette's own text named
    no parameter: 200 batch files were "malformed multipart body (HTTPException)")."""
    try:
        return await request.form(max_files=max_files, max_fields=MAX_FORM_FIELDS)
    except Exception as exc:
        detail = str(getattr(exc, "detail", exc))
        if detail.startswith("Too many files"):
            raise InvalidInput(f"too many files: at most {max_files} in one request ({files_why})") from None
        if detail.startswith("Too many fields"):
            raise InvalidInput(f"too many form fields: at most {MAX_FORM_FIELDS} in one request") from None
        if detail.startswith(("Field exceeded", "Part exceeded")):
            raise InvalidInput(f"a form field is too large: {detail}") from None
        raise InvalidInput(f"malformed multipart body ({type(exc).__name__})") from None


async def _images(form, settings: Settings, manager) -> list:
    """The `image`/`image[]` files, each read up to MAX_FILE_SIZE and opened within MAX_INPUT_PIXELS."""
    uploads = [v for key in IMAGE_FIELDS for v in form.getlist(key)]
    if any(not isinstance(u, UploadFile) for u in uploads):
        raise InvalidInput("'image' must be a file upload, not a text field")
    check_counts(len(uploads), manager.family)
    images = []
    for i, upload in enumerate(uploads):
        label = image_label(i + 1, upload.filename)
        raw = await upload.read(settings.max_file_size + 1)
        if len(raw) > settings.max_file_size:
            raise InputTooLarge(f"{label} is larger than {human_size(settings.max_file_size)} (MAX_FILE_SIZE)")
        images.append(await asyncio.to_thread(open_image, raw, settings.max_input_pixels, label))
    return images


async def mask_fields(form, settings: Settings, first_size: tuple[int, int]) -> dict:
    """`mask` (a file: OpenAI's transparent-means-edit PNG, or black and white with white = edit) as the
    EditRequest's mask, the first image's size (its grow, feather and strength are form_fields)."""
    out: dict = {}
    masks = form.getlist("mask")
    if not masks:
        return out
    if len(masks) > 1 or not isinstance(masks[0], UploadFile):
        raise InvalidInput("'mask' must be one file upload (a PNG the size of the first image)", "mask")
    raw = await masks[0].read(settings.max_file_size + 1)
    if len(raw) > settings.max_file_size:
        raise InputTooLarge(f"the mask is larger than {human_size(settings.max_file_size)} (MAX_FILE_SIZE)", "mask")
    out["mask"] = await asyncio.to_thread(open_mask, raw, first_size, settings.max_input_pixels)
    return out
