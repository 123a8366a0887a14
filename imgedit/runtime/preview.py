"""A live preview while denoising, for a job someone watches (`EditRequest.watch`): every few steps the
latents' estimate of the finished image (x0 = x - sigma * v, v from the last two steps) is mapped to RGB by a
linear map of the packed latent channels and sent as a small JPEG with the next step's message. A job nobody
watches costs nothing: no hook is added.

The map is fitted on this worker's own VAE, once, on the first watched job: a picture of coloured blocks is
encoded, packed as the pipeline packs latents (16 pixels a token, both families), and least squares maps each
token to its cell's mean colour. So it serves Qwen-Image's VAE (16 channels, 2x2 packed), Qwen-Image-2.1's
(64 channels, 16x) and the demo's random one alike, with no table copied from elsewhere.
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager

import numpy as np
import torch
from PIL import Image

from imgedit.model import internals

CELL = 16  # pixels per latent token (imgedit.runtime.masking.LATENT_CELL)
FIT_SIDE = 384  # the fitting picture: 24x24 tokens, for 17-65 unknowns per colour
PREVIEWS = 8  # about this many previews per job
SIDE = 128  # the preview's longer side, pixels
QUALITY = 70


def preview_every(steps: int) -> int:
    return max(1, round(steps / PREVIEWS))


def fitting_picture(side: int = FIT_SIDE, seed: int = 0) -> Image.Image:
    """Coloured rectangles over a two-way gradient: colours of every hue and brightness, flat and smooth."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    pixels = np.stack([x, y, 1 - (x + y) / 2], axis=-1) * 255
    for _ in range(60):
        w, h = rng.integers(CELL, side // 3, size=2)
        left, top = rng.integers(0, side - w), rng.integers(0, side - h)
        pixels[top:top + h, left:left + w] = rng.integers(0, 256, size=3)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def fit(pipe, rgba: bool = False) -> torch.Tensor:
    """The (channels + 1, 3) map from a packed latent token (and 1) to its cell's colour in [-1, 1]."""
    picture = fitting_picture()
    tokens = encode_tokens(pipe, picture.convert("RGBA") if rgba else picture)[0].float().cpu()
    cells = FIT_SIDE // CELL
    colours = np.asarray(picture.resize((cells, cells), Image.BOX), dtype=np.float32) / 127.5 - 1.0
    inputs = torch.cat([tokens, torch.ones(tokens.shape[0], 1)], dim=1)
    targets = torch.from_numpy(colours.reshape(-1, 3))
    # ridge: a few hundred tokens for up to 65 unknowns; the small penalty keeps unused channels near 0
    gram = inputs.T @ inputs + 1e-3 * torch.eye(inputs.shape[1])
    return torch.linalg.solve(gram, inputs.T @ targets)


def encode_tokens(pipe, image: Image.Image) -> torch.Tensor:
    """The image's normalised latents, packed as the pipeline packs them: (1, tokens, features)."""
    side = image.size[0]
    pixels = pipe.image_processor.preprocess(image, side, side).unsqueeze(2)
    pixels = pixels.to(internals.execution_device(pipe), pipe.vae.dtype)
    return internals.pack_latents(pipe, internals.encode_vae_image(pipe, pixels))


def grid(tokens: int, aspect: float) -> tuple[int, int]:
    """(rows, columns) of a token count, the columns/rows nearest `aspect` (the output's width/height)."""
    best = (1, tokens)
    for rows in range(1, math.isqrt(tokens) + 1):
        if tokens % rows:
            continue
        for r, c in ((rows, tokens // rows), (tokens // rows, rows)):
            if abs(math.log(c / r / aspect)) < abs(math.log(best[1] / best[0] / aspect)):
                best = (r, c)
    return best


def to_jpeg(rgb: np.ndarray, rows: int, columns: int) -> bytes:
    """(tokens, 3) colours in [-1, 1] as a JPEG of the token grid, scaled up to SIDE."""
    pixels = ((rgb.reshape(rows, columns, 3) + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    scale = SIDE / max(rows, columns)
    if scale > 1:
        image = image.resize((max(1, round(columns * scale)), max(1, round(rows * scale))), Image.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=QUALITY)
    return buffer.getvalue()


class LivePreview:
    """The per-job feature (imgedit.runtime.runner.Call): for a watched job on the rank that reports steps, a
    hook at the end of every preview step; `take()` hands the newest preview to the step message (one step
    later, so that the copy from the GPU has finished without waiting for it)."""

    def __init__(self, pipe, rank: int = 0, rgba: bool = False):
        self.pipe, self.rank, self.rgba = pipe, rank, rgba
        self.factors: torch.Tensor | None = None
        self._pending: tuple | None = None

    @contextmanager
    def job(self, call):
        job = call.job
        if not job.request.watch or self.rank != 0:
            yield
            return
        if self.factors is None:
            with torch.inference_mode():
                self.factors = fit(self.pipe, self.rgba)
        every = preview_every(job.params.steps)
        aspect = _aspect(job)
        last: list = [None]  # the latents after the step before a preview step

        def hook(step: int, tensors: dict) -> None:
            latents = tensors["latents"][:1]
            if (step + 1) % every == 0 and last[0] is not None:
                self._start(self._estimate(step, latents, last[0]), aspect)
            last[0] = latents.detach().clone() if (step + 2) % every == 0 else None

        call.step_hooks.append(hook)
        if "latents" not in call.tensor_inputs:
            call.tensor_inputs.append("latents")
        try:
            yield
        finally:
            self._pending = None

    def _estimate(self, step: int, latents: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """x0 from the step's flow: x = x0 + sigma * v, with v from the last two latents."""
        sigmas = self.pipe.scheduler.sigmas
        now, then = float(sigmas[step + 1]), float(sigmas[step])
        if then == now:
            return latents
        return latents - now * (latents - before) / (now - then)

    def _start(self, x0: torch.Tensor, aspect: float) -> None:
        factors = self.factors.to(x0.device)
        tokens = x0[0].float()
        rgb = tokens @ factors[:-1] + factors[-1]
        done = None
        if rgb.is_cuda:  # copied while the next step runs; take() waits only if it has not arrived
            host = torch.empty(rgb.shape, dtype=rgb.dtype, pin_memory=True)
            host.copy_(rgb, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(rgb.device))  # the copy's GPU, not the current one (cuda:0)
            rgb = host
        self._pending = (rgb, done, grid(tokens.shape[0], aspect))

    def take(self) -> bytes | None:
        """The newest preview as a JPEG, once (None when there is none)."""
        if self._pending is None:
            return None
        rgb, done, (rows, columns) = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        return to_jpeg(rgb.numpy(), rows, columns)


def _aspect(job) -> float:
    """The output's width/height: as asked, else the (last) input's (the pipelines size from it), else
    square."""
    params, images = job.params, job.request.images
    if params.width and params.height:
        return params.width / params.height
    if images:
        width, height = images[-1].size
        return width / height
    return 1.0
