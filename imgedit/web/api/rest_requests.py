"""REST requests as edit requests: OpenAI's multipart edit forms and JSON generation bodies, parsed by the
declaration (protocol.PARAMETERS: each parameter's kind), the image and mask files read within MAX_FILE_SIZE
and MAX_INPUT_PIXELS, every limit named when a request goes over it. `/v1/images/edits`,
`/v1/images/generations`, `/v1/prompts/enhance` (web.api.rest) and `/v1/jobs` (web.api.jobs) read
their requests here."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from starlette.datastructures import UploadFile

from imgedit.config.parsers import human_size
from imgedit.config.settings import Settings
from imgedit.engine.images import encoded_image, image_label
from imgedit.engine.interface import Engine
from imgedit.engine.masks import open_mask
from imgedit.engine.outputs import REPLY_FORMATS
from imgedit.engine.validation import check_counts
from imgedit.errors import InputTooLarge, InvalidInput
from imgedit.planning.families import FAMILIES
from imgedit.protocol import REST, EditRequest, Param, Resolved, parameters, request_kwargs

IMAGE_FIELDS = ("image", "image[]", "images", "images[]")
MAX_JSON_BODY = 1_000_000  # a generation's JSON: the prompts and the parameters


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


def flag_field(form, name: str) -> bool:
    """A true/false form field that is not an edit parameter (e.g. /v1/jobs' `preview`): the declaration's
    parser of flags."""
    return bool(Param(name, "flag", "").parse(form.get(name), name))


def form_fields(form, entry: str) -> dict:
    """Every declared parameter `entry` (REST or JOBS) takes as a plain form field, parsed by its kind
    (protocol.Param.parse), as EditRequest fields (validation.resolve checks the values). Files are read
    apart."""
    out: dict = {}
    for param in parameters(entry):
        raw = form.get(param.form_name)
        if param.kind == "file":
            continue
        if param.kind == "size":
            out["width"], out["height"] = _size(raw)
            continue
        if param.required and raw is None:
            raise InvalidInput(f"{param.form_name} is required (a {param.kind} field)", param.form_name)
        out[param.request_field] = param.parse(raw, param.form_name)  # an empty field is an absent one
    return out


def _size(raw: str | None) -> tuple[int | None, int | None]:
    if raw is None or raw in ("", "auto"):
        return None, None
    w, sep, h = str(raw).lower().partition("x")
    if not sep or not (w.isdecimal() and h.isdecimal() and len(w) <= 6 and len(h) <= 6):
        raise InvalidInput(f"size must be 'auto' or WIDTHxHEIGHT such as 1024x1024, got {str(raw)[:40]!r}")
    return int(w), int(h)


async def parse_edit(request: Request, settings: Settings,
                     manager: Engine) -> tuple[EditRequest, Resolved, tuple[str, int, list[str]], str]:
    """The edit request, its exact parameters (every check, once), the images' format and quality, and the
    reply's `response_format`."""
    form = await edit_form(request, settings, manager.family)
    images = await read_images(form, settings, manager)
    # a model that generates takes none on the page and the gradio API; here OpenAI's edits needs one
    if not images:
        raise InvalidInput("no input image: send the image to edit as 'image' (text to image: POST "
                           "/v1/images/generations)", "image")
    masking = await mask_fields(form, settings, images[0].size)
    answer = response_format(form)
    req = EditRequest(images=tuple(images), **request_kwargs({**form_fields(form, REST), **masking}),
                      source="rest")
    return req, manager.resolve(req), (*output_format(form), ignored(form)), answer


async def parse_generation(request: Request,
                           manager: Engine) -> tuple[EditRequest, Resolved, tuple[str, int, list[str]], str]:
    """A generation's JSON body as an edit request without images, its exact parameters, the images' format
    and the reply's `response_format`."""
    family = FAMILIES[manager.family]
    if not family.generates:
        raise InvalidInput(f"this server's model ({family.model}) edits images and does not make them from a "
                           "prompt alone: POST /v1/images/edits with an 'image'")
    check_body(request, MAX_JSON_BODY, "application/json",
               "send a JSON body (Content-Type: application/json) with a 'prompt'")
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise InvalidInput("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object with a 'prompt'")
    for name in (*IMAGE_FIELDS, "mask"):
        if name in body:
            raise InvalidInput(f"'{name}' is for POST /v1/images/edits (multipart); "
                               "a generation takes a prompt", name)
    answer = response_format(body)
    req = EditRequest(images=(), **request_kwargs(form_fields(body, REST)), source="rest")
    return req, manager.resolve(req), (*output_format(body), ignored(body)), answer


RESPONSE_FORMATS = ("b64_json", "url")


def response_format(form) -> str:
    """OpenAI's `response_format`: the images in the reply (`b64_json`, the default) or as URLs of the stored
    results (`url`: imgedit.web.api.image_urls)."""
    answer = form.get("response_format") or "b64_json"
    if answer not in RESPONSE_FORMATS:
        raise InvalidInput(f"response_format must be b64_json or url, got {str(answer)[:40]!r}",
                           "response_format")
    return answer


# OpenAI's image fields this server takes and does not act on: the reply's `notices` name each one sent
UNUSED_OPENAI = ("quality", "background", "style", "moderation", "input_fidelity", "partial_images")


def ignored(form) -> list[str]:
    """A notice for each of OpenAI's fields in the request that this server does not use (they were dropped
    silently)."""
    return [f"{name}={str(form.get(name))[:40]!r} was ignored: this server does not use OpenAI's {name}"
            for name in UNUSED_OPENAI if form.get(name) not in (None, "", "auto")]


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


async def edit_form(request: Request, settings: Settings, family: str):
    """The multipart form, its size checked before it is read."""
    most = FAMILIES[family].max_images
    limit = settings.max_file_size * (most + 1) + 1_000_000  # the images and a mask, plus the text fields
    check_body(request, limit, "multipart/form-data",
               "send multipart/form-data with one or more 'image' files and a 'prompt'")
    return await read_form(request, most + 5, f"an edit takes at most {most} 'image' file(s) and a 'mask'")


def check_body(request: Request, limit: int, content_type: str, wrong_type: str) -> None:
    """The body's declared length within `limit` and its type `content_type` (else `wrong_type` says what to
    send), before any of it is read."""
    length = request.headers.get("content-length", "")
    if not length.isdecimal() or len(length) > 15:
        raise InvalidInput("send the body with a Content-Length (chunked uploads are not accepted)")
    if int(length) > limit:
        raise InputTooLarge(f"request body is {int(length):,} bytes; the limit is {limit:,}")
    if not request.headers.get("content-type", "").startswith(content_type):
        raise InvalidInput(wrong_type)


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


async def read_images(form, settings: Settings, manager: Engine) -> list:
    """The `image`/`image[]` files, each read up to MAX_FILE_SIZE and checked within MAX_INPUT_PIXELS by its
    header; decoded when the job has a worker (engine.images.Encoded)."""
    uploads = [v for key in IMAGE_FIELDS for v in form.getlist(key)]
    if any(not isinstance(u, UploadFile) for u in uploads):
        raise InvalidInput("'image' must be a file upload, not a text field")
    check_counts(len(uploads), manager.family)
    images = []
    for i, upload in enumerate(uploads):
        label = image_label(i + 1, upload.filename)
        raw = await upload.read(settings.max_file_size + 1)
        if len(raw) > settings.max_file_size:
            raise InputTooLarge(f"{label} is larger than {human_size(settings.max_file_size)} "
                                "(MAX_FILE_SIZE)")
        images.append(await asyncio.to_thread(encoded_image, raw, settings.max_input_pixels, label,
                                              FAMILIES[manager.family].rgba))
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
        raise InputTooLarge(f"the mask is larger than {human_size(settings.max_file_size)} (MAX_FILE_SIZE)",
                            "mask")
    out["mask"] = await asyncio.to_thread(open_mask, raw, first_size, settings.max_input_pixels)
    return out
