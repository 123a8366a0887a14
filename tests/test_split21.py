"""Qwen-Image-2.1 on a group of two (DEVICE_MAP=ulysses): each forward's target image split over the ranks, the
keys, values and output gathered (imgedit.runtime.split21). Real worker processes over gloo on the CPU, real
pipeline calls on the tiny 2.1 checkpoint; each group image is compared with one process's image for the same
seed: text to image, edits with 1 and 3 references, true CFG, two images a prompt, without the prefix cache,
and compiled."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import group_plan, make_manager, picture

from imgedit.planning.placement import GIB, plan_placement
from imgedit.planning.plan import ComponentSpec, GpuSpec
from imgedit.protocol import EditRequest

FAST = dict(num_inference_steps=3, width=64, height=64, seed=11)


@pytest.fixture(scope="module")
def one(ckpt21):
    return make_manager(ckpt21)


@pytest.fixture(scope="module")
def split2(ckpt21):
    return make_manager(ckpt21, plan=group_plan("ulysses", 2, 2))


def pixels(result) -> np.ndarray:
    return np.asarray(result.images[0], dtype=np.int16)


REQUESTS = {
    "text to image": dict(images=(), prompt="a red apple on a blue table"),
    "one reference": dict(images=(picture(),), prompt="make it red"),
    "three references, 96x64": dict(images=(picture(), picture(), picture()), prompt="blend them into one",
                                     width=96, height=64),
    "true cfg": dict(images=(picture(),), prompt="make it red", true_cfg_scale=4.0, negative_prompt="blurry"),
    "two a prompt": dict(images=(), prompt="a cat", num_images_per_prompt=2),
}


def test_the_group_gives_the_one_process_image_and_says_how_it_splits(one, split2):
    report = split2.workers[0].report
    assert "2.1 target split" in report.features, report.features
    assert "2.1 target split" not in one.workers[0].report.features
    for name, fields in REQUESTS.items():
        request = EditRequest(**{**FAST, **fields})
        alone, grouped = one.edit(request), split2.edit(request)
        assert len(grouped.images) == len(alone.images), name
        for a, g in zip(alone.images, grouped.images, strict=True):
            a, g = np.asarray(a, dtype=np.int16), np.asarray(g, dtype=np.int16)
            assert a.shape == g.shape, name
            # the same arithmetic on fewer rows: equal up to the matmul's rounding on a shorter matrix
            assert np.abs(a - g).max() <= 2, (name, np.abs(a - g).max())
    assert split2.status().workers[0].state == "idle"


def test_a_masked_edit_and_a_rewritten_prompt_on_the_group_are_the_one_process_images(one, split2):
    """A mask's blend runs on the whole latents every rank holds alike; a rewrite (its answer scripted at the
    encoder's output, tests/faults.py) is written once and the group's ranks edit with the same words."""
    from PIL import Image

    mask = Image.new("L", (80, 60), 0)
    mask.paste(255, (16, 8, 64, 48))
    scripted = "a red barn at dusk, watercolour"
    asks = [dict(images=(picture(),), prompt="make it red", mask=mask, mask_feather=2, width=80, height=64),
            dict(images=(picture(),), prompt=f"barn [rewrite:{scripted}]", enhance_prompt=True)]
    for fields in asks:
        request = EditRequest(**{**FAST, **fields})
        alone, grouped = one.edit(request), split2.edit(request)
        assert np.abs(pixels(alone) - pixels(grouped)).max() <= 2, fields["prompt"]
        assert grouped.prompt == alone.prompt
    assert grouped.prompt == scripted
    outside = np.asarray(mask) == 0
    masked = split2.edit(EditRequest(**{**FAST, **asks[0]}))
    kept = pixels(masked)[..., :3][outside]  # 2.1 answers RGBA: the input's pixels, opaque, outside the mask
    assert (kept == np.asarray(picture(), dtype=np.int16)[outside]).all()


def test_the_planner_makes_2_1_groups_and_says_what_they_split():
    components = [ComponentSpec("transformer", 14 * GIB, (GIB,) * 14), ComponentSpec("vae", GIB),
                  ComponentSpec("text_encoder", 16 * GIB)]
    gpus = [GpuSpec(i, "H200", 140 * GIB, 139 * GIB) for i in range(4)]
    from imgedit.config.parsers import parse_device_map

    plan = plan_placement(components, gpus, parse_device_map("ulysses"), family="21")
    assert [(w.parallel, w.ranks) for w in plan.workers] == [("ulysses", 2), ("ulysses", 2)]
    assert "target image split over its 2 GPUs" in plan.reason
    plan4 = plan_placement(components, gpus, parse_device_map("ulysses:4"), family="21")
    assert [(w.parallel, w.ranks) for w in plan4.workers] == [("ulysses", 4)]


ASKS = [(0, "a red apple", 1.0), (2, "blend the two", 1.0), (1, "paint it", 4.0)]


def _run(pipe, refs: int, prompt: str, cfg: float, **kw):
    import torch
    from PIL import Image

    images = [Image.new("RGB", (64 + 16 * i, 64), (40 * i, 120, 200)) for i in range(refs)] or None
    return pipe(image=images, prompt=prompt, negative_prompt=" " if cfg > 1 else None, true_cfg_scale=cfg,
                num_inference_steps=3, width=320, height=320, output_resolution=320, output_type="np",
                generator=torch.Generator().manual_seed(3), **kw).images[0]


def _rank(rank: int, port: int, ckpt, out) -> None:
    """One rank: the asks whole, then split over the two ranks (eager, without the prefix cache, and with the
    cached steps traced by dynamo: the exchange inside the graph); what it saw goes to `out`."""
    import torch
    import torch.distributed as dist
    from conftest import LocalPipeline

    from imgedit.runtime import compile21, split21

    try:
        torch.set_num_threads(1)
        pipe = LocalPipeline(ckpt, memo=0).pipe
        whole = [_run(pipe, *ask) for ask in ASKS]
        whole_uncached = _run(pipe, 1, "x", 1.0, use_kv_cache=False)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        split21.TargetSplit(rank, 2).install(pipe.transformer)
        rows: list[int] = []
        pipe.transformer.transformer_blocks[1].attn.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
        split = [_run(pipe, *ask) for ask in ASKS]
        uncached = _run(pipe, 1, "x", 1.0, use_kv_cache=False)
        blocks = compile21.compile_21(pipe.transformer, backend="eager")
        compiled = [_run(pipe, *ask) for ask in ASKS]
        out.put((rank, {"rows": rows[:3], "split": [float(abs(w - s).max()) for w, s in zip(whole, split, strict=True)],
                        "compiled": [float(abs(w - c).max()) for w, c in zip(whole, compiled, strict=True)],
                        "uncached": float(abs(whole_uncached - uncached).max()),
                        "compiled blocks": (blocks, len(pipe.transformer.transformer_blocks)),
                        "finite": bool(all(abs(x).max() < 1e6 for x in (*split, *compiled, uncached)))}))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        out.put((rank, repr(exc)))


def test_each_rank_runs_its_share_of_the_target_and_the_compiled_steps_trace_the_exchange(ckpt21):
    import multiprocessing

    from conftest import free_port

    context = multiprocessing.get_context("fork")
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=_rank, args=(r, port, ckpt21, out)) for r in range(2)]
    for process in ranks:
        process.start()
    seen = dict(out.get(timeout=600) for _ in ranks)
    for process in ranks:
        process.join(60)
    for rank in range(2):
        assert isinstance(seen[rank], dict), seen[rank]
        # 320² at 16x: a 400-token target; text to image's first step runs the prompt and a half of it
        prefill, cached = seen[rank]["rows"][0], seen[rank]["rows"][1]
        assert cached == 200 and prefill > 200 and prefill - 200 < 100, seen[rank]["rows"]
        assert seen[rank]["finite"]
        assert max(seen[rank]["split"]) < 1e-4 and max(seen[rank]["compiled"]) < 1e-4, seen[rank]
        assert seen[rank]["uncached"] < 1e-4, seen[rank]
        blocks, every = seen[rank]["compiled blocks"]
        assert blocks == every, seen[rank]  # block 0 too: its split hook stays above the compiled routing


def test_a_target_the_degree_does_not_divide_runs_whole_and_rows_are_the_prefix_then_a_share():
    import torch

    from imgedit.runtime.split21 import TargetSplit

    group = object()  # never used: nothing is gathered in this test
    split = TargetSplit(rank=1, degree=8, group=group)
    split.plan([(1, 66, 66)], 100 + 66 * 66, "cpu")  # 4,356 target tokens: not a multiple of 8
    assert not split.on and split.geometry is None
    split.plan([(1, 4, 4), (1, 64, 64)], 116 + 4096, "cpu")  # a reference's 16 tokens in a 116-token prefix
    assert split.on and (split.geometry.prefix, split.geometry.target, split.geometry.share) == (116, 4096, 512)
    rows = split.geometry.rows
    assert torch.equal(rows, torch.cat([torch.arange(116), torch.arange(116 + 512, 116 + 1024)]))
    assert split.rows_of(torch.arange(116 + 4096) * 10, 0).tolist() == (rows * 10).tolist()
