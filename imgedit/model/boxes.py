"""What the Qwen vision-language encoders answer when asked to outline something (`mask_prompt`): the question
in their chat format, the boxes read from the answer, and the boxes as an edit mask. Pure: no torch.

Both encoders ground objects as JSON boxes `{"bbox_2d": [x1, y1, x2, y2], "label": ...}`, in different
coordinates:
- Qwen2.5-VL (the edit models' encoder) answers in absolute pixels of the image as its processor resized it
  (QwenLM/Qwen2.5-VL `cookbooks/spatial_understanding.ipynb` scales the boxes by `smart_resize`'s
  input_width/input_height; roboflow/supervision's `from_qwen_2_5_vl(result, input_wh, resolution_wh)` the
  same);
- Qwen3-VL (Qwen-Image-2.1's) answers in coordinates normalised to 0-1000 whatever the image's size
  (QwenLM/Qwen3-VL `qwen-vl-finetune` grounding data: "relative coordinates, 0-1000"; supervision's
  `from_qwen_3_vl` takes `resolution_wh=(1000, 1000)`).
The answer is read leniently (fenced or not, several blocks, trailing words, an answer cut at its token
limit keeps the boxes it finished): every `bbox_2d` with four numbers is a box; the rest is ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

QUESTION = ('Locate every "{phrase}" in the image and output the bounding boxes in JSON format: '
            '[{{"bbox_2d": [x1, y1, x2, y2], "label": "..."}}]')
MAX_BOXES = 64  # more than any sensible answer: a model that repeats itself stops counting here
NORMALISED = 1000  # Qwen3-VL's coordinate range
_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
# "bbox_2d": [x1, y1, x2, y2] (quoted either way, or bare), four numbers
_BOX = re.compile(r"""["']?bbox_2d["']?\s*:\s*\[""" + ",".join([_NUMBER] * 4) + r"\]")


# Both encoders begin a grounding answer with its JSON (```json [{"bbox_2d": ...: about ten tokens); an answer
# that has begun no box by this many tokens will not hold one, and is given up (random weights write nonsense
# to the token limit: the demo's refusal came after 256 tokens, 6-11 s on a CPU, instead of this many).
BOX_WITHIN = 48


class NoBoxBegun:
    """A generate() stopping criterion: stop once BOX_WITHIN new tokens have been written without a box begun
    (`bbox` nowhere in them). Decodes once, at that token; a trained model's answer has begun its boxes by
    then and runs on to its own end. (The answer to generate() is a tensor made from its own input's: no torch
    import here.)"""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.start: int | None = None
        self.give_up = False

    def __call__(self, input_ids, scores, **kwargs):
        if self.start is None:  # the first call comes after the first new token
            self.start = input_ids.shape[1] - 1
        if input_ids.shape[1] - self.start == BOX_WITHIN:
            self.give_up = "bbox" not in self.tokenizer.decode(input_ids[0, self.start:].tolist())
        return input_ids.new_full((input_ids.shape[0],), int(self.give_up)).bool()


@dataclass(frozen=True)
class Outline:
    """The boxes found, in the image's own pixels (x1, y1, x2, y2; half-open), and their union as a mask."""

    boxes: tuple[tuple[int, int, int, int], ...]
    mask: Image.Image  # "L", the image's size, 255 = inside a box


def question(phrase: str) -> str:
    return QUESTION.format(phrase=phrase)


def frame(model_type: str, input_size: tuple[int, int]) -> tuple[float, float]:
    """The width and height the encoder's coordinates span: 1000 x 1000 for Qwen3-VL, the image as its
    processor resized it for Qwen2.5-VL (and any other: absolute is the older convention)."""
    if model_type.startswith("qwen3"):
        return float(NORMALISED), float(NORMALISED)
    return float(input_size[0]), float(input_size[1])


def read_boxes(answer: str) -> list[tuple[float, float, float, float]]:
    """Every box in the answer as the model wrote it (its own coordinates), in order, at most MAX_BOXES."""
    return [tuple(float(v) for v in m.groups()) for m in _BOX.finditer(answer)][:MAX_BOXES]


def outline(answer: str, frame_size: tuple[float, float], image_size: tuple[int, int]) -> Outline | None:
    """The answer's boxes scaled from the model's `frame_size` to the image's pixels (corners in any order,
    clipped to the image; a box with no area inside it dropped), or None when no usable box is left."""
    width, height = image_size
    sx, sy = width / frame_size[0], height / frame_size[1]
    boxes = []
    for x1, y1, x2, y2 in read_boxes(answer):
        left, right = sorted((x1 * sx, x2 * sx))
        top, bottom = sorted((y1 * sy, y2 * sy))
        # outward to whole pixels (the object stays inside), then into the image
        box = (max(0, math.floor(left)), max(0, math.floor(top)),
               min(width, math.ceil(right)), min(height, math.ceil(bottom)))
        if box[2] > box[0] and box[3] > box[1] and box not in boxes:
            boxes.append(box)
    if not boxes:
        return None
    return Outline(tuple(boxes), boxes_mask(boxes, image_size))


def boxes_mask(boxes, size: tuple[int, int]) -> Image.Image:
    """The union of the boxes (pixels, half-open) as an edit mask: "L", 255 inside, 0 outside."""
    area = np.zeros((size[1], size[0]), np.uint8)
    for x1, y1, x2, y2 in boxes:
        area[y1:y2, x1:x2] = 255
    return Image.fromarray(area, mode="L")


def nothing_found(phrase: str) -> str:
    """The refusal when the answer has no usable box, in the caller's words."""
    return (f'mask_prompt "{phrase}": the model found nothing it could outline in the first image; '
            "draw the mask instead, or try other words")
