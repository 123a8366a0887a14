"""The model families imgedit serves and what each one takes: the pipeline class a checkpoint's
model_index.json names, its input images, its defaults, how it sizes inputs and outputs, and the modes
built for it. Torch-free: the server's checks and the page read it as the workers do.

Read from diffusers 0.42.1's pipelines:
- `QwenImageEditPipeline` (Qwen-Image-Edit): one input image, 50 steps; the text encoder sees it at 1 MP.
- `QwenImageEditPlusPipeline` (-2509, -2511): 1-3 input images, 40 steps; the text encoder sees each at
  384x384, the VAE at 1 MP.
- `QwenImage21Pipeline` (Qwen-Image-2.1): 0-10 condition images (none: text to image), 40 steps, no CFG
  by default (`true_cfg_scale` 1); every condition image is resized to `output_resolution`² and converted
  to RGBA, the text encoder sees it composited over white, the VAE with its alpha; the VAE decodes RGBA.
  A 16x VAE and a patch of 1: output sides are multiples of 32.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    key: str  # "edit" | "plus" | "21": what /health and the page name
    pipeline_class: str
    model: str  # the checkpoints' names, as errors say them
    max_images: int
    min_images: int  # 0: text to image without an input image
    default_steps: int
    default_cfg: float | None  # None: DEFAULT_TRUE_CFG
    vl_area: int | None  # the area the text encoder sees each input at; None: the VAE's (output_resolution²)
    side_multiple: int  # the output's sides are rounded down to this
    images_as_list: bool  # the pipeline takes a list of images (else the first alone)
    rgba: bool  # the pipeline keeps an input's alpha and its VAE decodes RGBA
    output_resolution: int | None = None  # QwenImage21Pipeline's default side for inputs and outputs
    # The least output_resolution. The published processor enlarges an image under 65,536 pixels (256²;
    # size.shortest_edge) and its vision tokens then outnumber the input's latents (the transformer fails:
    # "shape mismatch"); the pipeline's rounding of the sides to 32 takes a 256² area under that (40x48 at
    # 256²: 224x288 = 64,512), so 320 (102,400, 1.56x) leaves room for any aspect the inputs may have.
    min_resolution: int = 320
    # QUANTIZE_SKIP=auto: the transformer's submodules that stay bf16 when it is
    # quantized. The edit models keep img_mlp (the image stream's MLP; cosine 0.986-0.990
    # vs bf16 with it kept, BENCHMARKS); in Qwen-Image-2.1's single-stream blocks img_mlp
    # is every token's MLP, most of the weights: keeping it would save little
    quantize_skip: tuple[str, ...] = ("img_mlp",)
    # How a group of GPUs (DEVICE_MAP=ulysses) splits one forward: "ulysses", diffusers' context parallelism
    # (the sequence, then the heads around each attention); "target", the target image's tokens split and
    # the keys and values gathered (imgedit.runtime.split21: 2.1's transformer has no context-parallel plan)
    split: str = "ulysses"
    # modes not built for this family, with why (a setting or request asking for one is refused with it)
    not_built: dict[str, str] = field(default_factory=dict)

    def cfg(self, default_true_cfg: float) -> float:
        """The CFG scale a request without one runs at: the family's own, else DEFAULT_TRUE_CFG."""
        return default_true_cfg if self.default_cfg is None else self.default_cfg

    @property
    def inputs_label(self) -> str:
        """How the page's input box says what this model takes."""
        if self.generates:
            return f"Input images (up to {self.max_images}; none: an image from the prompt alone)"
        count = "1" if self.max_images == 1 else f"1 to {self.max_images}"
        return f"Input images ({count} for {self.model})"

    @property
    def generates(self) -> bool:
        """Whether a request without an input image makes an image from the prompt alone."""
        return self.min_images == 0


_21_NOT_BUILT = {
    "cfg-parallel": "Qwen-Image-2.1 runs without CFG by default and its cached condition keys are per "
                    "branch; CFG-parallel pairs are not built for it yet",
    "cache": "Qwen-Image-2.1 already caches the text and condition keys after the first step; "
             "the step caches are not built for its transformer",
    "lightning": "there is no Lightning LoRA for Qwen-Image-2.1",
    "batch_cfg": "BATCH_CFG batches Qwen-Image-Edit's two CFG branches; Qwen-Image-2.1 runs without CFG",
}

FAMILIES = {
    "edit": Family("edit", "QwenImageEditPipeline", "Qwen-Image-Edit",
                   max_images=1, min_images=1, default_steps=50, default_cfg=None,
                   vl_area=1024 * 1024, side_multiple=16, images_as_list=False, rgba=False),
    "plus": Family("plus", "QwenImageEditPlusPipeline", "Qwen-Image-Edit-2509/2511",
                   max_images=3, min_images=1, default_steps=40, default_cfg=None,
                   vl_area=384 * 384, side_multiple=16, images_as_list=True, rgba=False),
    "21": Family("21", "QwenImage21Pipeline", "Qwen-Image-2.1",
                 max_images=10, min_images=0, default_steps=40, default_cfg=1.0,
                 vl_area=None, side_multiple=32, images_as_list=True, rgba=True,
                 output_resolution=1024, quantize_skip=(), not_built=_21_NOT_BUILT, split="target"),
}
BY_PIPELINE = {f.pipeline_class: f for f in FAMILIES.values()}


def not_built(key: str, mode: str) -> str | None:
    """Why `mode` is not built for family `key`, or None."""
    return FAMILIES[key].not_built.get(mode)
