"""OpenAI's `response_format=url`: a REST edit's (or generation's) images served from its owner's stored
results (imgedit.engine.jobs.history) at `/v1/images/results/<request id>/<n>`, for an hour (OpenAI's URLs
last 60 minutes). The route takes the same key as every REST route and looks the result up by its owner:
another key (or another anonymous token) gets 404, as for an id that never was."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from imgedit.engine.jobs.history import HistoryEntry, HistoryStore
from imgedit.engine.outputs import reencoded
from imgedit.web.api.errors import ApiError
from imgedit.web.api.rest_requests import output_format

URL_LIFETIME_S = 3600  # OpenAI: "URLs are only valid for 60 minutes after the image has been generated"
RESULTS_PATH = "/v1/images/results"


def image_urls(request: Request, entry: HistoryEntry, reply: tuple[str, int]) -> list[str]:
    """The absolute URLs of a stored result's images, in the reply's format (a JPEG or WebP is made from the
    stored PNG when fetched)."""
    image_format, quality = reply
    query = "" if image_format == "png" else "?" + urlencode(
        {"output_format": image_format, "output_compression": quality})
    base = str(request.base_url).rstrip("/")
    return [f"{base}{RESULTS_PATH}/{entry.job_id}/{n}{query}" for n in range(1, entry.outputs + 1)]


def build_image_urls_router(history: HistoryStore, key: Depends) -> APIRouter:
    router = APIRouter()

    @router.get(RESULTS_PATH + "/{request_id}/{number}", response_class=Response,
                responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}}})
    async def stored_image(request_id: str, number: str, request: Request, owner: str = key) -> Response:
        """One image of a REST edit answered with `response_format=url` (1 = the first), for the key that
        made it, within an hour of the edit."""
        image_format, quality = output_format(request.query_params)
        entries = await asyncio.to_thread(history.job, owner, request_id[:64])
        one = int(number) if number.isdecimal() and len(number) <= 4 else 0
        if not entries or not 1 <= one <= entries[0].outputs:
            raise ApiError(404, f"no image {number[:8]!r} of {request_id[:40]!r} for this API key",
                           "not_found")
        entry = entries[0]
        if time.time() - entry.created > URL_LIFETIME_S:
            raise ApiError(410, f"this image URL expired {URL_LIFETIME_S // 60} minutes after the edit; "
                           f"GET /v1/jobs/{request_id}/result gives the stored result while it is kept",
                           "expired")
        path = entry.output_paths[one - 1]
        try:
            if image_format == "png":
                data = await asyncio.to_thread(path.read_bytes)
            else:
                data = await asyncio.to_thread(reencoded, path, image_format, quality)
        except FileNotFoundError:  # pruned between the lookup and the read
            raise ApiError(410, "the stored result was deleted (OUTPUT_RETENTION_HOURS / OUTPUT_MAX_GB)",
                           "gone") from None
        return Response(data, media_type=f"image/{image_format}")

    return router
