"""What the forkserver imports once, before it forks any worker (WORKER_START=forkserver): torch,
transformers with the Qwen2.5-VL text encoder, diffusers, accelerate and torchao. Each worker is a
fork of that process and skips those imports (about 6 of the ~9 s of CPU a spawned worker spends
importing on the 2-core machine); it imports the rest (diffusers' Qwen models and pipelines, peft, our
worker code) itself, except on a machine without GPUs, where the forkserver imports those too.

Nothing here may initialise CUDA: a process forked after that cannot use the GPU ("Cannot
re-initialize CUDA in forked subprocess"). Measured on the GPU machine (H100, 2026-11-24): importing
torch, transformers, diffusers, accelerate or torchao alone leaves a fork able to use CUDA; importing
peft (which diffusers' model classes and pipelines import) does not. Yet with this preload a forked
worker still failed there, cause not found yet: WORKER_START defaults to spawn, and only the CPU
test suite forks its workers (tests/conftest.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() through NVML, not the driver
# what runtime.worker.prepare_process sets for a spawned worker; a fork inherits torch's config from here
os.environ.setdefault("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO", "0")

import accelerate  # noqa: E402,F401
import diffusers  # noqa: E402,F401
import torch  # noqa: E402,F401
import torchao  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor  # noqa: E402,F401

if torch.cuda.is_available():  # (through NVML: CUDA itself stays uninitialised)
    assert "peft" not in __import__("sys").modules, (
        "peft breaks CUDA in forked workers: not in the forkserver")
else:
    # no GPU to break: the rest of what a worker imports, once (~0.6 CPU-s a forked worker on the
    # 2-core machine)
    import peft  # noqa: F401
    from diffusers import (  # noqa: F401
        AutoencoderKLQwenImage,
        AutoencoderKLQwenImage21,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )

    import imgedit.model.encoding  # noqa: F401
    import imgedit.runtime.adapters  # noqa: F401
    import imgedit.runtime.encode_cache  # noqa: F401
    import imgedit.runtime.loader  # noqa: F401
    import imgedit.runtime.phases  # noqa: F401
    import imgedit.runtime.runner  # noqa: F401
    import imgedit.runtime.worker  # noqa: F401
