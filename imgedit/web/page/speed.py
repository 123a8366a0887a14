"""The page's speed and LoRA controls: "Speed" (quality / fast / fastest), shown only when a Lightning
LoRA for that speed is configured (Qwen-Image-2.1: both when TURBO_MODEL_DIR is set), a LoRA picker with a
strength, shown only when LoRAs are, and the step cache for quality edits, shown only when the workers can
run one.

The values go to the /edit event as `speed`, `lora`, `lora_scale`, `cache`, the same names REST takes.
"""

from __future__ import annotations

import math

import gradio as gr

from imgedit.config.loras import SPEEDS, lightning_for
from imgedit.config.settings import Settings
from imgedit.engine.validation import CACHES
from imgedit.errors import InvalidInput
from imgedit.planning.modes import fast_steps
from imgedit.planning.turbo import open_turbo
from imgedit.protocol import group, param

SPEEDS_SHOWN = {"quality": ("Quality", "the model's steps, CFG on"), "fast": ("Fast", "Lightning, 8 steps"),
                "fastest": ("Fastest", "Lightning, 4 steps")}  # the label, then what it runs
NO_LORA = "none"
SPEED_FIELDS = group("speed")  # the parameters of the controls build_speed_controls makes (declared)
SERVER_CACHE = "default"  # the Step cache choice that leaves the request's `cache` out: the server's CACHE
CACHE_LABELS = {"none": "None (the exact image)",
                "first-block": "First-block (skips the other blocks while the first one changes little)",
                "taylorseer": "TaylorSeer (forecasts 2 of every 3 steps after the 5th: ~1.4x faster)"}


def speed_choices(settings: Settings) -> list[tuple[str, str]]:
    """Quality, plus each Lightning speed whose LoRA is configured; a speed that runs on FAST_QUANTIZE's copy
    says so (its images are not the bf16 weights' images). With TURBO_MODEL_DIR (start-up took it for
    Qwen-Image-2.1 only) both speeds, each running the Turbo's steps."""

    if settings.turbo_model_dir:  # Qwen-Image-2.1-Turbo: both speeds run its own schedule
        runs = f"Qwen-Image-2.1-Turbo, {open_turbo(settings.turbo_model_dir).steps} steps"
        return [(f"{SPEEDS_SHOWN['quality'][0]} (the model's steps)", "quality"),
                *((f"{SPEEDS_SHOWN[speed][0]} ({runs})", speed) for speed in ("fast", "fastest"))]
    quantized = fast_steps(settings)
    choices = []
    for speed, steps in SPEEDS.items():
        if steps is None or lightning_for(settings.lora_entries, steps) is not None:
            name, runs = SPEEDS_SHOWN[speed]
            weights = f", {settings.fast_quantize} weights" if steps in quantized else ""
            choices.append((f"{name} ({runs}{weights})", speed))
    return choices


def lora_choices(settings: Settings) -> list[str]:
    return [NO_LORA, *(e.name for e in settings.lora_entries)]


def parse_speed_inputs(speed, lora, lora_scale) -> tuple[str | None, str | None, float | None]:
    """Raw event values (preprocess=False) -> EditRequest fields; validation.resolve checks them."""

    if speed is not None and not isinstance(speed, str):
        raise InvalidInput("speed must be text", "speed")
    if lora is not None and not isinstance(lora, str):
        raise InvalidInput("lora must be text", "lora")
    scale = None
    if lora_scale not in (None, ""):
        if isinstance(lora_scale, bool) or not isinstance(lora_scale, (int, float, str)):
            raise InvalidInput("lora_scale must be a number", "lora_scale")
        try:
            scale = float(lora_scale)
        except ValueError:
            raise InvalidInput(f"lora_scale must be a number, got {str(lora_scale)[:40]!r}",
                               "lora_scale") from None
        if not math.isfinite(scale):
            raise InvalidInput(f"lora_scale must be a finite number, got {str(lora_scale)[:40]!r}",
                               "lora_scale")
    return speed or None, None if lora in (None, "", NO_LORA) else lora, scale


def build_speed_controls(settings: Settings) -> dict[str, gr.components.Component]:
    """The speed, lora and lora_scale controls, by their declared names (imgedit.protocol.PARAMETERS)."""
    choices = speed_choices(settings)
    speed = gr.Radio(choices, value="quality", label="Speed", elem_id="speed", visible=len(choices) > 1,
                     info=("Turbo" if settings.turbo_model_dir else "Lightning")
                     + " presets set their own steps and turn CFG off")
    has_loras = bool(settings.lora_entries)
    with gr.Row(visible=has_loras):
        lora = gr.Dropdown(lora_choices(settings), value=NO_LORA, label="LoRA", elem_id="lora")
        scale = gr.Slider(*param("lora_scale").bounds(), value=1.0, step=0.05, label="LoRA strength",
                          elem_id="lora-scale")
    return {"speed": speed, "lora": lora, "lora_scale": scale}


def build_cache_control(settings: Settings, refusal: str | None) -> gr.Dropdown:
    """The step cache for quality edits (CACHE, a request's `cache`): hidden where the workers cannot run
    one (`refusal`, e.g. compiled workers), since every choice but none would be refused."""
    choices = [(f"Server default ({settings.cache})", SERVER_CACHE), *((CACHE_LABELS[c], c) for c in CACHES)]
    return gr.Dropdown(choices, value=SERVER_CACHE, label="Step cache (quality edits; faster, lossy)",
                       elem_id="cache", visible=refusal is None,
                       info="Reuses or forecasts the transformer's work between steps; the PNG records which")


def parse_cache_input(cache, speed) -> str | None:
    """The Step cache's raw value -> the request's `cache` (None: the server's CACHE). A Lightning speed runs
    its few steps uncached, so the choice is dropped there instead of refused."""

    if cache in (None, "", SERVER_CACHE) or speed not in (None, "", "quality"):
        return None
    if not isinstance(cache, str):
        raise InvalidInput("cache must be text", "cache")
    return cache


def stored_cache_choice(stored: str | None, offered: bool) -> str:
    """The Step cache choice for the cache an image was made with (its PNG's `cache`: "taylorseer",
    "first-block:0.08"; None: made without one, the exact image). Where the workers run no cache the hidden
    control stays at the server's default: a restored cache would have every edit refused."""
    name = (stored or "none").split(":", 1)[0]
    return name if offered and name in CACHES else SERVER_CACHE
