"""The Qwen2-VL processor, built so that it also works where torchvision is missing.

In transformers 5.x `Qwen2VLProcessor` insists on a video processor, and that one needs torchvision.
The edit pipelines never pass videos, so where torchvision is absent we use `ImageOnlyProcessor`: the
same class minus the video processor, with the PIL image processor. Where torchvision is present the
stock processor loads as diffusers would load it.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2Tokenizer, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import is_torchvision_available


class ImageOnlyProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without the video half (its only difference)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: str | Path) -> Qwen2VLProcessor:
    """Load the checkpoint's `processor/` folder the best way this machine allows."""
    folder = str(folder)
    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(folder)
    return ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=Qwen2Tokenizer.from_pretrained(folder),
    )
