"""The demo checkpoint: offline, the real layout, reproducible from a seed, loadable like any checkpoint."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from conftest import ROOT

from imgedit.model.demo_checkpoint import FIRST_SPECIAL_ID, SPECIAL_TOKENS, build_checkpoint, build_tokenizer
from imgedit.runtime.loader import open_checkpoint


def digest(folder) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.safetensors"))}


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, plus_ckpt):
    again = build_checkpoint(tmp_path / "again", kind="plus", seed=0)
    other = build_checkpoint(tmp_path / "other", kind="plus", seed=1)
    assert digest(again) == digest(plus_ckpt)
    assert digest(other) != digest(plus_ckpt)


def test_layout_and_class_of_both_kinds(plus_ckpt, edit_ckpt):
    for folder, cls in ((plus_ckpt, "QwenImageEditPlusPipeline"), (edit_ckpt, "QwenImageEditPipeline")):
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == cls
        for sub in ("transformer", "text_encoder", "vae", "scheduler", "tokenizer", "processor"):
            assert (folder / sub).is_dir(), sub
        assert open_checkpoint(str(folder)).pipeline_class == cls


def test_tokenizer_has_qwens_special_tokens_at_their_real_ids():
    tokenizer = build_tokenizer()
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == FIRST_SPECIAL_ID + i
    ids = tokenizer("<|im_start|>user hi<|image_pad|><|im_end|>").input_ids
    assert ids[0] == FIRST_SPECIAL_ID + 1 and FIRST_SPECIAL_ID + 12 in ids


def test_module_command_writes_a_checkpoint(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "imgedit.model.demo_checkpoint", str(out), "--kind", "edit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "QwenImageEditPipeline"


def test_a_2511_checkpoint_is_2509s_with_zero_cond_t_and_edits(tmp_path):
    """`--kind 2511`: Qwen-Image-Edit-2511's transformer config adds zero_cond_t to 2509's (the Plus pipeline):
    the tiny one edits through a worker (the condition tokens at timestep 0), the real-size one's config says so
    (for the GPU machine's comparison with Qwen-Image-2.1)."""
    import numpy as np
    from conftest import make_manager, picture

    from imgedit.protocol import EditRequest

    tiny = build_checkpoint(tmp_path / "tiny", kind="2511")
    assert open_checkpoint(tiny).family == "plus"
    assert json.loads((tiny / "transformer" / "config.json").read_text())["zero_cond_t"] is True
    real = build_checkpoint(tmp_path / "real", kind="2511", size="real")
    config = json.loads((real / "transformer" / "config.json").read_text())
    assert config["zero_cond_t"] is True and config["num_layers"] == 60
    result = make_manager(tiny).edit(EditRequest(images=(picture(64, 64),), prompt="make it red", seed=2,
                                                 num_inference_steps=2, width=64, height=64))
    pixels = np.asarray(result.images[0], dtype=np.float64)
    assert result.images[0].size == (64, 64) and np.isfinite(pixels).all() and pixels.std() > 0


def test_a_2_1_checkpoint_built_first_leaves_a_later_edit_checkpoints_processor_its_own_sizes(tmp_path):
    """Building a Qwen-Image-2.1 checkpoint, then an edit model's, in one process: each processor keeps its own
    image sizes. (transformers 5.17's Qwen2VLImageProcessorPil(min_pixels=...) wrote them into its class's
    default `size`: the edit checkpoint got 2.1's 256² minimum, and its tiny encoder saw a 64² input at 280²,
    which broke tests/test_ground.py after tests/test_warmup.py in one process.)"""
    def sizes(ckpt):
        config = json.loads((ckpt / "processor" / "processor_config.json").read_text())["image_processor"]
        return config["size"]

    q21 = build_checkpoint(tmp_path / "q21", kind="21", seed=0)
    plus = build_checkpoint(tmp_path / "plus", kind="plus", seed=0)
    assert sizes(q21) == {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}
    assert sizes(plus) == {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}  # Qwen2-VL's own
