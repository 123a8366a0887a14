"""Write a random-weight Qwen image-edit checkpoint folder, fully offline.

    python -m imgedit.model.demo_checkpoint OUT_DIR [--kind plus|edit|21|21turbo|2511] [--seed 0]
                                            [--size tiny|real]

`tiny` (the default) is a 2-layer model of about a megabyte that runs an edit on a CPU in seconds:
the demo mode and the tests load it exactly like a real checkpoint. `real` writes the published
configs of the full model (60-block 20.4 B transformer, Qwen2.5-VL-7B text encoder, the real VAE)
with no weight files; `imgedit.runtime.loader` can materialise random weights for it directly on the GPUs,
for benchmarks (speed and memory do not depend on the weights' values).
The tokenizer is a byte-level BPE trained here on a few sentences, with Qwen's special tokens at
their real ids. `--kind 21` writes a Qwen-Image-2.1 checkpoint (QwenImage21Pipeline: a Qwen3-VL text
encoder with the processor holding the tokenizer, a single-stream transformer, a 16x RGBA VAE), its tiny
configs as diffusers' own tests of that pipeline build them. `--kind 21turbo` writes its Turbo (the folder
TURBO_MODEL_DIR names): the same checkpoint but for the transformer's weights (another seed, TURBO_SEED), a
scheduler without shifting and the distilled schedule in model_index.json (`sample_sigmas`).

Building needs torch, diffusers and transformers: they are imported inside the functions that build, so
that the inspection subprocess (imgedit.model.inspect imports ensure_checkpoint on every run) and
`--if-missing` on a checkpoint already built load none of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
FIRST_SPECIAL_ID = 151643
VOCAB_SIZE = 152064
PIPELINE_CLASS = {
    "edit": "QwenImageEditPipeline",
    "plus": "QwenImageEditPlusPipeline",
    "21": "QwenImage21Pipeline",
    "21turbo": "QwenImage21Pipeline",  # Qwen-Image-2.1-Turbo: 2.1's components, its own transformer weights
    "2511": "QwenImageEditPlusPipeline",  # 2511: 2509's pipeline, its transformer with zero_cond_t
}
# The Qwen chat template the 2.1 pipeline runs on its system message (it counts the tokens to drop by it, so
# it must lay messages out as the pipeline's hand-written prompt does).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n",
    "Picture 1: Picture 2: Picture 3: make the sky blue, "
    "add a cat, remove the text, turn it into a watercolor",
    "change the background to a beach at sunset and keep the person unchanged",
    "Comprehend and analyze the provided prompt.",
    "<|im_end|>\n<|im_start|>assistant\n",
)
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
    "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False,
}
# Qwen-Image-2.1-Turbo, as the task that added it describes the published checkpoint: 8 steps of this schedule
# (model_index.json's `sample_sigmas`), FlowMatchEuler with shift 1.0 and no dynamic shifting, CFG off. No
# shift_terminal: it would stretch the last sigma, and the distilled schedule runs as listed.
TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]
TURBO_SCHEDULER = {**SCHEDULER_CONFIG, "shift": 1.0, "use_dynamic_shifting": False, "shift_terminal": None}
TURBO_SEED = 1000  # the Turbo transformer's seed is the checkpoint's seed plus this (the rest: the seed)


def _configs(size: str) -> dict:
    if size == "tiny":
        return {
            # One attention head: every edit attends over the ~4,096 tokens of the 1 MP condition image, and
            # on the CPU that attention is most of a forward (3 heads: 0.20 CPU-s a forward, 1 head: 0.06).
            # Ulysses tests build theirs with more heads (`heads=`), as Ulysses splits heads.
            "transformer": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                attention_head_dim=16, num_attention_heads=1, joint_attention_dim=16,
                                guidance_embeds=False, axes_dims_rope=(8, 4, 4)),
            # 8x downsampling like the real VAE, so sizes and token counts follow the real rules. The
            # pipelines encode every input at about 1 MP whatever the output size, and that encode was the
            # suite's largest compute item. 8 channels at every level and no residual blocks (only the
            # in/out convolutions, the down/up-sampling and the mid block): a 1 MP encode takes 1.5 CPU-s,
            # a 512x512 decode 1.2 (base_dim 8, dim_mult 1-2-4-4 with one residual block each: 4.5 and
            # 2.8). Its images still follow the latents: two latent seeds differ by 5.4 levels on average
            # (17.5 before); with base_dim 4 they differed by 0.2, too little for tests that compare seeds
            # and LoRAs by pixels.
            "vae": dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=0,
                        temperal_downsample=[False, True, True],
                        latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
            "text_encoder": dict(
                text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE,
                             "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                              "type": "default"},
                             "rope_theta": 1000000.0},
                vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                               "out_hidden_size": 16, "fullatt_block_indexes": [1], "window_size": 112},
            ),
        }
    # The published configs of Qwen-Image-Edit(-2509): 20.4 B transformer, Qwen2.5-VL-7B, the real VAE.
    return {
        "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                            guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
        "vae": dict(),  # AutoencoderKLQwenImage's defaults are the released VAE
        "text_encoder": dict(
            text_config={"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                         "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": VOCAB_SIZE,
                         "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                         "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default",
                                          "type": "mrope"},
                         "rope_theta": 1000000.0},
            vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                           "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
                           "window_size": 112, "patch_size": 14, "spatial_merge_size": 2,
                           "temporal_patch_size": 2},
        ),
    }


# Qwen/Qwen-Image-2.1's published configs (model_index.json, transformer, text encoder, VAE, scheduler, the
# processor's image settings), byte for byte as the model repository has them at revision 790c9263 (their
# sizes and SHA-256 as public manifests of that revision list them); `--size real --kind 21` writes them.
PUBLISHED_21 = Path(__file__).parent / "published" / "qwen-image-2.1"


def _configs_21(size: str) -> dict:
    """Qwen-Image-2.1's components. Tiny: diffusers' tests of QwenImage21Pipeline (z_dim 8, not 4: the
    pipeline takes a condition image with as many channels as the latents for latents already, and RGBA has
    4), with one attention head. A vision token covers 32 pixels (patch 16, merge 2), the 2x2 latents of the
    16x VAE. Real: the published image processor's settings (the components' configs are copied as
    published)."""
    if size != "tiny":
        published = json.loads((PUBLISHED_21 / "processor" / "preprocessor_config.json").read_text())
        return {"image_processor": dict(
            patch_size=published["patch_size"], merge_size=published["merge_size"],
            temporal_patch_size=published["temporal_patch_size"],
            size=dict(shortest_edge=published["size"]["shortest_edge"],
                      longest_edge=published["size"]["longest_edge"]),
            image_mean=published["image_mean"], image_std=published["image_std"])}
    z_dim = 8
    return {
        "transformer": dict(patch_size=1, in_channels=z_dim, out_channels=z_dim, num_layers=2,
                            attention_head_dim=16, num_attention_heads=1, context_in_dim=16, mlp_ratio=2,
                            axes_dims_rope=(4, 6, 6)),
        "vae": dict(base_dim=4, decoder_base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                    attn_scales=[], temperal_downsample=[False, True, True, True],
                    latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim),
        "text_encoder": dict(
            text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                         "vocab_size": VOCAB_SIZE,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                             "mrope_section": [1, 1, 2]}},
            vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": 16, "patch_size": 16, "spatial_merge_size": 2,
                           "temporal_patch_size": 2, "num_position_embeddings": 64,
                           "deepstack_visual_indexes": [0]},
        ),
        # as published (processor/preprocessor_config.json: size 256² to 4096²): every input is resized to
        # output_resolution² before the processor, which lets it through unresized. `size`, not min_pixels /
        # max_pixels: transformers 5.17's Qwen2VLImageProcessorPil writes those into its class's own `size`
        # dict, so every processor made after it in the process (a Qwen2.5-VL checkpoint's) had 2.1's sizes
        "image_processor": dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                                size=dict(shortest_edge=256 * 256, longest_edge=4096 * 4096)),
    }


def _special_id(token: str) -> int:
    return FIRST_SPECIAL_ID + SPECIAL_TOKENS.index(token)


def _build_21(out: Path, seed: int, size: str, tokenizer, transformer_seed: int | None = None) -> None:
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel  # building only (docstring)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration  # building only (docstring)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # building only (docstring)
        Qwen2VLImageProcessorPil,
    )
    from transformers.utils import is_torchvision_available  # building only (docstring)

    cfg = _configs_21(size)
    image_processor = Qwen2VLImageProcessorPil(**cfg["image_processor"])
    if is_torchvision_available():
        from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor  # building only (docstring)

        video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=CHAT_TEMPLATE, video_processor=video_processor)
    else:
        from imgedit.model.processor import ImageOnlyQwen3Processor  # transformers: building only (docstring)

        processor = ImageOnlyQwen3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out / "processor")
    if size != "tiny":  # configs only: weights are materialised at load time (random_weights=True)
        for name in ("transformer", "text_encoder", "vae"):
            (out / name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PUBLISHED_21 / name / "config.json", out / name / "config.json")
        return
    te_config = Qwen3VLConfig(text_config=cfg["text_encoder"]["text_config"],
                              vision_config=cfg["text_encoder"]["vision_config"],
                              image_token_id=_special_id("<|image_pad|>"),
                              video_token_id=_special_id("<|video_pad|>"),
                              vision_start_token_id=_special_id("<|vision_start|>"),
                              vision_end_token_id=_special_id("<|vision_end|>"))
    _save_seeded(out, seed, {"vae": lambda: AutoencoderKLQwenImage21(**cfg["vae"]),
                             "text_encoder": lambda: Qwen3VLForConditionalGeneration(te_config)})
    _save_seeded(out, seed if transformer_seed is None else transformer_seed,
                 {"transformer": lambda: QwenImage21Transformer2DModel(**cfg["transformer"])})


def _save_seeded(out: Path, seed: int, builders: dict) -> None:
    """Each component built right after seeding (the same seed, the same weights) and saved in its folder."""
    import torch  # building only (docstring)

    for name, build in builders.items():
        torch.manual_seed(seed)
        build().save_pretrained(out / name)


def build_tokenizer():
    """A byte-level BPE trained on a few sentences, with Qwen's special tokens at their real ids."""
    from transformers import Qwen2Tokenizer  # building only (docstring)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    bpe.train_from_iterator(list(_CORPUS) * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({tok: FIRST_SPECIAL_ID + i for i, tok in enumerate(SPECIAL_TOKENS)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
                         special_tokens=True)
    return tokenizer


def _processor(tokenizer):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # building only (docstring)
        Qwen2VLImageProcessorPil,
    )
    from transformers.utils import is_torchvision_available  # building only (docstring)

    if is_torchvision_available():
        from transformers import Qwen2VLProcessor  # building only (docstring)
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import (  # building only (docstring)
            Qwen2VLVideoProcessor,
        )

        return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer,
                                video_processor=Qwen2VLVideoProcessor())
    from imgedit.model.processor import ImageOnlyProcessor  # transformers: building only (docstring)

    return ImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)


def text_encoder_config(size: str):
    from transformers import Qwen2_5_VLConfig  # building only (docstring)

    cfg = _configs(size)["text_encoder"]
    return Qwen2_5_VLConfig(
        text_config=cfg["text_config"], vision_config=cfg["vision_config"], vocab_size=VOCAB_SIZE,
        vision_start_token_id=FIRST_SPECIAL_ID + SPECIAL_TOKENS.index("<|vision_start|>"),
        vision_end_token_id=FIRST_SPECIAL_ID + SPECIAL_TOKENS.index("<|vision_end|>"),
        vision_token_id=FIRST_SPECIAL_ID + SPECIAL_TOKENS.index("<|vision_pad|>"),
        image_token_id=FIRST_SPECIAL_ID + SPECIAL_TOKENS.index("<|image_pad|>"),
        video_token_id=FIRST_SPECIAL_ID + SPECIAL_TOKENS.index("<|video_pad|>"),
    )


def build_checkpoint(out: str | Path, kind: str = "plus", seed: int = 0, size: str = "tiny",
                     heads: int | None = None) -> Path:
    """Write the checkpoint folder (model_index.json + one subfolder per component) and return it.
    `heads`: the transformer's attention heads, when not the size's own (Ulysses splits heads)."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # building only (docstring)

    if kind not in PIPELINE_CLASS:
        raise ValueError(f"kind must be one of {sorted(PIPELINE_CLASS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _configs(size)
    if heads is not None:
        cfg["transformer"]["num_attention_heads"] = heads
    if kind == "2511":  # Qwen-Image-Edit-2511's transformer config adds zero_cond_t (the rest is 2509's)
        cfg["transformer"]["zero_cond_t"] = True
    tokenizer = build_tokenizer()
    turbo = kind == "21turbo"
    FlowMatchEulerDiscreteScheduler(**(TURBO_SCHEDULER if turbo else SCHEDULER_CONFIG)).save_pretrained(
        out / "scheduler")  # 2.1's: the same as the edit models'
    if kind in ("21", "21turbo"):
        _build_21(out, seed, size, tokenizer, seed + TURBO_SEED if turbo else None)
    else:
        _build_edit(out, seed, size, tokenizer, cfg)
    index = INDEX if kind not in ("21", "21turbo") else {**INDEX_21,
                                                         "sample_sigmas": TURBO_SIGMAS if turbo else None}
    _write_json(out / "model_index.json", {
        "_class_name": PIPELINE_CLASS[kind], "_diffusers_version": "0.42.1", **index,
        "imgedit_demo": {"seed": seed, "size": size, "random_weights": size != "tiny"},
    })
    log.info("wrote %s %s checkpoint (seed %d) to %s", size, PIPELINE_CLASS[kind], seed, out)
    return out


# model_index.json's components: the edit pipelines' and Qwen-Image-2.1's (its processor holds the tokenizer)
INDEX = {"processor": ["transformers", "Qwen2VLProcessor"],
         "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
         "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
         "tokenizer": ["transformers", "Qwen2Tokenizer"],
         "transformer": ["diffusers", "QwenImageTransformer2DModel"],
         "vae": ["diffusers", "AutoencoderKLQwenImage"]}
INDEX_21 = {"processor": ["transformers", "Qwen3VLProcessor"], "sample_sigmas": None,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
            "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage21"]}


def _build_edit(out: Path, seed: int, size: str, tokenizer, cfg: dict) -> None:
    """The edit pipelines' components (Qwen2.5-VL, the 60-block transformer, the 8x VAE) and tokenizer."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel  # building only (docstring)
    from transformers import Qwen2_5_VLForConditionalGeneration  # building only (docstring)

    tokenizer.save_pretrained(out / "tokenizer")
    _processor(tokenizer).save_pretrained(out / "processor")
    te_config = text_encoder_config(size)
    if size == "tiny":
        _save_seeded(out, seed, {"transformer": lambda: QwenImageTransformer2DModel(**cfg["transformer"]),
                                 "vae": lambda: AutoencoderKLQwenImage(**cfg["vae"]),
                                 "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(te_config)})
    else:  # configs only: weights are materialised at load time (imgedit.runtime.loader, random_weights=True)
        _write_json(out / "transformer" / "config.json",
                    {"_class_name": "QwenImageTransformer2DModel", **_jsonable(cfg["transformer"])})
        _write_json(out / "vae" / "config.json", {"_class_name": "AutoencoderKLQwenImage", **cfg["vae"]})
        te_config.save_pretrained(out / "text_encoder")


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def ensure_checkpoint(out: str | Path, kind: str = "plus", seed: int = 0) -> Path:
    """Build the tiny checkpoint once; reuse it when model_index.json is already there."""
    out = Path(out).expanduser()
    if (out / "model_index.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build_checkpoint(tmp, kind=kind, seed=seed)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; use theirs
        pass
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--kind", choices=sorted(PIPELINE_CLASS), default="plus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--if-missing", action="store_true",
                        help="keep a checkpoint already at OUT "
                             "(the server's demo mode builds it this way, once)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.if_missing:
        ensure_checkpoint(args.out, kind=args.kind, seed=args.seed)
        return
    build_checkpoint(args.out, kind=args.kind, seed=args.seed, size=args.size)


if __name__ == "__main__":
    main()
