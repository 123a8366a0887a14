"""Benchmark the vision tower's windows in one attention call (imgedit.model.vision_attention) against
transformers' per-window loop: the vision tower alone, and the pipeline's whole prompt encoding.

    python benchmarks/bench_vision.py [--ckpt /tmp/qwen-image-edit-real-random] [--repeats 20] [--json out.json]
    python benchmarks/bench_vision.py --tiny      # CPU smoke run on the tiny checkpoint
    python benchmarks/bench_vision.py --device cpu --rows tower384 --repeats 2   # fidelity on the CPU, real size

The text encoder of the real-size random checkpoint (Qwen2.5-VL 7B config, trained-like init, bf16) on cuda:0,
loaded by the app's own loader, with the app's worker settings for CPU threads (4, WORKER_THREADS=auto on one GPU).
Rows: the -2509/-2511 pipelines' condition picture (384² area, 16 windows a layer) and a 1024² picture (the first
edit model's prompt picture: 100 windows a layer), through the vision tower; then the edit-plus pipeline's
`encode_prompt` with the picture its `__call__` hands it (384² for a square input; the processor, the tower and the
7B language model). Each is timed with a GPU sync, median of --repeats after 3 warm-ups, loop and one-call
alternating. Fidelity: the one-call result against the loop's, max |difference| and cosine, and for the tower
rows each form's bf16 output against the loop in float32 (the same weights): the one call is as exact as the loop
when both sit as close to it. Every output must be finite (random weights that overflow would time NaN arithmetic).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import reference_image, write_results  # noqa: E402

from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.model.vision_attention import install_one_call_windows  # noqa: E402

PROMPT = "make the sky a deep red and add a small boat"


def load(ckpt: Path, device: str, dtype):
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    from imgedit.model.encoding import prepare_text_encoder
    from imgedit.model.processor import load_processor
    from imgedit.planning.plan import Placement
    from imgedit.runtime import weights
    from imgedit.runtime.loader import open_checkpoint

    checkpoint = open_checkpoint(str(ckpt))
    encoder = weights.load_component("text_encoder", checkpoint, Placement(device), dtype).eval()
    prepare_text_encoder(encoder)  # as a worker does; `measure` takes the vision tower's one call off and on
    pipe = getattr(diffusers, checkpoint.pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(ckpt, subfolder="scheduler"),
        tokenizer=Qwen2Tokenizer.from_pretrained(ckpt / "tokenizer"), processor=load_processor(ckpt / "processor"),
        text_encoder=encoder, vae=None, transformer=None)
    return pipe


def encoded(pipe, prompt: str, image, device: str) -> torch.Tensor:
    """The pipeline class's own encode_prompt (no worker's memo): the prompt embeddings."""
    return type(pipe).encode_prompt(pipe, prompt=prompt, image=image, device=torch.device(device))[0]


def loop_form(encoder) -> None:
    for module in encoder.modules():
        module.__dict__.pop("forward", None) if type(module).__name__ == "Qwen2_5_VLVisionAttention" else None


def timed(fn, device: str, repeats: int) -> tuple[list[float], torch.Tensor]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times, out = [], None
    for k in range(repeats + 3):
        sync()
        started = time.perf_counter()
        out = fn()
        sync()
        if k >= 3:
            times.append(time.perf_counter() - started)
    return times, out


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double().flatten(), b.double().flatten()  # a float32 cosine of ~10^6 values is off by ~1e-4 itself
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise RuntimeError("a non-finite output: the timing would be of NaN arithmetic")
    return {"max_abs_diff": float((a - b).abs().max()), "mean_abs": float(b.abs().mean()),
            "cosine": round(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda:0", help="cpu: the real-size encoder on this machine's CPU")
    parser.add_argument("--rows", default="tower384,tower1024,encode",
                        help="also: compiled (encode_prompt with the language model under torch.compile), "
                             "fp8text (its Linear layers in fp8, QUANTIZE's torchao config; int8 with --tiny)")
    args = parser.parse_args()
    if args.tiny:
        ckpt, device, dtype, args.repeats = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="plus"), \
            "cpu", torch.float32, 3
    else:
        ckpt, device, dtype = Path(args.ckpt), args.device, torch.bfloat16
        if not (ckpt / "model_index.json").is_file():
            build_checkpoint(ckpt, kind="plus", size="real")
    wanted = {row.strip() for row in args.rows.split(",")}
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    pipe = load(ckpt, device, dtype)
    encoder, visual = pipe.text_encoder, pipe.text_encoder.model.visual
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    rows = {}
    for key, name, side in (("tower384", "tower, 384x384 picture (-2509/-2511)", 384),
                            ("tower1024", "tower, 1024x1024 picture (first edit model)", 1024)):
        if key not in wanted:
            continue
        inputs = pipe.processor(text=[marker], images=[reference_image(side)], return_tensors="pt").to(device)
        pixels, grid = inputs["pixel_values"].to(dtype), inputs["image_grid_thw"]
        rows[name] = {"grid_thw": grid.tolist()[0]}

        def tower(pixels=pixels, grid=grid):
            return visual(pixels, grid_thw=grid).pooler_output
        rows[name] |= measure(encoder, tower, device, args.repeats)
        # float32 with transformers' loop as the reference: is the one call as close to it as the loop is?
        loop_form(encoder)
        reference = copy.deepcopy(visual).float()(pixels.float(), grid_thw=grid).pooler_output
        install_one_call_windows(encoder)
        for form in ("loop", "one_call"):
            rows[name][f"{form}_vs_fp32_loop"] = compare(rows[name].pop(f"_{form}_out"), reference)
    plus = "Plus" in type(pipe).__name__  # its __call__ hands the text encoder the input at 384x384 (a square one)
    side = 384 if plus else 1024
    image = reference_image(side)

    def encode():
        return encoded(pipe, PROMPT, [image] if plus else image, device)
    if "encode" in wanted:
        rows[f"encode_prompt, {type(pipe).__name__}, {side}x{side} picture"] = measure(encoder, encode, device,
                                                                                       args.repeats)
    if "compiled" in wanted:  # the route "compile the text encoder": its 7B language model, dynamic lengths
        rows[f"encode_prompt, language model compiled, {side}x{side} picture"] = compiled_text(
            encoder, pipe, image if not plus else [image], device, args.repeats)
    if "fp8text" in wanted:  # the other route, "quantize the text encoder": last, it changes the weights
        rows[f"encode_prompt, language model in fp8, {side}x{side} picture"] = fp8_text(
            encoder, pipe, image if not plus else [image], device, args.repeats, args.tiny)
    for row in rows.values():
        row.pop("_loop_out", None), row.pop("_one_call_out", None)
    out = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "device": device,
           "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu", "threads": args.threads,
           "torch": torch.__version__, "rows": rows}
    write_results(out, {k: {m: v[m] for m in ("loop_ms", "one_call_ms", "max_abs_diff", "cosine", "loop_vs_fp32_loop",
                                              "one_call_vs_fp32_loop", "prompt0", "prompt1", "first_call_s_0",
                                              "first_call_s_1", "graph_breaks", "bf16_ms", "quantized_ms",
                                              "layers") if m in v}
                        for k, v in rows.items()}, args.json)


def compiled_text(encoder, pipe, image, device: str, repeats: int) -> dict:
    """encode_prompt eager against its language model under torch.compile(dynamic=True) (the vision tower in
    one call in both), with two prompts of different lengths: the second length must not cost a compile."""
    prompts = (PROMPT, "replace the old wooden fence on the left with a low stone wall covered in ivy, keep the light")

    def encode(prompt):
        return lambda: encoded(pipe, prompt, image, device)
    install_one_call_windows(encoder)
    eager = {p: timed(encode(p), device, repeats) for p in prompts}
    model = encoder.model.language_model
    model.compile(dynamic=True)
    out = {"lengths": [int(eager[p][1].shape[1]) for p in prompts]}
    for i, p in enumerate(prompts):
        started = time.perf_counter()
        encode(p)()
        out[f"first_call_s_{i}"] = round(time.perf_counter() - started, 2)  # 0: the compile; 1: a new length
    compiled = {p: timed(encode(p), device, repeats) for p in prompts}
    from torch._dynamo.utils import counters

    out["graph_breaks"] = sum(counters["graph_break"].values())
    for i, p in enumerate(prompts):
        out[f"prompt{i}"] = {"eager_ms": round(1000 * statistics.median(eager[p][0]), 2),
                             "compiled_ms": round(1000 * statistics.median(compiled[p][0]), 2)} \
            | compare(compiled[p][1], eager[p][1])
    model._compiled_call_impl = None  # eager again for anything after this row
    return out


def fp8_text(encoder, pipe, image, device: str, repeats: int, tiny: bool) -> dict:
    """encode_prompt eager in bf16 against the same with the language model's Linear layers quantized as
    QUANTIZE=fp8 does (dynamic per-row activations and weights; the vision tower stays bf16)."""
    from imgedit.runtime.offload import quantize_module

    def encode():
        return encoded(pipe, PROMPT, image, device)
    install_one_call_windows(encoder)
    bf16_times, bf16_out = timed(encode, device, repeats)
    layers = quantize_module(encoder.model.language_model, "int8" if tiny else "fp8")
    fp8_times, fp8_out = timed(encode, device, repeats)
    return {"layers": layers, "bf16_ms": round(1000 * statistics.median(bf16_times), 2),
            "quantized_ms": round(1000 * statistics.median(fp8_times), 2)} | compare(fp8_out, bf16_out)


def measure(encoder, fn, device: str, repeats: int) -> dict:
    """The loop's time and the one call's (alternating rounds), and how far apart their outputs are."""
    loop_times, one_times = [], []
    for _ in range(2):
        loop_form(encoder)
        t, loop_out = timed(fn, device, repeats // 2)
        loop_times += t
        if install_one_call_windows(encoder) == 0:
            raise RuntimeError("the one-call form did not install")
        t, one_out = timed(fn, device, repeats // 2)
        one_times += t
    return {"loop_ms": round(1000 * statistics.median(loop_times), 2),
            "one_call_ms": round(1000 * statistics.median(one_times), 2), "_loop_out": loop_out,
            "_one_call_out": one_out} | compare(one_out, loop_out)


if __name__ == "__main__":
    main()
