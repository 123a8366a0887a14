"""The edit chain: "Use this result as input" builds a visible chain of the inputs each edit started from,
with Undo, Redo and a click on any step to go back to it (its inputs return to the editor), kept per
browser: a reload shows the chain again.

The chain lives in the browser (gr.BrowserState: its localStorage, encrypted with a secret of this server's
run; not a gr.State, which holds a heartbeat connection open for each page's lifetime) as lists of file paths
in Gradio's upload cache. Every path that comes back from the browser is checked to lie there before it is
used (web.page.uploads), as every other file of the page is; steps whose files the cache's sweep removed
are dropped when the page loads.
"""

from __future__ import annotations

import gradio as gr

from imgedit.web.page.tools import refusal, user_error
from imgedit.web.page.uploads import uploaded_paths

CHAIN_LIMIT = 20  # steps kept: the oldest go first (each is a file in the upload cache, not in memory)
EMPTY = {"steps": [], "at": -1}


def build_chain_controls() -> tuple:
    """(chain value, the strip of steps, Undo, Redo): hidden until a result has been used as input."""
    chain = gr.BrowserState(EMPTY, storage_key="imgedit-edit-chain")
    with gr.Group(visible=False, elem_id="edit-chain") as group:
        strip = gr.Gallery(label="Edit chain: the inputs of each step (click one to go back to it)",
                           columns=8, height=130, allow_preview=False, interactive=False,
                           object_fit="contain", elem_id="chain-strip", buttons=[])
        with gr.Row():
            undo = gr.Button("Undo", size="sm", elem_id="chain-undo", interactive=False)
            redo = gr.Button("Redo", size="sm", elem_id="chain-redo", interactive=False)
    return chain, group, strip, undo, redo


def _checked(chain) -> tuple[list[list[str]], int]:
    """The chain's steps and position as the browser sent them, every path checked."""
    if not isinstance(chain, dict) or not isinstance(chain.get("steps"), list):
        return [], -1
    try:
        steps = [uploaded_paths(step) for step in chain["steps"][-CHAIN_LIMIT:]]
    except Exception as exc:
        raise user_error(exc) from None
    at = chain.get("at")
    return steps, at if isinstance(at, int) and 0 <= at < len(steps) else len(steps) - 1


def _shown(steps: list[list[str]], at: int) -> tuple:
    """(chain value, group, strip, undo, redo) updates for these steps."""
    captions = [("start" if i == 0 else f"edit {i}") + (" (now)" if i == at else "")
                for i in range(len(steps))]
    return ({"steps": steps, "at": at}, gr.update(visible=len(steps) > 1),
            [(step[0], caption) for step, caption in zip(steps, captions, strict=True) if step],
            gr.update(interactive=at > 0), gr.update(interactive=at < len(steps) - 1))


def use_result(tools, images, gallery, index, chain) -> tuple:
    """"Use this result as input": the chosen result becomes the only input, and a step of the chain after the
    inputs it was made from (a step undone before is dropped, as an editor's redo history is)."""
    result = tools.use_result(gallery, index)
    steps, at = _checked(chain)
    current = uploaded_paths(images) if images else []
    steps = steps[:at + 1]
    if current and (not steps or steps[-1] != current):  # the inputs as they were, changed by hand or not
        steps.append(current)
    steps = [*steps, result][-CHAIN_LIMIT:]
    return (result, *_shown(steps, len(steps) - 1))


def go_to(chain, step: int) -> tuple:
    """Back (or forward) to a step: its inputs return to the editor."""
    steps, _ = _checked(chain)
    if not 0 <= step < len(steps):
        raise refusal("that step of the chain is gone", "not in the chain")
    return (steps[step], *_shown(steps, step))


def reload(chain) -> tuple:
    """A page (re)loaded: the chain as it was, without the steps whose files are gone (the cache's sweep
    removes files after UPLOAD_CACHE_AGE_S) or are not in the upload cache; the position stays where every
    step is kept, else it moves to the last one. The inputs stay as the page has them."""
    if not isinstance(chain, dict) or not isinstance(chain.get("steps"), list):
        return _shown([], -1)
    given = chain["steps"][-CHAIN_LIMIT:]
    kept = []
    for step in given:
        try:
            kept.append(uploaded_paths(step))
        except Exception:  # noqa: BLE001 - gone, or never ours: that step is dropped, nothing of it is used
            continue
    at = chain.get("at")
    if len(kept) != len(given) or not isinstance(at, int) or not 0 <= at < len(kept):
        at = len(kept) - 1
    return _shown(kept, at)


def wire_chain(blocks, tools, files, result, chosen, use_button, controls: tuple) -> None:
    """`use_button` ("Use this result as input") extends the chain; Undo, Redo and the strip move along it."""
    chain, group, strip, undo, redo = controls
    outputs = [files, chain, group, strip, undo, redo]

    def position(value) -> int:
        return _checked(value)[1]

    use_button.click(lambda images, gallery, index, value: use_result(tools, images, gallery, index, value),
                     [files, result, chosen, chain], outputs, preprocess=False, api_visibility="private")
    undo.click(lambda value: go_to(value, position(value) - 1), chain, outputs, preprocess=False,
               api_visibility="private")
    redo.click(lambda value: go_to(value, position(value) + 1), chain, outputs, preprocess=False,
               api_visibility="private")

    def pick(value, evt: gr.SelectData):
        return go_to(value, evt.index)

    strip.select(pick, chain, outputs, preprocess=False, api_visibility="private")
    blocks.load(reload, chain, outputs[1:], preprocess=False, queue=False, api_visibility="private")
