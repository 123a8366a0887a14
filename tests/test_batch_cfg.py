"""BATCH_CFG: both true-CFG branches in one transformer forward of batch 2 (imgedit.runtime.cfg_batch).

The runner runs real edits on its own tiny pipeline in this process, with and without batching,
and the transformer's forwards are counted at its output layer. One worker process checks the
setting's way from the environment to the worker, and the planner tests are in test_quant.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import LocalPipeline, make_manager, picture

from imgedit.config.settings import load_settings
from imgedit.engine.validation import resolve
from imgedit.errors import Cancelled, ImgEditError, SettingsError
from imgedit.model.demo_checkpoint import build_checkpoint
from imgedit.protocol import EditRequest
from imgedit.runtime.cfg_batch import CfgBatch
from imgedit.runtime.messages import Job
from imgedit.runtime.runner import Runner

LONG_NEGATIVE = "blurry, low quality, washed out colours, jpeg artefacts, text, watermark, extra fingers"


class Local:
    """One fresh tiny pipeline (the batching forward stays installed on it) and two runners."""

    def __init__(self, ckpt, batched: bool = True):
        self.pipe = LocalPipeline(ckpt).pipe
        self.settings = load_settings({"QWEN_MODEL_DIR": str(ckpt)})
        self.plain = Runner(self.pipe, "plain", ("cpu",))
        self.batched = None
        if batched:
            self.batched = Runner(self.pipe, "batched", ("cpu",), parts=(CfgBatch(self.pipe.transformer),))
        self.forwards: list[int] = []  # batch size of every transformer forward (at its output layer)
        self.pipe.transformer.proj_out.register_forward_hook(
            lambda module, args, out: self.forwards.append(out.shape[0]))

    def run(self, runner, cancel=None, on_step=None, **kw) -> np.ndarray:
        ask = dict(images=(picture(),), prompt="make the sky a warm orange sunset", seed=5,
                   num_inference_steps=2, width=64, height=64, negative_prompt=" ")
        req = EditRequest(**{**ask, **kw})
        params = resolve(req, self.settings, "plus", req.images[-1].size, len(req.images))
        self.forwards.clear()
        result = runner.run(Job(req, params, "plus"), cancel or threading.Event(), on_step)
        return np.stack([np.asarray(image, dtype=np.int16) for image in result.images])


@pytest.fixture(scope="module")
def local(plus_ckpt):
    return Local(plus_ckpt)


@pytest.mark.parametrize("kw", [
    {},  # the prompt is longer than the negative prompt: the negative one is padded and masked
    {"negative_prompt": LONG_NEGATIVE},  # the other way round
    {"prompt": "x", "negative_prompt": "y"},  # the same length: no padding, no mask
    {"num_images": 2},  # two images per prompt: a batch of 4
])
def test_one_forward_per_step_gives_the_same_image(local, kw):
    plain = local.run(local.plain, **kw)
    images = plain.shape[0]
    assert local.forwards == [images] * 4  # 2 steps x (cond, uncond)
    batched = local.run(local.batched, **kw)
    assert local.forwards == [2 * images] * 2  # one forward per step, both branches in it
    assert batched.shape == plain.shape
    # float32 on the CPU: a batch of two and a masked attention round differently, nothing more
    assert np.abs(batched - plain).max() <= 1, np.abs(batched - plain).max()
    if not kw:  # the bound can fail: another seed moves the pixels far more than that
        assert np.abs(plain - local.run(local.plain, seed=6)).mean() > 1


def test_2511s_two_images_per_prompt_batch_with_its_condition_index(tmp_path):
    """Qwen-Image-Edit-2511 (zero_cond_t) builds a per-sample index of its condition tokens from
    `img_shapes`, which the pipeline gives once per prompt, not per image: with n=2 the merged forward
    must give it once per sample of its batch of 4 (found on the GPU machine: a 500 on the 24 GB plan)."""
    local = Local(build_checkpoint(tmp_path / "2511", kind="2511"))
    plain = local.run(local.plain, num_images=2)
    batched = local.run(local.batched, num_images=2)
    assert local.forwards == [4, 4]
    assert batched.shape == plain.shape == (2, 64, 64, 3)
    assert np.abs(batched - plain).max() <= 1, np.abs(batched - plain).max()


def test_cfg_off_runs_as_before(local):
    plain = local.run(local.plain, true_cfg_scale=1.0)
    batched = local.run(local.batched, true_cfg_scale=1.0)
    assert local.forwards == [1, 1]
    assert np.array_equal(batched, plain)


def test_a_cancelled_or_failed_job_leaves_no_half_batch_behind(local):
    reference = local.run(local.batched)
    cancel = threading.Event()

    def on_step(step, total):
        cancel.set()  # read at the end of the next step

    with pytest.raises(Cancelled, match="cancelled at step 2 of 2"):
        local.run(local.batched, cancel=cancel, on_step=on_step)

    def fail(module, args):
        raise RuntimeError("injected fault in the batched forward")

    hook = local.pipe.transformer.transformer_blocks[0].register_forward_pre_hook(fail)
    try:
        with pytest.raises(ImgEditError, match="internal error") as caught:
            local.run(local.batched)
        assert "injected" not in caught.value.message  # our words only
    finally:
        hook.remove()
    assert np.array_equal(local.run(local.batched), reference)
    assert np.abs(local.run(local.plain) - reference).max() <= 1  # the plain runner is not batched either


def test_batching_survives_the_offload_hook_that_removes_itself(plus_ckpt):
    """diffusers' group offloading with streams (GPU only) traces the first forward through a hook that
    then removes itself, which sets `forward` back to what it was before that hook: the same removal,
    here on the CPU, must not drop the batching from the second step on (the GPU machine found it)."""
    from diffusers.hooks import HookRegistry, ModelHook

    class RemovesItself(ModelHook):
        def post_forward(self, module, output):
            module._diffusers_hook.remove_hook("removes-itself", recurse=False)
            return output

    fresh = Local(plus_ckpt, batched=False)
    reference = fresh.run(fresh.plain)
    HookRegistry.check_if_exists_or_initialize(fresh.pipe.transformer).register_hook(RemovesItself(), "removes-itself")
    # installed over the hook, as in a worker
    runner = Runner(fresh.pipe, "hooked", ("cpu",), parts=(CfgBatch(fresh.pipe.transformer),))
    image = fresh.run(runner)
    assert fresh.forwards == [2, 2]  # [2, 1, 1] when the removal dropped the batching
    assert np.abs(image - reference).max() <= 1
    assert fresh.run(runner).shape == reference.shape and fresh.forwards == [2, 2]
    calls = []

    class Counts(ModelHook):  # a hook registered over the batching one wraps it, and stays
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    HookRegistry.check_if_exists_or_initialize(fresh.pipe.transformer).register_hook(Counts(), "counts")
    assert np.array_equal(fresh.run(runner), image) and fresh.forwards == [2, 2] and len(calls) == 4


def test_the_setting_reaches_the_worker_and_the_status(plus_ckpt):
    manager = make_manager(plus_ckpt, plan="planner", BATCH_CFG="on")
    try:
        worker = manager.workers[0]
        assert worker.info["batch_cfg"] is True
        assert "both CFG branches in one forward (batch 2)" in manager.status().reason
        result = manager.edit(EditRequest(images=(picture(),), prompt="make it red", seed=1, num_inference_steps=2,
                                          width=64, height=64, source="test"))
        assert result.steps == 2 and result.images[0].size == (64, 64)
    finally:
        manager.close()


def test_batch_cfg_on_with_a_gpu_group_is_refused():
    with pytest.raises(SettingsError, match="BATCH_CFG=on runs both CFG branches in one forward on one GPU"):
        load_settings({"BATCH_CFG": "on", "DEVICE_MAP": "cfg-parallel"})
    with pytest.raises(SettingsError, match="BATCH_CFG='sometimes' is not valid: expected one of auto, on, off"):
        load_settings({"BATCH_CFG": "sometimes"})


def test_why_the_cfg_forwards_replace_forward_and_the_text_padding_is_a_hook():
    """diffusers' HookRegistry.remove_hook hands the removed hook's forward to the hook registered after it: a
    pre_forward hook (the Ulysses text padding, ulysses.TextPadding) stays in the chain, but a hook with its own
    `new_forward` (what CfgBatch and CfgPair would need: they answer without calling the transformer) is
    dropped. Group offloading's lazy prefetching removes its hook after the first forward, so the CFG forwards
    replace `forward` and re-install themselves (cfg_parallel.ForwardOverride). A diffusers that keeps such a
    hook fails this test: the CFG forwards could then become hooks."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Plus(torch.nn.Module):
        def forward(self, x):
            return x + 1

    class Replaces(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return self.fn_ref.original_forward(*args, **kwargs) * 100

    class Scales(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] * 10,), kwargs

    for hook, before, after in ((Replaces(), 200.0, 2.0), (Scales(), 11.0, 11.0)):
        module = Plus()
        registry = HookRegistry.check_if_exists_or_initialize(module)
        registry.register_hook(ModelHook(), "removed later")  # as the lazy prefetching hook is
        registry.register_hook(hook, "ours")
        assert module(torch.ones(1)).item() == before
        registry.remove_hook("removed later", recurse=False)
        assert module(torch.ones(1)).item() == after
