"""Pictures to and from the GPU as bytes: the pipeline's
pre- and postprocessing with the arithmetic on the GPU.

diffusers' `VaeImageProcessor` turns each input picture into floats on the CPU (`np.array(image) / 255`, then
`2x - 1`) and each output back the same way (`.cpu().float().numpy()`, then `(x * 255).round()`). At 1024x1024
that is 12 M floats each way on the worker's CPU, and the worker's CPU is also the one launching the GPU's
kernels: measured on a 2x H100 host (benchmarks/bench_outside.py, 2026-11-27), preprocessing took 15-70 ms and
postprocessing 20-30 ms of a 4-step edit's ~0.28 s outside the loop, more on a pair, whose two ranks do it at
the same time. Here the bytes cross instead (3 MB, not 12 MB as float32), and the arithmetic runs on the GPU.

Exact, not close: an input byte becomes the float the processor's own `pil_to_numpy`/`normalize` make of it
(a 256-entry table computed by those functions, then indexed on the GPU), and an output becomes
the byte of the same float32 operations in the same order (`denormalize`, `.float()`, `* 255`,
`.round()`; elementwise IEEE operations, one kernel each, give the same result on either
device). Tests pin both against the processor's own methods. Anything but the pipelines' plain
call (PIL pictures in; 'pil' out; a processor configured otherwise; a picture that is not RGB;
a VAE that is not wholly on one GPU, as when offloaded) takes the processor's own path.
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch

from imgedit.model import internals


class Pixels:
    def __init__(self, processor, device: torch.device):
        self.processor = processor
        self.device = device
        self.preprocess = processor.preprocess  # the processor's own methods, for what this does not take
        self.postprocess = processor.postprocess
        ramp = PIL.Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16)).convert("RGB")
        floats = processor.numpy_to_pt(processor.pil_to_numpy([ramp]))  # (1, 3, 16, 16): byte b at pixel b
        if processor.config.do_normalize:
            floats = processor.normalize(floats)
        self.table = floats[0, 0].reshape(256).to(device)

    def _plain_input(self, image, crops_coords, resize_mode) -> bool:
        config = self.processor.config
        pictures = image if isinstance(image, list) else [image]
        return (crops_coords is None and resize_mode == "default" and config.do_resize
                and not config.do_convert_grayscale and not config.do_binarize and len(pictures) > 0
                and all(isinstance(p, PIL.Image.Image) and (p.mode == "RGB" or config.do_convert_rgb)
                        for p in pictures))

    def to_tensor(self, image, height=None, width=None, resize_mode="default",
                  crops_coords=None) -> torch.Tensor:
        """`preprocess` for PIL pictures: resized and converted by the processor, made floats on the GPU."""
        if not self._plain_input(image, crops_coords, resize_mode):
            return self.preprocess(image, height, width, resize_mode=resize_mode, crops_coords=crops_coords)
        processor = self.processor
        pictures = image if isinstance(image, list) else [image]
        height, width = processor.get_default_height_width(pictures[0], height, width)
        pictures = [processor.resize(p, height, width) for p in pictures]
        if processor.config.do_convert_rgb:
            pictures = [processor.convert_to_rgb(p) for p in pictures]
        # (n, h, w, 3) bytes
        data = torch.from_numpy(np.stack([np.asarray(p) for p in pictures])).to(self.device)
        floats = self.table.index_select(0, data.reshape(-1).int()).view(data.shape)
        return floats.permute(0, 3, 1, 2)  # the processor's own layout: its numpy transpose's strides

    def to_pictures(self, image: torch.Tensor, output_type: str = "pil", do_denormalize=None):
        """`postprocess` to 'pil': the float-to-byte arithmetic on the GPU, only the bytes copied back."""
        if (output_type != "pil" or not isinstance(image, torch.Tensor) or image.device != self.device
                or image.ndim != 4 or image.shape[1] != 3):
            return self.postprocess(image, output_type=output_type, do_denormalize=do_denormalize)
        image = internals.denormalize_conditionally(self.processor, image, do_denormalize)
        data = (image.float() * 255).round_().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return [PIL.Image.fromarray(picture) for picture in data]


def vae_device(vae) -> torch.device | None:
    """The one GPU holding every VAE weight, or None (on the CPU, offloaded, or spread)."""
    devices = {p.device for p in vae.parameters()}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    return device if device.type == "cuda" else None


def install(pipe, device: torch.device | None = None) -> Pixels | None:
    """Route the pipeline's pre- and postprocessing through `Pixels` where its VAE sits on one GPU (`device`
    overrides: the tests run it on the CPU). Returns it, or None where the processor's own path stays."""
    device = device if device is not None else vae_device(pipe.vae)
    processor = getattr(pipe, "image_processor", None)
    if device is None or processor is None or not hasattr(processor, "pil_to_numpy"):
        return None
    pixels = Pixels(processor, device)
    processor.preprocess, processor.postprocess = pixels.to_tensor, pixels.to_pictures
    return pixels
