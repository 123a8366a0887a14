"""Masked editing on the unmodified diffusers pipelines (Edit, 2509, 2511, 2.1): the model edits the whole
canvas, and after every denoising step the latents outside the mask are put back to the input's own
latents, noised to that step's level (as diffusers' inpaint pipelines blend, in a step callback). The
last step has no noise left, so outside the mask the latents are the input's. The decoded result is
then scaled to the first image's size and laid over it through the (grown, feathered) mask, so that
outside the mask every pixel is the input's, exactly.

Why not diffusers' QwenImageEditInpaintPipeline: there is none for the Plus pipelines (2509/2511),
and it would be a second pipeline object around the same weights; a callback on the pipeline the
worker already runs serves all three checkpoints, every placement and the LoRAs alike.

Qwen-Image-2.1 packs its latents differently (a 16x VAE, one token per latent pixel, no 2x2 packing) and its
VAE takes and gives RGBA: the input is encoded with its alpha and the composite keeps the alpha of both.

`strength` below 1 keeps the masked area at the noised input for the first (1 - strength) of the
steps, so the edit starts from the input there instead of from noise (those steps still run).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from PIL import Image, ImageFilter

from imgedit.model import internals
from imgedit.planning.families import FAMILIES

LATENT_CELL = 16  # pixels per latent token: the VAE's 8x and the 2x2 packing (Qwen-Image-2.1: its 16x VAE)


class Masking:
    """The per-job feature (imgedit.runtime.runner.Call): a job with a mask blends its latents at every step
    and lays the result over its first image."""

    def __init__(self, pipe):
        self.pipe = pipe

    @contextmanager
    def job(self, call):
        req, params = call.job.request, call.job.params
        if req.mask is not None:
            with torch.inference_mode():
                masked = MaskedEdit(self.pipe, req.images[0], req.mask, params.width, params.height,
                                    params.mask_grow, params.mask_feather, params.strength, params.steps,
                                    params.image_seeds, rgba=FAMILIES[call.job.family].rgba)
            call.step_hooks.append(lambda step, tensors: {"latents": masked.blend(step, tensors["latents"])})
            call.tensor_inputs.append("latents")
            call.finish.append(masked.composite)  # the first image's size, its own pixels outside the mask
        yield


class MaskedEdit:
    def __init__(self, pipe, first: Image.Image, mask: Image.Image, width: int, height: int,
                 grow: int, feather: int, strength: float, steps: int, seeds: tuple[int, ...],
                 rgba: bool = False):
        self.pipe, self.rgba = pipe, rgba  # rgba: the VAE takes and gives RGBA (Qwen-Image-2.1)
        self.mode = "RGBA" if rgba else "RGB"
        self.first = first.convert(self.mode)
        self.width, self.height = width, height
        self.area = grown(mask, grow)  # the first image's size, 255 = edit
        self.feather = feather
        self.hold_steps = int(round(steps * (1.0 - strength)))  # steps the masked area stays the input
        device, dtype = internals.execution_device(pipe), pipe.transformer.dtype
        self.original = self._encode(self.first.resize((width, height), Image.LANCZOS)).to(device, dtype)
        cells = self.area.resize((width, height), Image.BILINEAR).resize(
            (width // LATENT_CELL, height // LATENT_CELL), Image.BOX)
        # any marked pixel: the token may change
        edit = torch.from_numpy(np.asarray(cells) > 0).reshape(1, -1, 1)
        self.keep = (~edit).to(device, dtype)
        # One noise per output image, from its own seed (CPU: the same on every device and rank).
        self.noise = torch.cat([
            torch.randn(self.original.shape, generator=torch.Generator("cpu").manual_seed(seed))
            for seed in seeds
        ]).to(device, dtype)

    def _encode(self, image: Image.Image) -> torch.Tensor:
        """The image's latents as the pipeline packs them: (1, tokens, channels x 4), or (1, tokens, channels)
        for Qwen-Image-2.1."""
        pipe = self.pipe
        pixels = pipe.image_processor.preprocess(image, self.height, self.width).unsqueeze(2)
        pixels = pixels.to(internals.execution_device(pipe), pipe.vae.dtype)
        # normalised (latents_mean/std): (1, C, 1, h, w)
        latents = internals.encode_vae_image(pipe, pixels)
        return internals.pack_latents(pipe, latents)

    def blend(self, step: int, latents: torch.Tensor) -> torch.Tensor:
        """The latents after step `step` (0-based) with the area outside the mask set to the input at
        this step's noise level (and, during the first hold steps, the masked area too)."""
        sigma = float(self.pipe.scheduler.sigmas[step + 1])
        batch = latents.shape[0]
        noise = self.noise if batch == self.noise.shape[0] else self.noise[:1].expand(batch, -1, -1)
        noised = (1.0 - sigma) * self.original + sigma * noise
        keep = torch.ones_like(self.keep) if step < self.hold_steps else self.keep
        return keep * noised + (1.0 - keep) * latents

    def composite(self, images: list[Image.Image]) -> list[Image.Image]:
        """Each result scaled to the first image's size and laid over it through the feathered mask."""
        alpha = feathered(self.area, self.feather)
        out = []
        for image in images:
            edited = image.convert(self.mode).resize(self.first.size, Image.LANCZOS)
            out.append(Image.composite(edited, self.first, alpha))
        return out


def grown(mask: Image.Image, pixels: int) -> Image.Image:
    if pixels <= 0:
        return mask
    # A max filter of the mask's distance: repeated small filters (Pillow's MaxFilter is O(size^2)).
    out = mask
    left = pixels
    while left > 0:
        step = min(left, 8)
        out = out.filter(ImageFilter.MaxFilter(2 * step + 1))
        left -= step
    return out


def feathered(mask: Image.Image, pixels: int) -> Image.Image:
    """A soft edge inside the mask: 0 outside it (the input's pixels exactly), rising to 255 within
    `pixels` of its border."""
    if pixels <= 0:
        return mask
    blurred = np.asarray(mask.filter(ImageFilter.BoxBlur(pixels)), dtype=np.float32)
    # Inside the mask the blur gives 128..255 near the edge: stretch that to 0..255, and keep 0 outside.
    soft = np.clip((blurred - 127.5) * 2.0, 0, 255)
    soft[np.asarray(mask) == 0] = 0
    return Image.fromarray(soft.round().astype(np.uint8), mode="L")
