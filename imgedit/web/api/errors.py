"""OpenAI's error shape for every REST route, built in one place: {"error": {"message", "type", "param",
"code"}}. Routes raise (our own `ImgEditError`s, or `ApiError` for an answer of the API itself: a missing key,
an unknown job, one not finished or deleted); the handlers `install` registers turn them into the response.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from imgedit.errors import ImgEditError, InvalidInput
from imgedit.protocol import PARAMETERS

log = logging.getLogger(__name__)
T = TypeVar("T")

# an error's kind (imgedit.errors) -> the HTTP status REST answers it with
STATUS = {"invalid_input": 400, "too_large": 413, "busy": 429, "cancelled": 499, "out_of_memory": 507,
          "worker_failed": 503, "not_ready": 503, "shutting_down": 503}
# The request's fields as REST callers name them (OpenAI's words: the declared `rest`), where the shared
# checks use ours.
REST_NAMES = {p.name: p.rest for p in PARAMETERS if p.rest}


def error_type(status: int) -> str:
    """OpenAI's `type` for a status: what the caller should do about it. Every 4xx but the key and the rate
    limit is the request's own (a job not finished yet, 409, or deleted, 410, included); 5xx are the
    server's."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def rest_words(message: str, param: str | None) -> tuple[str, str | None]:
    """A shared check's message and parameter in the REST caller's words ("n 5 is out of range", param n);
    a message that names the parameter first is reworded, one in plain words ("3 input images given") is
    not."""
    if param in REST_NAMES:
        if message.startswith(param + " "):
            message = REST_NAMES[param] + message[len(param):]
        return message, REST_NAMES[param]
    return message, param


def openai_error(status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """The one builder of an error response."""
    message, param = rest_words(message, param)
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class ApiError(Exception):
    """An answer of the API itself rather than of the edit: raised by a route, answered by `install`'s
    handler."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


async def rejected(metrics, route: str, parsing: Awaitable[T], task: str = "edit") -> T:
    """A request parsed (and resolved) by `parsing`; a refusal is counted (metrics) and raised for the
    handler, and anything else that broke the parsing is a 400 (the traceback goes to the log)."""
    try:
        return await parsing
    except ImgEditError as exc:
        metrics.record_rejected("rest", exc.kind, task)
        raise
    except Exception:
        log.exception("unreadable %s request", route)
        metrics.record_rejected("rest", "invalid_input", task)
        raise InvalidInput("the request could not be read") from None


def status_of(exc: ImgEditError) -> int:
    return STATUS.get(exc.kind, 500)


def install(app: FastAPI) -> None:
    """Every REST route's errors in OpenAI's shape."""
    app.add_exception_handler(ImgEditError, _ours)
    app.add_exception_handler(ApiError, _api)
    app.add_exception_handler(RequestValidationError, _invalid_request)


async def _ours(request: Request, exc: ImgEditError) -> JSONResponse:
    return openai_error(status_of(exc), exc.message, exc.kind, exc.field)


async def _api(request: Request, exc: ApiError) -> JSONResponse:
    return openai_error(exc.status, exc.message, exc.code, exc.param)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A path or query value FastAPI could not convert: our OpenAI-shaped 400, not its 422 (whose
    text is the framework's)."""
    where = next((e.get("loc", ()) for e in exc.errors()), ())
    param = str(where[-1]) if where else None
    return openai_error(400, f"{param or 'a request value'} is not valid", "invalid_input", param)
