"""Select what to edit by words (`mask_prompt`): the pipeline's own text encoder (Qwen2.5-VL, or
Qwen-Image-2.1's Qwen3-VL) is asked, in its chat format, to box every "<phrase>" in the first image; the boxes
it answers (imgedit.model.boxes) become the edit's mask. Runs in the worker, on the weights already loaded,
with the rewrite's generate call (imgedit.runtime.enhance.generate: greedy, a token limit, cancel at any
token).

No usable box (the demo's random weights never write one) is an InvalidInput naming `mask_prompt`: the
caller is told plainly and nothing else happens (no image is made, the worker serves on).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from PIL import Image

from imgedit.errors import InvalidInput
from imgedit.model import boxes
from imgedit.runtime import enhance

log = logging.getLogger(__name__)

# The picture the encoder boxes in: more pixels than a rewrite's (384²) so that small things can be found,
# at most the image's own (a small image is not blown up); ~1,340 vision tokens at 1024² on Qwen2.5-VL.
OUTLINE_AREA = 1024 * 1024
_CHAT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
         "<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n")


@dataclass(frozen=True)
class Found:
    outline: boxes.Outline
    answer: str
    new_tokens: int
    seconds: float


def outline(pipe, image: Image.Image, phrase: str, max_new_tokens: int, cancel: threading.Event) -> Found:
    """The boxes the text encoder draws around `phrase` in `image`, as a mask of the image's size. Raises
    InvalidInput (mask_prompt) when its answer has no usable box, Cancelled when cancelled."""
    started = time.perf_counter()
    cell = enhance.merged_cell(pipe.processor)
    area = min(OUTLINE_AREA, image.width * image.height)
    said = enhance.generate(pipe, _CHAT.format(question=boxes.question(phrase)),
                            [enhance.view(image, cell, area)], max_new_tokens, cancel, "outline",
                            stop=boxes.NoBoxBegun(pipe.processor.tokenizer))
    model_type = str(getattr(pipe.text_encoder.config, "model_type", ""))
    found = boxes.outline(said.text, boxes.frame(model_type, said.seen[0]), image.size)
    seconds = time.perf_counter() - started
    log.info("outline of %r: %d token(s) in %.2fs, %s", phrase, len(said.token_ids), seconds,
             f"{len(found.boxes)} box(es)" if found else f"no usable box in {said.text[:200]!r}")
    if found is None:
        raise InvalidInput(boxes.nothing_found(phrase), "mask_prompt")
    return Found(found, said.text, len(said.token_ids), seconds)

