"""Incoming file paths of Gradio events: only files in Gradio's upload cache may be opened or served.

A Gradio event names its files by server path (`{"path": ..., "meta": {"_type": "gradio.FileData"}}`),
and a hand-made request can name any path. Gradio checks that only once `has_launched` is set (server.py
sets it: mounting does not), and it copies a file it accepts into its cache before any handler runs,
so a handler never sees the path the client sent. Our own check therefore sits in front of Gradio:
`EventGuard` reads the JSON body of every event request and refuses any file outside the upload
cache (uploads and our own results both live there) with our own message. It also keeps Gradio's
own error text from reaching users (only gr.Error text, our messages, passes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence

from gradio import route_utils
from gradio.utils import get_upload_folder
from starlette.requests import ClientDisconnect

from imgedit.engine.images import FORMATS, image_or_zip
from imgedit.errors import InvalidInput

log = logging.getLogger(__name__)
MAX_EVENT_BODY = 4_000_000  # an event's JSON: prompts and file references, never file contents
NOT_UPLOADED = ("was not uploaded to this server: upload the file first and send the path the upload "
                "returned")
UNREADABLE = ("the request could not be processed: check the values against the API description "
              "(/gradio_api/info)")
UNCHECKED = ("/gradio_api/upload", "/gradio_api/cancel")  # multipart uploads; cancel names no file


def upload_folder() -> str:
    return os.path.realpath(get_upload_folder())


def in_upload_folder(path: str) -> bool:
    """True for a regular file under the upload cache, after links and `..` are resolved (a folder given as
    an input file was recorded by Gradio, and its cleanup then failed on it at every sweep and at
    shutdown)."""
    if not path or "\x00" in path:
        return False
    real, folder = os.path.realpath(path), upload_folder()
    return real != folder and os.path.commonpath([real, folder]) == folder and os.path.isfile(real)


class PartialUploadSweeper:
    """Deletes the upload folder's abandoned partial uploads, at start-up and every few seconds after.

    Gradio streams each uploaded file into a `tmp*` file at the top of the upload folder and moves it into
    a folder of its own once the upload is complete; when the client hangs up mid-body (or stalls until
    BODY_READ_TIMEOUT), Gradio deletes nothing: 60 abandoned uploads left 49 MB that survived restarts. A
    top-level `tmp*` file untouched for longer than BODY_READ_TIMEOUT (plus a margin) belongs to no live
    upload: a live one is written at least that often, or the server cuts it off. Another server sharing
    the folder loses only what it abandoned too. (How much one client may have in flight at once is bounded
    by MAX_CONNECTIONS_PER_CLIENT uploads of MAX_FILE_SIZE each.)"""

    def __init__(self, body_read_timeout: float, folder: str | None = None):
        self.idle_s = body_read_timeout + 5
        self.folder = folder or upload_folder()

    def sweep(self) -> int:
        now, removed = time.time(), 0
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return 0
        for entry in entries:
            try:
                if (entry.name.startswith("tmp") and entry.is_file(follow_symlinks=False)
                        and now - entry.stat(follow_symlinks=False).st_mtime > self.idle_s):
                    os.unlink(entry.path)
                    removed += 1
            except OSError:  # gone meanwhile, or not ours to delete: the next sweep looks again
                continue
        if removed:
            log.info("deleted %d abandoned partial upload(s) from %s", removed, self.folder)
        return removed

    def start(self) -> PartialUploadSweeper:
        self.sweep()

        def run():
            while True:  # a daemon thread: it ends with the server process
                time.sleep(min(10.0, self.idle_s))
                self.sweep()

        threading.Thread(target=run, name="partial-upload-sweeper", daemon=True).start()
        return self


def guard_gradio_cleanup() -> None:
    """Gradio's sweep of the files it recorded (route_utils.delete_files_created_by_app: every few seconds,
    and at shutdown) catches only FileNotFoundError: one entry that is a folder (IsADirectoryError) or cannot
    be removed stopped the whole sweep and failed the server's shutdown. EventGuard refuses such inputs before
    Gradio records them; this makes the sweep itself survive one: entries that are not regular files leave
    Gradio's records unremoved, and an error on one file is logged and does not stop the rest. Idempotent."""
    original = route_utils.delete_files_created_by_app
    if getattr(original, "imgedit_guarded", False):
        return

    def delete_files_created_by_app(blocks, age):
        for temp_set in list(getattr(blocks, "temp_file_sets", ())):
            for entry in list(temp_set):
                try:
                    regular = stat.S_ISREG(os.lstat(entry).st_mode)  # a link, a folder: not a file of its own
                except FileNotFoundError:
                    continue  # gone already: Gradio's sweep forgets it
                except (OSError, TypeError, ValueError):
                    regular = False
                if not regular:
                    log.warning("gradio's file records held %r, which is not a regular file: dropped, "
                                "not deleted", str(entry)[:200])
                    temp_set.discard(entry)
        try:
            original(blocks, age)
        except OSError as exc:
            log.warning("gradio's cleanup of its cached files stopped at one file: %s", exc)

    delete_files_created_by_app.imgedit_guarded = True
    delete_files_created_by_app.__wrapped__ = original
    route_utils.delete_files_created_by_app = delete_files_created_by_app


def uploaded_path(value, label: str, field: str = "images") -> str:
    """The real path of one uploaded file (a FileData dict, an object with `.path`, or a str), or
    InvalidInput when it is not a file in the upload cache."""
    path = value.get("path") if isinstance(value, dict) else getattr(value, "path", value)
    if not isinstance(path, str) or not path:
        raise InvalidInput(f"{label} is not an uploaded file", field)
    if not in_upload_folder(path):
        raise InvalidInput(f"{label} {NOT_UPLOADED}", field)
    return os.path.realpath(path)


def uploaded_paths(files, field: str = "images") -> list[str]:
    """Every file of a File component's value (one or a list), checked with `uploaded_path`."""
    if not files:
        return []
    if isinstance(files, (str, bytes, dict)) or not isinstance(files, Sequence):
        files = [files]
    return [uploaded_path(f, f"image {i + 1}", field) for i, f in enumerate(files)]


def gallery_paths(gallery) -> list[str]:
    """The image paths of a Gallery's raw value (`[{"image": FileData, "caption": ...}]`)."""
    if not gallery or not isinstance(gallery, Sequence) or isinstance(gallery, (str, bytes)):
        return []
    paths = []
    for i, item in enumerate(gallery):
        if isinstance(item, dict):
            item = item.get("image")
        elif isinstance(item, (list, tuple)) and item:
            item = item[0]
        paths.append(uploaded_path(item, f"result {i + 1}", "result"))
    return paths


def foreign_files(value, found: list[str] | None = None) -> list[str]:
    """The `path` of every file reference in a JSON value that is not a file in the upload cache."""
    found = [] if found is None else found
    if isinstance(value, dict):
        path = value.get("path")
        if "path" in value and (not isinstance(path, str) or not in_upload_folder(path)):
            found.append(str(path)[:200])
        for item in value.values():
            foreign_files(item, found)
    elif isinstance(value, list):
        for item in value:
            foreign_files(item, found)
    return found


class EventGuard:
    """ASGI middleware for the Gradio routes: file paths first, then Gradio; Gradio's own error text out."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/gradio_api/"):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and not path.startswith(UNCHECKED):
            body, more = [], True
            size = 0
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body.append(message.get("body", b""))
                size += len(body[-1])
                more = message.get("more_body", False)
                if size > MAX_EVENT_BODY:
                    await _answer(send, 413, path,
                                  f"the request body is larger than {MAX_EVENT_BODY:,} bytes")
                    return
            raw = b"".join(body)
            try:
                payload = json.loads(raw) if raw else None
            except ValueError:
                payload = None  # not JSON: Gradio refuses it, and its text is replaced below
            foreign = foreign_files(payload)
            if foreign:
                await _answer(send, 400, path, f"file {foreign[0]!r} {NOT_UPLOADED}")
                return
            receive = _replay(raw, receive)
        if scope["method"] == "POST" and path.rstrip("/") == "/gradio_api/upload":
            send = _images_only(send)
        started = False
        upload = scope["method"] == "POST" and path.rstrip("/") == "/gradio_api/upload"
        held: list[dict] = []  # an upload's 500, until we know whether it was a part without a file name

        async def tracked(message):
            nonlocal started
            if upload and (held or (message["type"] == "http.response.start" and message["status"] == 500)):
                held.append(message)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, _own_errors_only(path, tracked))
        except ClientDisconnect:  # the client left mid-body: nobody to answer (was an ERROR and a traceback)
            log.info("%s %s: the client left before its body was sent", scope["method"], path)
        except Exception as exc:  # Gradio lets some refusals escape (e.g. an unknown fn_index: KeyError)
            if isinstance(exc, TypeError) and upload and not started:
                # a part with an empty file name is a form field to Gradio's parser, not a file: it raised
                # TypeError("File is not an instance of GradioUploadFile"), a 500
                log.info("%s: %s", path, exc)
                await _answer(send, 400, path, "every part of an upload must be a file with a file name")
                return
            log.exception("%s %s failed inside Gradio", scope["method"], path)
            if not started:
                await _answer(send, 500, path, UNREADABLE)
        else:
            for message in held:
                await send(message)


# Names the page's pickers offer; a broken file named like an image is kept (the edit or the Batch
# item then says which one is not readable) and expires with Gradio's cache (delete_cache).
UPLOAD_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".heic", ".heif",
                   ".avif", ".zip")


def _images_only(send):
    """Gradio's upload route keeps any file; what it kept is checked on the way out: an upload with a
    file that is neither an image (FORMATS) nor a zip, by its content and by its name, is deleted, all
    of it, and refused by name."""

    async def finish(start: dict, raw: bytes) -> None:
        try:
            kept = [p for p in json.loads(raw) if isinstance(p, str) and in_upload_folder(p)]
        except (ValueError, TypeError):
            kept = []
        refused = next((i for i, p in enumerate(kept) if not _readable_kind(p)), None)
        if refused is None:
            await send(start)
            await send({"type": "http.response.body", "body": raw})
            return
        for p in kept:
            with contextlib.suppress(OSError):
                os.remove(p)
        name = os.path.basename(kept[refused])[:100]
        await _answer(send, 400, "/gradio_api/upload",
                      f"file {refused + 1} ({name!r}) is not an image ({', '.join(FORMATS)}) or a zip of "
                      "images; nothing of this upload was kept")

    return _held(send, lambda status: status == 200, finish)


def _readable_kind(path: str) -> bool:
    if path.lower().endswith(UPLOAD_SUFFIXES):
        return True
    try:
        with open(path, "rb") as f:
            return image_or_zip(f.read(12))
    except OSError:
        return False


def _replay(raw: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


def _error_body(path: str, message: str) -> bytes:
    """Gradio's shapes: `{"error": ...}` for /run and /api (what its client shows), `{"detail": ...}` else."""
    key = "error" if path.startswith(("/gradio_api/run/", "/gradio_api/api/")) else "detail"
    return json.dumps({key: message, "title": "invalid input"} if key == "error" else {key: message}).encode()


async def _answer(send, status: int, path: str, message: str) -> None:
    body = _error_body(path, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _ours(body) -> bool:
    if not isinstance(body, dict):
        return False
    if body.get("title") and isinstance(body.get("error"), str):
        return True  # a gr.Error: only our handlers raise them
    detail = body.get("detail")
    # The validator's verdicts (a list per input); FastAPI's own 422 items carry "loc".
    return isinstance(detail, list) and all(isinstance(d, dict) and "loc" not in d for d in detail)


def _held(send, holds, finish):
    """An ASGI `send` that passes every response on, except one whose status `holds` accepts: that one's
    body is gathered whole and handed to `finish(start, body)`, which answers in its place."""
    start: dict | None = None
    chunks: list[bytes] = []

    async def held(message):
        nonlocal start
        if message["type"] == "http.response.start" and holds(message["status"]):
            start = message
            return
        if start is None:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            await finish(start, b"".join(chunks))

    return held


def _own_errors_only(path: str, send):
    """Error answers whose text is Gradio's or FastAPI's (a refused payload: pydantic, paths, counts) get
    ours instead; gr.Error answers (they carry a title) and the validator's 422 verdicts are ours."""

    async def finish(start: dict, raw: bytes) -> None:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not _ours(body):
            raw = _error_body(path, UNREADABLE)
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})

    return _held(send, lambda status: status in (400, 422, 500), finish)
