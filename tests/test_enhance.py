"""Prompt enhancement (#25): the pipeline's own text encoder rewrites the instruction, in the worker, with the
input images in view; every entry point, the fallbacks, the limits, cancel.

The tiny checkpoint's random text encoder writes nonsense and never ends its answer on its own: a plain
instruction shows the token-limit fallback. The rewrite that is used comes from a marker in the instruction
(tests/faults.py: `[rewrite:TEXT]` makes the model's next-token scores pick TEXT and then the end of the
answer, at the text encoder's output), so what is tested is the path: generate, decode, fall back, and the
rewrite reaching the edit, the PNG, the history, the APIs.
"""

from __future__ import annotations

import base64
import io
import threading
from contextlib import contextmanager

import numpy as np
import openai
import pytest
import torch
from conftest import LocalPipeline, http, picture, wait_job
from gradio_client import Client, handle_file
from PIL import Image

from imgedit.errors import Cancelled, ImgEditError, InvalidInput, OutOfGpuMemory
from imgedit.protocol import EditRequest

W, H = 64, 64
REWRITE = 'Turn the sky into a warm sunset, keep the house; write "HOME" on the door.'
ASKED = f"make it evening [rewrite:{REWRITE}]"


def photo() -> Image.Image:
    return picture(W, H, (40, 140, 90))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def edit(manager, prompt: str, **kw):
    return manager.edit(EditRequest(images=(photo(),), prompt=prompt, num_inference_steps=2, width=W, height=H,
                                    seed=11, **kw))


def test_a_rewrite_is_the_models_words_or_the_original_with_a_notice(plus_manager):
    done = sum(w.jobs_done for w in plus_manager.workers)
    result = plus_manager.enhance(EditRequest(images=(photo(), photo()), prompt=ASKED))
    assert result.prompt == REWRITE and result.notice is None and result.images == []
    empty = plus_manager.enhance(EditRequest(images=(photo(),), prompt="x [rewrite-empty]"))
    assert empty.prompt is None and "came back empty" in empty.notice
    # The random model never ends its answer: cut at ENHANCE_MAX_TOKENS, so the user's words stay.
    cut = plus_manager.enhance(EditRequest(images=(photo(),), prompt="make it winter"))
    limit = plus_manager.settings.enhance_max_tokens
    assert cut.prompt is None and f"cut at the {limit}-token limit" in cut.notice, cut.notice
    assert sum(w.jobs_done for w in plus_manager.workers) == done + 3  # each a job in the line


def test_an_enhanced_edit_runs_the_rewrite_and_its_png_keeps_both_prompts(plus_manager, tmp_path):
    enhanced = edit(plus_manager, ASKED, enhance_prompt=True)
    assert enhanced.prompt == REWRITE and enhanced.notice is None
    text = enhanced.images[0].info
    assert text["prompt"] == REWRITE and text["original_prompt"] == ASKED, text
    # The pixels are those of the rewrite typed in by hand (same seed), not of the words the user typed.
    by_hand = edit(plus_manager, REWRITE).images[0]
    as_typed = edit(plus_manager, ASKED).images[0]
    same = np.array_equal(np.asarray(enhanced.images[0]), np.asarray(by_hand))
    assert same and not np.array_equal(np.asarray(by_hand), np.asarray(as_typed))
    assert "original_prompt" not in as_typed.info
    # A rewrite that is not usable: the edit runs with the user's words, and says so.
    kept = edit(plus_manager, "x [rewrite-empty]", enhance_prompt=True)
    assert kept.prompt is None and "came back empty" in kept.notice
    assert kept.images[0].info["prompt"] == "x [rewrite-empty]"
    # History stores the prompt used and the user's words (the History tab shows both).
    from imgedit.engine.jobs.history import HistoryStore

    store = HistoryStore(tmp_path / "history")
    entry = store.save("someone", "job", 0, EditRequest(images=(photo(),), prompt=ASKED), enhanced)
    again = store.get("someone", entry.id)
    assert (again.prompt, again.original_prompt) == (REWRITE, ASKED)


def test_bad_rewrite_requests_are_refused_like_edits_and_cancel_stops_one(plus_manager):
    done = sum(w.jobs_done for w in plus_manager.workers)
    for req, field in ((EditRequest(images=(photo(),), prompt="  "), "prompt"),
                       (EditRequest(images=(photo(),) * 4, prompt="x"), "images"),
                       (EditRequest(images=(photo(),), prompt="x" * 5000), "prompt")):
        with pytest.raises(InvalidInput) as refused:
            plus_manager.enhance(req)
        assert refused.value.field == field
    assert sum(w.jobs_done for w in plus_manager.workers) == done  # nothing reached a worker
    cancel = threading.Event()
    threading.Timer(3.0, cancel.set).start()
    with pytest.raises(Cancelled, match="rewrite"):  # 0.2 s a token: stopped within a token of the cancel
        plus_manager.enhance(EditRequest(images=(photo(),), prompt="slow [rewrite-slow]"), cancel=cancel)
    with pytest.raises(OutOfGpuMemory, match="while rewriting the prompt"):
        plus_manager.enhance(EditRequest(images=(photo(),), prompt="x [rewrite-oom]"))
    with pytest.raises(ImgEditError, match="the prompt rewrite failed with an internal error") as failed:
        plus_manager.edit(EditRequest(images=(photo(),), prompt="x [rewrite-bug]", enhance_prompt=True))
    assert "secret" not in str(failed.value)
    assert plus_manager.enhance(EditRequest(images=(photo(),), prompt=ASKED)).prompt == REWRITE  # served on
    assert all(w.restarts == 0 for w in plus_manager.status().workers)


def sample(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_rest_enhance_route_edits_with_enhance_prompt_and_the_metrics(live_server):
    url = live_server.url
    files = [("image[]", ("a.png", png_bytes(photo()), "image/png"))]
    before = sample(url, "imgedit_prompt_rewrites_total", source="rest", outcome="ok")
    edits_before = sample(url, "imgedit_requests_total", source="rest")
    r = http.post(f"{url}/v1/prompts/enhance", files=files, data={"prompt": ASKED}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == REWRITE and r.json()["original_prompt"] == ASKED and "notice" not in r.json()
    kept = http.post(f"{url}/v1/prompts/enhance", files=files, data={"prompt": "x [rewrite-empty]"}, timeout=120)
    assert kept.json()["prompt"] == "x [rewrite-empty]" and "came back empty" in kept.json()["notice"]
    for data, files_, field in (({"prompt": " "}, files, "prompt"), ({}, files, "prompt"),
                                ({"prompt": "x"}, [], "image")):
        bad = http.post(f"{url}/v1/prompts/enhance", files=files_ or {"x": ("x", b"", "text/plain")}, data=data,
                         timeout=60)
        assert bad.status_code == 400 and "Traceback" not in bad.text, bad.text
        assert bad.json()["error"]["param"] == field, bad.text
    assert sample(url, "imgedit_prompt_rewrites_total", source="rest", outcome="ok") == before + 2
    assert sample(url, "imgedit_requests_total", source="rest") == edits_before  # rewrites are not edits
    # The openai SDK: enhance_prompt as an extra field; OpenAI's own `revised_prompt` carries the rewrite.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    result = client.images.edit(image=("a.png", png_bytes(photo()), "image/png"), prompt=ASKED, size=f"{W}x{H}",
                                extra_body={"enhance_prompt": "true", "num_inference_steps": 2, "seed": 4})
    assert result.data[0].revised_prompt == REWRITE
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.text["original_prompt"] == ASKED and image.text["prompt"] == REWRITE
    plain = client.images.edit(image=("a.png", png_bytes(photo()), "image/png"), prompt="make it red",
                               size=f"{W}x{H}", extra_body={"num_inference_steps": 2})
    assert plain.data[0].revised_prompt is None
    bad = http.post(f"{url}/v1/images/edits", files=files, data={"prompt": "x", "enhance_prompt": "maybe"},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "enhance_prompt", bad.text


def test_gradio_api_enhance_prompt_and_edit_with_enhance(live_server, tmp_path):
    path = tmp_path / "in.png"
    photo().save(path)
    client = Client(live_server.url, verbose=False)
    assert client.predict([handle_file(str(path))], ASKED, api_name="/enhance_prompt") == REWRITE
    assert client.predict([handle_file(str(path))], "make it winter", api_name="/enhance_prompt") == "make it winter"
    images, _ = client.predict([handle_file(str(path))], ASKED, num_inference_steps=2, width=W, height=H,
                               enhance_prompt=True, api_name="/edit")
    text = Image.open(images[0]["image"]).text
    assert text["prompt"] == REWRITE and text["original_prompt"] == ASKED
    with pytest.raises(Exception, match="the prompt is empty"):
        client.predict([handle_file(str(path))], "   ", api_name="/enhance_prompt")


def test_the_text_encoders_control_tokens_in_a_prompt_are_refused_the_pipeline_cannot_take_them(plus_manager,
                                                                                                 plus_pipe):
    """`<|image_pad|>` in a prompt breaks the pipeline's own layout of pictures and text (shown on the pipeline
    directly); we refuse it up front, for edits and rewrites, naming the token."""
    with pytest.raises(Exception):  # noqa: B017 - whatever the pipeline raises, it cannot run this prompt
        plus_pipe.pipe(image=[photo()], prompt="make it red <|image_pad|>", num_inference_steps=2, width=W, height=H,
                       true_cfg_scale=1.0)
    done = sum(w.jobs_done for w in plus_manager.workers)
    for call, fields in ((plus_manager.edit, {"prompt": "red <|image_pad|>"}),
                         (plus_manager.edit, {"prompt": "red", "negative_prompt": "<|im_end|> x"}),
                         (plus_manager.enhance, {"prompt": "<|vision_start|> winter"})):
        with pytest.raises(InvalidInput, match="a control token of the model's text encoder") as refused:
            call(EditRequest(images=(photo(),), num_inference_steps=2, width=W, height=H, **fields))
        assert refused.value.field == next(iter(k for k, v in fields.items() if "<|" in v))
    assert sum(w.jobs_done for w in plus_manager.workers) == done


def test_a_job_with_enhance_prompt_rewrites_each_item_for_its_own_images(live_server):
    files = [("set1", ("a.png", png_bytes(photo()), "image/png")),
             ("set2", ("b.png", png_bytes(picture(W, H, (200, 60, 60))), "image/png"))]
    data = {"prompt": ASKED, "enhance_prompt": "true", "num_inference_steps": "2", "size": f"{W}x{H}"}
    r = http.post(f"{live_server.url}/v1/jobs", files=files, data=data, timeout=60)
    assert r.status_code in (200, 201, 202), r.text
    view = wait_job(live_server.url, r.json()["id"])
    job_id = view["id"]
    assert view["state"] == "succeeded" and view["enhance_prompt"] is True and view["prompt"] == ASKED, view
    assert [item["revised_prompt"] for item in view["items"]] == [REWRITE, REWRITE], view["items"]
    png = http.get(f"{live_server.url}/v1/jobs/{job_id}/result?item=2", timeout=30)
    text = Image.open(io.BytesIO(png.content)).text
    assert text["prompt"] == REWRITE and text["original_prompt"] == ASKED


def test_a_static_cache_writes_the_same_rewrite_and_is_kept_off_the_cpu_and_hooked_encoders(plus_pipe, monkeypatch):
    """On a GPU the rewrite decodes with a static KV cache (transformers then compiles each step): the same
    greedy tokens as the dynamic cache. Forced here on the CPU, where static_cache itself says no."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from transformers import StaticCache

    from imgedit.runtime import enhance

    pipe, image = plus_pipe.pipe, picture(256, 256)
    assert enhance.static_cache(pipe.text_encoder, 100) is None  # the CPU: generate's own dynamic cache
    dynamic = enhance.rewrite(pipe, [image], "make it winter", 24, threading.Event())
    used = []

    def forced(encoder, needed):
        used.append(needed)
        return StaticCache(config=encoder.config, max_cache_len=enhance.STATIC_CACHE_TOKENS)

    monkeypatch.setattr(enhance, "static_cache", forced)
    static = enhance.rewrite(pipe, [image], "make it winter", 24, threading.Event())
    assert used and static.token_ids == dynamic.token_ids and len(static.token_ids) == 24
    encoder = torch.nn.Linear(2, 2)
    add_hook_to_module(encoder, AlignDevicesHook(execution_device="cpu"))
    monkeypatch.undo()
    assert enhance.static_cache(encoder, 100) is None  # hooked: never compiled
    gpu_like = torch.nn.Linear(2, 2)
    gpu_like.device = torch.device("cuda")  # what static_cache reads of a resident encoder
    enhance.no_static_cache(gpu_like)  # the worker's fallback when the captured decoding failed
    assert enhance.static_cache(gpu_like, 100) is None


def test_an_encoder_on_another_device_rewrites_there_without_its_hook_and_gets_it_back(plus_ckpt, plus_pipe):
    """The balanced placement's text encoder sits whole on another GPU with a hook moving its inputs: a rewrite
    runs there directly (so its decoding steps can be compiled) and the hook is back for the next edit. "cpu:0"
    is a second name for the CPU, so the loader hooks the encoder as it does on a second GPU."""
    from imgedit.model.encoding import prepare_text_encoder
    from imgedit.planning.checkpoint import MODEL_COMPONENTS
    from imgedit.planning.plan import Placement, WorkerPlan
    from imgedit.runtime import enhance, loader

    plan = WorkerPlan("split", {name: Placement("cpu:0" if name == "text_encoder" else "cpu")
                                for name in MODEL_COMPONENTS})
    pipe = loader.load_pipeline(loader.open_checkpoint(str(plus_ckpt)), plan, torch.float32)
    prepare_text_encoder(pipe.text_encoder)
    hook = pipe.text_encoder._hf_hook
    seen = []
    pipe.text_encoder.register_forward_pre_hook(lambda m, a: seen.append(hasattr(m, "_hf_hook")))
    image = picture(256, 256)
    moved = enhance.rewrite(pipe, [image], "make it winter", 16, threading.Event())
    assert seen and not any(seen)  # every forward of the rewrite ran without the hook
    assert pipe.text_encoder._hf_hook is hook  # and it is back
    assert moved.token_ids == enhance.rewrite(plus_pipe.pipe, [image], "make it winter", 16,
                                              threading.Event()).token_ids


@contextmanager
def decoding_through_graphs(encoder):
    """The CPU standing in for a GPU: rewrites get the static cache (STATIC_DEVICES), and generate() runs their
    decoding steps through get_compiled_call (on a GPU it does so by itself), where decode_graphs sits; on the
    CPU its "capture" keeps the copied inputs and a replay runs the step eagerly on them. Undone after."""
    from transformers import CompileConfig

    from imgedit.runtime import decode_graphs, enhance

    config = CompileConfig()
    config._compile_all_devices = True
    encoder.generation_config.compile_config = config
    previous = enhance.STATIC_DEVICES
    enhance.STATIC_DEVICES = ("cuda", "cpu")
    torch._dynamo.reset()
    try:
        yield
    finally:
        enhance.STATIC_DEVICES = previous
        decode_graphs.uninstall(encoder)
        encoder.generation_config.compile_config = None
        encoder.__dict__.pop("_imgedit_eager_decoding", None)
        torch._dynamo.reset()


def test_qwen_image_21_rewrites_decode_in_one_captured_step_with_one_kept_cache_and_nothing_compiled(tmp_path):
    """Qwen-Image-2.1's rewrites decode with one static cache kept per encoder and their decoding step captured
    once (decode_graphs; eager with a dynamic cache it wrote 100 ms a token on an H200, compiled by transformers
    it cost ~57 s of every first start): the warm-up captures the step, and rewrites with one picture, two and
    none (text to image) replay it, their greedy tokens the dynamic cache's. Nothing is compiled, and the kept
    cache is zeroed after each call."""
    from torch._dynamo.utils import counters

    from imgedit.model.demo_checkpoint import build_checkpoint
    from imgedit.runtime import decode_graphs, enhance, warmup

    pipe = LocalPipeline(build_checkpoint(tmp_path / "q21", kind="21", seed=0)).pipe
    encoder = pipe.text_encoder
    assert type(encoder).__name__ == "Qwen3VLForConditionalGeneration"
    asks = [([picture(256, 256)], "make it winter"), ([picture(96, 160), picture(200, 120, (200, 60, 60))],
                                                     "put them side by side"), ([], "a red fox in the snow")]
    dynamic = [enhance.rewrite(pipe, images, prompt, 12, threading.Event()).token_ids for images, prompt in asks]
    with decoding_through_graphs(encoder):
        counters.clear()
        fallbacks = []
        warmup.warm_up_rewrite(pipe, fallbacks, compiled=True)  # as a compiled 2.1 worker starts
        graphs = decode_graphs.installed(encoder)
        assert fallbacks == [] and enhance.decodes_with_graphs(encoder)
        assert graphs is not None and graphs.captures == 1 and len(graphs.steps) == 1
        kept = graphs.kept
        static = [enhance.rewrite(pipe, images, prompt, 12, threading.Event()).token_ids for images, prompt in asks]
        assert static == dynamic and all(len(ids) == 12 for ids in static)
        assert graphs.captures == 1 and len(graphs.steps) == 1 and graphs.eager == set()
        assert graphs.kept is kept, "each rewrite must reuse the one kept cache (the graphs hold its tensors)"
        layer = kept.layers[0]
        assert int(layer.cumulative_length) == 0 and not layer.keys.any() and not layer.values.any()
        assert counters["stats"]["unique_graphs"] == 0, "the decoding step must not be compiled"


def test_qwen_25_vl_decoding_steps_copy_the_mask_inside_their_dict(plus_pipe):
    """Qwen2.5-VL (the edit models' encoder) gets its mask as a dict ({"full_attention": mask}): the captured step
    keeps a copy of the tensor inside it, by path, and each replay writes the step's own mask there (replaying
    the first step's mask would see too few positions: other tokens than the dynamic cache's)."""
    from imgedit.runtime import decode_graphs, enhance

    pipe, image = plus_pipe.pipe, picture(256, 256)
    dynamic = [enhance.rewrite(pipe, [image], prompt, 16, threading.Event()).token_ids
               for prompt in ("make it winter", "a red door")]
    with decoding_through_graphs(pipe.text_encoder):
        static = [enhance.rewrite(pipe, [image], prompt, 16, threading.Event()).token_ids
                  for prompt in ("make it winter", "a red door")]
        graphs = decode_graphs.installed(pipe.text_encoder)
        (step,) = graphs.steps.values()
        masks = [path for path in step.inputs if path[0] == "attention_mask"]
    assert static == dynamic
    assert masks == [("attention_mask", "full_attention")], list(step.inputs)


def test_a_capture_that_fails_leaves_its_layout_eager_with_the_same_tokens(plus_pipe, monkeypatch, caplog):
    """A decoding step that cannot be captured (a CPU sync inside it, say) runs eagerly from then on, said once
    in the log and in the worker's fallbacks (the warm-up's); the rewrite's tokens are the same."""
    from imgedit.runtime import decode_graphs, enhance, warmup

    pipe, image = plus_pipe.pipe, picture(256, 256)
    dynamic = enhance.rewrite(pipe, [image], "make it winter", 16, threading.Event()).token_ids

    def refused(self, kwargs, tensors):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_capture", refused)
    with decoding_through_graphs(pipe.text_encoder), caplog.at_level("WARNING"):
        fallbacks = []
        warmup.warm_up_rewrite(pipe, fallbacks, compiled=True)
        again = [enhance.rewrite(pipe, [image], "make it winter", 16, threading.Event()).token_ids for _ in range(2)]
        graphs = decode_graphs.installed(pipe.text_encoder)
        assert graphs.captures == 0 and len(graphs.eager) == 1
    assert again == [dynamic, dynamic]
    assert fallbacks == ["captured rewrite decoding failed → eager: operation not permitted when stream is "
                         "capturing"], fallbacks
    said = [r.message for r in caplog.records if "CUDA graph failed" in r.message]
    assert len(said) == 1 and "stream is capturing" in said[0]


def test_an_edit_worker_that_is_not_compiled_decodes_its_rewrites_eagerly(plus_pipe, monkeypatch):
    """COMPILE=off on the edit models: nothing compiled at start-up, the rewrite's decoding included."""
    from imgedit.runtime import enhance, warmup

    encoder = plus_pipe.pipe.text_encoder
    monkeypatch.setattr(enhance, "STATIC_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(enhance, "rewrite", lambda *args: None)  # the warm-up's rewrite itself: not the point
    try:
        assert enhance.decodes_with_graphs(encoder)
        warmup.warm_up_rewrite(plus_pipe.pipe, [], compiled=False)
        assert not enhance.decodes_with_graphs(encoder)
    finally:
        encoder.__dict__.pop("_imgedit_eager_decoding", None)
