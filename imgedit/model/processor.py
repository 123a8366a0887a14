"""The Qwen-VL processors, built so that they also work where torchvision is missing.

In transformers 5.x `Qwen2VLProcessor` and `Qwen3VLProcessor` insist on a video processor, and that one
needs torchvision. The pipelines never pass videos, so where torchvision is absent we use the same
classes minus the video processor, with the PIL image processor (`ImageOnlyProcessor`,
`ImageOnlyQwen3Processor`). Where torchvision is present the stock processor loads as diffusers would
load it. The edit pipelines take a Qwen2-VL processor, Qwen-Image-2.1 a Qwen3-VL one (named by the
checkpoint's model_index.json).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2Tokenizer, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import is_torchvision_available

from imgedit.model.components import model_index


class ImageOnlyProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without the video half (its only difference)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyQwen3Processor(Qwen3VLProcessor):
    """Qwen3VLProcessor without the video half (its only difference)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def processor_class(checkpoint_folder: str | Path) -> str:
    """The processor class the checkpoint's model_index.json names (Qwen2VLProcessor, Qwen3VLProcessor)."""
    return model_index(checkpoint_folder).get("processor", [None, "Qwen2VLProcessor"])[1]


def load_processor(folder: str | Path, kind: str = "Qwen2VLProcessor"):
    """Load the checkpoint's `processor/` folder the best way this machine allows. `kind`: the class
    model_index.json names."""
    folder = Path(folder)
    qwen3 = kind == "Qwen3VLProcessor"
    if is_torchvision_available():
        return (Qwen3VLProcessor if qwen3 else Qwen2VLProcessor).from_pretrained(str(folder))
    template = folder / "chat_template.jinja"
    return (ImageOnlyQwen3Processor if qwen3 else ImageOnlyProcessor)(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(folder)),
        tokenizer=Qwen2Tokenizer.from_pretrained(str(folder)),
        chat_template=template.read_text() if template.is_file() else None,
    )
