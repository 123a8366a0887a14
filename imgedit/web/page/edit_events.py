"""The Edit tab's events: the Edit button's and the gradio `/edit` API's edit (one handler, one job each
through the manager's line), Cancel, Restore, Copy as API call, and what acts on the inputs and the result.

Every GPU event shares the concurrency group "gpu" and goes straight on to the manager's line, where UI,
gradio API and REST jobs wait together in arrival order (the page shows how many are ahead); the line, not
Gradio, bounds the wait (QUEUE_MAX_SIZE) and each worker's lock keeps its GPUs to one job. The edit handler is
async: when a user (or gradio_client) cancels, Gradio cancels the task, `manager.run` sets the job's cancel
flag, and the pipeline stops within one step.
"""

from __future__ import annotations

import asyncio
import functools
import html
import logging
from dataclasses import replace

import gradio as gr

from imgedit.config.settings import Settings
from imgedit.engine.images import frame_notices
from imgedit.engine.interface import Engine
from imgedit.engine.outputs import png_bytes
from imgedit.errors import ImgEditError
from imgedit.planning.families import FAMILIES
from imgedit.protocol import EDIT, parameters
from imgedit.web.identity import page_owner
from imgedit.web.page.chain import wire_chain
from imgedit.web.page.controls import api_component
from imgedit.web.page.editor import Editor
from imgedit.web.page.enhance_controls import wire_enhance
from imgedit.web.page.expand import wire_expand
from imgedit.web.page.live_preview import Watch, hidden
from imgedit.web.page.mask_controls import follow_first_input, painted_mask
from imgedit.web.page.progress import EditProgress
from imgedit.web.page.requests import build_request, edit_fields, edit_signature
from imgedit.web.page.select_controls import wire_select
from imgedit.web.page.tools import PageTools, cached_pngs, page_files, user_error

log = logging.getLogger(__name__)
GPU_GROUP = "gpu"
PREVIEW_POLL_S = 0.25  # how often the page's edit looks for a new live preview (and at its end)
EDIT_API_DOC = (  # the API's description, as gradio_client shows it
    "Edit the images as the prompt says; returns the result images and the seed used. With `mask` (an\n"
    "image the first image's size: white, or fully transparent, marks where to edit) only that area\n"
    "changes and the result is the first image's size. With `enhance_prompt` the model's text encoder\n"
    "rewrites the prompt first (each PNG then carries the prompt used and the original_prompt). `cache`\n"
    "(none, first-block, taylorseer; default: the server's CACHE) speeds up a quality edit, lossily.\n"
    "`mask_prompt` (words: 'the red car') has the model outline the mask itself; refused when it finds\n"
    "nothing (`/select_mask` returns the proposed mask alone).")


class EditEvents:
    """An edit's handlers over the engine: `/edit`'s validator and handler for API callers, the Edit button's
    for the page (the History tab's re-run too)."""

    def __init__(self, settings: Settings, manager: Engine, tools: PageTools, history=None):
        self.settings, self.manager, self.tools, self.history = settings, manager, tools, history
        self.fields = edit_fields()  # `/edit`'s parameters in the declaration's order

    def validate(self, *values) -> list:
        """Runs before an API job enters the queue: bad input costs nothing else. The message goes to the
        input at fault. `values`: `/edit`'s parameters in order (web.page.requests.edit_fields)."""
        verdicts = [gr.validate(True, "")] * len(self.fields)
        try:
            # the images by their headers: the event decodes them once
            req = build_request(self.settings, self.manager.family, *values, source="validator", decode=False)
            self.manager.check(req)  # the values, and whether these workers can run them
        except ImgEditError as exc:
            at = self.fields.index(exc.field) if exc.field in self.fields else 0
            verdicts[at] = gr.validate(False, html.escape(exc.message))
        except Exception:
            log.exception("validator failed")
            verdicts[0] = gr.validate(False, "these inputs could not be read")
        return verdicts

    async def run(self, values: tuple, request: gr.Request | None, progress: gr.Progress,
                  watch: Watch | None = None):
        """One edit from `/edit`'s values in order: (the request, the result, its PNGs), recorded in
        History. `watch`: the page shows this edit's live preview (the worker makes one only then)."""
        manager = self.manager
        source = "ui" if request is not None and request.headers.get("referer") else "api"
        try:  # decoding up to three large images: off the event loop
            parse = functools.partial(build_request, self.settings, manager.family, *values, source=source)
            req = await asyncio.to_thread(parse)
            params = manager.resolve(req)  # every check, once: the job runs with these
        except Exception as exc:
            raise user_error(exc) from None
        owner = page_owner(request, self.settings.auth is not None)
        # The line's share is per login or browser; a client without cookies (gradio_client) per session.
        session = f"session:{request.session_hash}" if request is not None else None
        req = replace(req, client=owner or session, watch=watch is not None)
        track = EditProgress(req.request_id)
        if watch is not None:
            watch.follow(req.request_id, track)
        running = manager.run(req, on_step=track.on_step, on_wait=track.on_wait, params=params)
        job = asyncio.ensure_future(running)
        try:
            while not job.done():
                value, desc = track.render(manager.status())
                progress(value, desc=desc, unit="steps")
                await asyncio.wait({job}, timeout=0.25)
            result = job.result()
        except asyncio.CancelledError:
            job.cancel()  # manager.run sets the job's cancel flag: the worker stops at its next step
            raise
        except Exception as exc:
            raise user_error(exc) from None
        # The results' PNGs are written once (zlib level 1, with their settings), off the event loop, for the
        # page's components and the history alike.
        pngs = await asyncio.to_thread(lambda: [png_bytes(image) for image in result.images])
        if self.history is not None and owner:
            await self.history.record(owner, req.request_id, 0, req, result, pngs=pngs)
        return req, result, pngs

    def api(self):
        """`/edit`'s handler. Gradio names an API's parameters and their defaults after its function's
        signature, and `/edit`'s are the declaration's (a parameter added there is one more here): the
        signature is made from it (web.page.requests.edit_signature), the only handler not written out."""

        @edit_signature
        async def edit(*args):
            *values, request, progress = args  # Gradio passes them after the parameters
            _, result, pngs = await self.run(tuple(values), request, progress)
            return await asyncio.to_thread(cached_pngs, pngs, "result"), result.seed

        edit.__doc__ = EDIT_API_DOC
        return edit

    async def page(self, request: gr.Request, progress=gr.Progress(), **form):
        """The Edit button (`form`: {declared parameter: its control's value}): while the edit runs, its live
        preview as it comes (web.page.live_preview); then the result, a status line with the seed used, the
        comparison, the chosen result, and the message beside Edit, the preview hidden. A refused edit leaves
        the rest as it was and says why beside Edit until the next run (as a toast it vanished after a few
        seconds and left a bare "Error" badge on the result)."""
        keep = gr.update()
        watch = Watch(self.manager)
        try:
            if not form["mask"]:  # "": nothing painted; the mask's settings go with it
                form.update({p.name: None for p in parameters(EDIT)
                             if p.name == "mask" or p.beside == "mask"})
            form["cache"] = self.tools.page_cache(form["cache"], form["speed"])
            values = tuple(form[name] for name in self.fields)
            edit = asyncio.ensure_future(self.run(values, request, progress, watch))
            try:
                while not edit.done():
                    await asyncio.wait({edit}, timeout=PREVIEW_POLL_S)
                    if (shown := watch.fresh()) is not None:
                        yield keep, keep, keep, keep, keep, shown
            finally:  # Cancel (this task cancelled) or the page gone (the generator closed): the job stops
                edit.cancel()  # nothing once it has finished
            req, result, pngs = edit.result()
        except gr.Error as exc:
            yield keep, keep, keep, keep, f"**{exc.title or 'Not edited'}:** {exc.message}", hidden()
            return
        try:
            yield (*await self.show(req, result, pngs), hidden())
        except Exception:  # the job ran; its files could not be shown: say so beside Edit, not a silent page
            log.exception("%s: the result could not be shown", req.request_id)
            said = f"the result of {req.request_id} could not be shown (an internal error: see the log)"
            yield keep, keep, keep, keep, f"**Not shown:** {said}", hidden()

    async def show(self, req, result, pngs):
        """The page's outputs for a finished job: the gallery, the status line, the comparison, the chosen
        one."""
        seeds = [image.info.get("seed", "?") for image in result.images]
        each = ""
        if len(seeds) > 1:
            each = (f" Image i was drawn from seed + i ({', '.join(seeds)}): that seed with one image makes "
                    "it again.")
        done = (f"Done in {result.seconds:.1f} s: {len(result.images)} image(s), "
                f"{result.width}x{result.height}, {result.steps} steps. **Seed used: {result.seed}** "
                f"(to repeat it, untick *Randomize seed* under Advanced and enter this seed).{each}")
        if req.mask is not None:
            done += " Only the painted area of the first image changed; the result has its size."
        if req.expand:
            done += f" The canvas was expanded ({req.expand}); the first image's own pixels are unchanged."
        if cached := result.images[0].info.get("cache"):
            done += f" Step cache: {cached} (lossy)."
        if result.weights:
            done += f" Ran on the server's {result.weights} fast-mode weights (lossy)."
        if notices := frame_notices(req.images):  # e.g. an animated GIF: its first frame was edited
            done += "\n\n**Note:** " + "; ".join(notices) + "."
        files, compare = await asyncio.to_thread(page_files, req, result.images[0], pngs)
        return files, done, compare, 0, ""


def build_edit_api(events: EditEvents) -> None:
    """The `/edit` API: hidden inputs without ranges, so every value reaches the validator and our messages.
    Every parameter after `prompt` is optional in gradio_client (a value here, or a default in the handler's
    signature), and the results are named."""
    with gr.Row(visible=False):
        inputs = [api_component(p) for p in parameters(EDIT)]
        outputs = [gr.Gallery(format="png", label="images"), gr.Number(label="seed")]
        button = gr.Button()
    button.click(events.api(), inputs, outputs, api_name="edit", concurrency_id=GPU_GROUP,
                 concurrency_limit=None, validator=events.validate, preprocess=False)


def wire_editor(blocks: gr.Blocks, settings: Settings, manager: Engine, events: EditEvents, editor: Editor):
    """The editor's events (all private: the public API is `/edit`). preprocess=False: our own code parses the
    raw values (junk gets our message, not a Gradio processing error). Files were checked twice before a
    handler runs (web.page.uploads.EventGuard, then Gradio's upload check); the handlers check the paths they
    open or return once more. Returns the edit's event (the Batch and History tabs follow it)."""
    tools, e, private = events.tools, editor, {"api_visibility": "private"}
    e.files.upload(tools.check_uploads, e.files, [e.files, e.compare, e.restore, e.stored], preprocess=False,
                   **private)
    # an example's inputs fill Before/after as an upload does (they did not: no upload event)
    e.examples.load_input_event.then(tools.first_input_compare, e.files, e.compare, preprocess=False,
                                     queue=False, **private)
    # The last refusal's message goes first, then the edit (one chain: two listeners raced, and a quick
    # refusal was wiped by the clearing of the one before).
    cleared = e.run.click(lambda: ("", gr.update(interactive=True)), None, [e.message, e.stop], queue=False,
                          **private)
    # The painted strokes become a mask file first (the canvas's own preprocessing reads them).
    masked = cleared.then(painted_mask, e.canvas, e.controls["mask"], queue=False, preprocess=False,
                          **private)
    # No Gradio limit: every job goes straight to the manager's line, where UI, API and REST jobs wait
    # together in arrival order and QUEUE_MAX_SIZE is enforced once; the workers' locks keep each GPU to one
    # job. The form reaches the handler by name (inputs_kwargs: {declared parameter: its control}).
    event = masked.then(events.page, None, e.outputs, inputs_kwargs=e.controls, concurrency_id=GPU_GROUP,
                        concurrency_limit=None, preprocess=False, show_progress_on=[e.result], **private)
    idle = gr.update(interactive=False)
    event.then(lambda: idle, None, e.stop, queue=False, **private)  # done, refused or failed
    e.stop.click(lambda: ("Cancelled: nothing was kept from that run.", idle, hidden()), None,
                 [e.status, e.stop, e.live], cancels=[event], queue=False, **private)
    event.success(tools.download_chosen, [e.result, e.chosen], e.download, preprocess=False, queue=False,
                  **private)
    e.result.change(tools.result_buttons, e.result, [e.again, e.add, e.reuse], preprocess=False, queue=False,
                    **private)
    e.reuse.click(tools.reuse_seed, [e.result, e.chosen], [e.controls["seed"], e.controls["randomize_seed"]],
                  preprocess=False, queue=False, **private)
    e.result.select(tools.select_result, [e.files, e.result], [e.chosen, e.compare, e.download],
                    preprocess=False, **private)
    # Queued (its own default group, never behind GPU jobs): only queued events can show a toast.
    restored = tuple(p.name for p in parameters(EDIT) if p.restore)  # what a PNG's settings give back
    randomize = e.controls["randomize_seed"]  # a restored seed is used as it is
    e.restore.click(functools.partial(tools.restore_settings, names=restored), e.stored,
                    [e.controls[name] for name in restored] + [randomize, e.restore], **private)

    def snippets(request: gr.Request, *, canvas, gallery, index, **form):
        # the seed the chosen result was made with: a randomized edit's snippet repeats it
        return tools.api_call(form, canvas, request, tools.result_seed(gallery, index))

    e.copy_api.click(snippets, None, [e.snippets, *e.snippet_code, e.snippet_inputs],
                     inputs_kwargs={**e.controls, "canvas": e.canvas, "gallery": e.result, "index": e.chosen},
                     preprocess=False, queue=False, **private)
    # Any change of the inputs (upload, removal, an example, a result used as input) redraws the thumbnails.
    e.files.change(tools.preview_inputs, e.files, e.preview, preprocess=False, queue=False, **private)
    if FAMILIES[manager.family].generates:  # no input image: the button makes one from the prompt
        e.files.change(lambda paths: gr.update(value="Edit" if paths else "Generate"), e.files, e.run,
                       preprocess=False, queue=False, **private)
    follow_first_input(e.files, e.canvas)
    wire_expand(e.expand, e.files, settings, manager.family)
    wire_select(settings, manager, e.files, e.canvas, e.select_controls, GPU_GROUP)
    wire_enhance(settings, manager, e.files, e.prompt, e.enhance_controls, GPU_GROUP)
    # typing sends one count at a time: keystrokes while one is on its way collapse into the last
    e.prompt.change(tools.prompt_count, e.prompt, e.counter, queue=False, preprocess=False,
                    trigger_mode="always_last", **private)
    # the last refusal beside Edit is about the last edit: a rewrite starts afresh
    e.enhance_controls[0].click(lambda: "", None, e.message, queue=False, **private)
    e.preview.select(tools.chosen_input, None, e.chosen_input, queue=False, **private)
    e.first.click(tools.make_first, [e.files, e.chosen_input], e.files, preprocess=False, queue=False,
                  **private)
    wire_chain(blocks, tools, e.files, e.result, e.chosen, e.again, e.chain_controls, e.prompt)
    e.add.click(tools.add_result, [e.files, e.result, e.chosen], e.files, preprocess=False, **private)
    return event
