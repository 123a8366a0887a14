"""An exact `POST /gradio_api/cancel`: stop the one job it names, not every job of that client.

Gradio 6.31's own route cancels every running task of the session and event (`cancel_tasks({session_fn})`)
and then completes only the named event, so one `Job.cancel()` of a gradio_client with several jobs
in flight cancelled them all and left the others waiting forever for a result. Our edit jobs are
"running" tasks for Gradio while they wait in the manager's line, so this hit every waiting job.
This route is registered on the parent app ahead of the Gradio mount and does the same bookkeeping
as Gradio's, for the named event only (the browser's Cancel button and gradio_client both name it);
no event of ours is a generator, so Gradio's iterator bookkeeping has nothing to do here.
"""

from __future__ import annotations

import asyncio
import logging

import gradio as gr
from fastapi import APIRouter, HTTPException, Request
from gradio.data_classes import CancelBody
from gradio.server_messages import ProcessCompletedMessage

log = logging.getLogger(__name__)
CANCEL_PATH = "/gradio_api/cancel"


def task_name(session_hash: str, fn_index: int, event_id: str) -> str:
    """The name Gradio's queue gives the task that runs one event (gradio.utils.set_task_name)."""
    return f"{session_hash}_{fn_index}<gradio-sep>{event_id}"


def logged_in(request: Request, auth_enabled: bool) -> bool:
    """Gradio's own login check (its `access-token` cookie), which Gradio 6.31's cancel route lacks: with
    GRADIO_AUTH set anyone could cancel anyone's job by its ids. `request.app.state.gradio_app`: the mounted
    Gradio app (web.app); while it is unknown, a server with logins refuses."""
    if not auth_enabled:
        return True
    gradio_app = getattr(request.app.state, "gradio_app", None)
    if gradio_app is None:
        return False
    token = (request.cookies.get(f"access-token-{gradio_app.cookie_id}")
             or request.cookies.get(f"access-token-unsecure-{gradio_app.cookie_id}"))
    return gradio_app.tokens.get(token) is not None


def build_cancel_router(blocks: gr.Blocks, auth_enabled: bool = False) -> APIRouter:
    router = APIRouter()

    @router.post(CANCEL_PATH, include_in_schema=False)
    async def cancel_event(body: CancelBody, request: Request) -> dict:
        if not logged_in(request, auth_enabled):
            raise HTTPException(401, {"error": "Not authenticated"})
        name = task_name(body.session_hash, body.fn_index, body.event_id)
        tasks = [task for task in asyncio.all_tasks() if task.get_name() == name]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        queue = blocks._queue
        session_open = body.session_hash in queue.pending_messages_per_session
        event_known = body.event_id in queue.pending_event_ids_session.get(body.session_hash, set())
        await queue.remove_from_queue(body.event_id)  # a job Gradio has not started yet
        if session_open and event_known:
            # The client waits for a completion message of this event before it lets go.
            queue.pending_messages_per_session[body.session_hash].put_nowait(
                ProcessCompletedMessage(output={}, success=True, event_id=body.event_id))
        log.info("cancel of event %s: %d running task(s) stopped", body.event_id, len(tasks))
        return {"success": True}

    return router
