"""The edit chain: "Use this result as input" builds a visible chain of the inputs each edit started from,
with Undo, Redo and a click on any step to go back to it (its inputs return to the editor), kept per
browser: a reload shows the chain again.

The chain lives in the browser (gr.BrowserState: its localStorage, encrypted with a secret of this server's
run; not a gr.State, which holds a heartbeat connection open for each page's lifetime) as lists of file paths
in Gradio's upload cache. Every path that comes back from the browser is checked to lie there before it is
used (web.page.uploads), as every other file of the page is; steps whose files the cache's sweep removed
are dropped when the page loads. Each step keeps the prompt its inputs were edited with (read from the
result's PNG), which going back to it puts in the prompt box again.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from imgedit.engine.outputs import read_settings
from imgedit.web.page.exports import download_name
from imgedit.web.page.tools import cached_png, refusal, user_error
from imgedit.web.page.uploads import uploaded_paths

CHAIN_LIMIT = 20  # steps kept: the oldest go first (each is a file in the upload cache, not in memory)
EMPTY = {"steps": [], "at": -1, "prompts": []}


def build_chain_controls() -> tuple:
    """(chain value, the strip of steps, Undo, Redo): hidden until a result has been used as input."""
    chain = gr.BrowserState(EMPTY, storage_key="imgedit-edit-chain")
    with gr.Group(visible=False, elem_id="edit-chain") as group:
        # fixed cells with room for the captions (assets.py): at height 130 they were cut to their top half
        strip = gr.Gallery(label="Edit chain: the inputs of each step (click one to go back to it)",
                           columns=8, height="auto", allow_preview=False, interactive=False,
                           object_fit="contain", elem_id="chain-strip", buttons=[])
        with gr.Row():
            undo = gr.Button("Undo", size="sm", elem_id="chain-undo", interactive=False)
            redo = gr.Button("Redo", size="sm", elem_id="chain-redo", interactive=False)
    return chain, group, strip, undo, redo


def _prompts(chain: dict) -> list[str | None]:
    """The prompt each step's inputs were edited with (None: not known), one per step of the chain as sent
    (before CHAIN_LIMIT), whatever the browser sent."""
    count = len(chain["steps"])
    given = chain.get("prompts")
    given = [p if isinstance(p, str) else None for p in given[:count]] if isinstance(given, list) else []
    return given + [None] * (count - len(given))


def _checked(chain) -> tuple[list[list[str]], int, list[str | None]]:
    """The chain's steps, position and prompts as the browser sent them, every path checked."""
    if not isinstance(chain, dict) or not isinstance(chain.get("steps"), list):
        return [], -1, []
    try:
        steps = [uploaded_paths(step) for step in chain["steps"][-CHAIN_LIMIT:]]
    except Exception as exc:
        raise user_error(exc) from None
    at = chain.get("at")
    at = at if isinstance(at, int) and 0 <= at < len(steps) else len(steps) - 1
    return steps, at, _prompts(chain)[-CHAIN_LIMIT:]


def _shown(steps: list[list[str]], at: int, prompts: list[str | None]) -> tuple:
    """(chain value, group, strip, undo, redo) updates for these steps."""
    captions = [("start" if i == 0 else f"edit {i}") + (" (now)" if i == at else "")
                for i in range(len(steps))]
    return ({"steps": steps, "at": at, "prompts": prompts}, gr.update(visible=len(steps) > 1),
            [(step[0], caption) for step, caption in zip(steps, captions, strict=True) if step],
            gr.update(interactive=at > 0), gr.update(interactive=at < len(steps) - 1))


def _named_result(path: str) -> tuple[str, str | None]:
    """The chosen result as an input named from its prompt and seed (every step was "result-0.png"), in the
    upload cache, and the prompt it was made with."""
    stored = read_settings(path)
    name = f"{download_name(stored.get('prompt'), stored.get('seed'))}.png"
    prompt = stored.get("original_prompt") or stored.get("prompt")
    return cached_png(Path(path).read_bytes(), name), prompt if isinstance(prompt, str) else None


def use_result(tools, images, gallery, index, chain) -> tuple:
    """"Use this result as input": the chosen result becomes the only input, and a step of the chain after the
    inputs it was made from (a step undone before is dropped, as an editor's redo history is)."""
    result, prompt = _named_result(tools.chosen_result(gallery, index))
    steps, at, prompts = _checked(chain)
    current = uploaded_paths(images) if images else []
    steps, prompts = steps[:at + 1], prompts[:at + 1]
    if current and (not steps or steps[-1] != current):  # the inputs as they were, changed by hand or not
        steps.append(current)
        prompts.append(None)
    if prompts:
        prompts[-1] = prompt  # what those inputs were edited with
    steps, prompts = [*steps, [result]][-CHAIN_LIMIT:], [*prompts, None][-CHAIN_LIMIT:]
    return ([result], gr.update(), *_shown(steps, len(steps) - 1, prompts))


def go_to(chain, step: int) -> tuple:
    """Back (or forward) to a step: its inputs return to the editor, and the prompt they were edited with."""
    steps, _, prompts = _checked(chain)
    if not 0 <= step < len(steps):
        raise refusal("that step of the chain is gone", "not in the chain")
    prompt = prompts[step] if prompts[step] is not None else gr.update()
    return (steps[step], prompt, *_shown(steps, step, prompts))


def reload(chain) -> tuple:
    """A page (re)loaded: the chain as it was, without the steps whose files are gone (the cache's sweep
    removes files after UPLOAD_CACHE_AGE_S) or are not in the upload cache; the position stays where every
    step is kept, else it moves to the last one. The step marked "now" returns to the editor (the reloaded
    editor was empty while the chain said "edit 2 (now)"), with its prompt where the chain knows it."""
    if not isinstance(chain, dict) or not isinstance(chain.get("steps"), list):
        return (gr.update(), gr.update(), *_shown([], -1, []))
    given = chain["steps"][-CHAIN_LIMIT:]
    given_prompts = _prompts(chain)[-CHAIN_LIMIT:]
    kept, prompts = [], []
    for step, prompt in zip(given, given_prompts, strict=True):
        try:
            kept.append(uploaded_paths(step))
            prompts.append(prompt)
        except Exception:  # noqa: BLE001 - gone, or never ours: that step is dropped, nothing of it is used
            continue
    at = chain.get("at")
    if len(kept) != len(given) or not isinstance(at, int) or not 0 <= at < len(kept):
        at = len(kept) - 1
    if at < 0 or len(kept) < 2:  # no chain to show: the editor stays as it is
        return (gr.update(), gr.update(), *_shown(kept, at, prompts))
    prompt = prompts[at] if prompts[at] is not None else gr.update()
    return (kept[at], prompt, *_shown(kept, at, prompts))


def wire_chain(blocks, tools, files, result, chosen, use_button, controls: tuple, prompt) -> None:
    """`use_button` ("Use this result as input") extends the chain; Undo, Redo and the strip move along it,
    bringing back each step's inputs and prompt."""
    chain, group, strip, undo, redo = controls
    outputs = [files, prompt, chain, group, strip, undo, redo]

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
    blocks.load(reload, chain, outputs, preprocess=False, queue=False, api_visibility="private")
