"""The VAE's decode on a GPU with little room: in tiles (diffusers' `enable_tiling`) for a job whose whole
decode would not fit under the cap.

A VAE decodes the output at full resolution in one pass, and its largest activations are the decoder's widest
feature maps at every pixel, upcast to float32 by its RMS norms. Measured (bf16, one 1024x1024 image, the peak
over the weights, on the CPU: benchmarks/probe_vae_decode.py): Qwen-Image's VAE (decoder base dim 96) 3.88
GiB, Qwen-Image-2.1's (144) 5.77 GiB: ~41 MiB per decoder channel per megapixel, times the images decoded
together. Tiled (256-pixel tiles, diffusers' defaults), 2.1's took 0.13 GiB. The encoder's peak is a quarter
of the decoder's (2.1: 1.47 GiB a megapixel) and the pipelines encode one input at a time: it stays whole.

On the GPU machine's 16 GB plan for 2.1 (a 13.5 GiB allocator cap, 6 GiB of weights) most jobs ran out of
memory in the decode, with 11.7 GiB allocated and 1.2-2 GiB reserved but unallocated (fragments).

A worker whose GPU has a cap (MAX_MEMORY) decides at every step's end, when what the decode will share the GPU
with is allocated (resident weights, 2.1's prefix cache, the latents) and the step's activations are not: the
decode is tiled where its estimate, with a fifth more and 0.75 GiB for fragments, is more than the cap leaves.
Tiles overlap and are blended, so a tiled image is not bit-identical to a whole decode: only where needed, and
the worker logs it. Uncapped workers decode whole.

The tiles are the largest of TILE_SIDES that fits what is left (each tile's decode estimated as a whole decode
of its size), overlapping by diffusers' 64 pixels: on the GPU machine's 16 GB plan for 2.1 with QUANTIZE=fp8
(6 GiB left) diffusers' default 256-pixel tiles made a 1024² decode 0.84 s against 0.15 s whole (36 tiles,
each seam blended a pixel row at a time); 768-pixel tiles fit there (4 tiles).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

log = logging.getLogger(__name__)

BYTES_PER_CHANNEL_MEGAPIXEL = 41 * 2**20
FRAGMENTS = int(0.75 * 2**30)
TILE_SIDES = (1024, 768, 512, 384, 256)  # pixels; minus OVERLAP each is a multiple of the VAE's 16
OVERLAP = 64  # diffusers' default: 256-pixel tiles every 192 pixels


def decode_bytes(vae_config, width: int, height: int, images: int) -> int:
    """The estimated peak of decoding `images` outputs of width x height at once, over the VAE's weights."""
    channels = getattr(vae_config, "decoder_base_dim", None) or vae_config.base_dim
    return int(BYTES_PER_CHANNEL_MEGAPIXEL * channels * width * height / 2**20 * images)


class DecodeRoom:
    """Tiles a job's decode when it would not fit. `room()` gives the bytes the allocator may still take
    (the worker passes imgedit.runtime.fusion.gpu_room, under the cap)."""

    def __init__(self, vae, room):
        self.vae = vae
        self.room = room
        self.logged = False

    def decide(self, width: int, height: int, images: int) -> bool:
        need = decode_bytes(self.vae.config, width, height, images)
        room = self.room()
        tile = need * 1.2 + FRAGMENTS > room
        if tile:
            side = self.tile_side(room, images)
            self.vae.enable_tiling(side, side, side - OVERLAP, side - OVERLAP)
            if not self.logged:
                log.info("VAE decode in %d-pixel tiles for this job: %d image(s) at %dx%d need ~%.1f GiB "
                         "whole, %.1f GiB left under the cap", side, images, width, height, need / 2**30,
                         max(room, 0) / 2**30)
                self.logged = True
        elif self.vae.use_tiling:
            self.vae.disable_tiling()
        return tile

    def tile_side(self, room: int, images: int) -> int:
        """The largest tile whose decode fits `room` (the smallest where none does)."""
        for side in TILE_SIDES:
            if decode_bytes(self.vae.config, side, side, images) * 1.2 + FRAGMENTS <= room:
                return side
        return TILE_SIDES[-1]

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): decided at every step's end, undone after it."""
        params = call.job.params

        # at a step's end what the decode will share the GPU with is allocated, the step's activations are not
        def decide(step: int, tensors: dict) -> None:
            self.decide(params.width, params.height, params.num_images)

        call.step_hooks.append(decide)
        try:
            yield
        finally:
            self.end()

    def end(self) -> None:
        """After every job: the next one decides again."""
        self.logged = False
        if self.vae.use_tiling:
            self.vae.disable_tiling()
