"""What a REST edit costs beyond the edit: the same job through the manager and through the HTTP server, with the
reply as PNG (the default), JPEG or WebP (OpenAI's `output_format`, `output_compression`).

    python benchmarks/bench_reply.py [--size 1024] [--repeats 5] [--device-map cpu] [--json out.json]

One PipelineManager (the tiny checkpoint on the CPU by default; `--ckpt` a real one on a GPU) edits a 1024x1024
input at 1024x1024, 2 steps, CFG off, through `manager.edit` and through `POST /v1/images/edits` (httpx, the app's
own server on a local port) in each reply format, interleaved: a round is a manager edit, then one REST edit per
format; medians of N rounds after one warm-up each. `over_manager_s` is the median of each REST edit's wall less
its round's manager edit. The server-side encode of each format is timed apart on a result image
(`imgedit.engine.outputs.encoded`), with the bytes it makes. A random model's result is noise-like, the hardest
case for PNG; a photo compresses better and writes faster.

    python benchmarks/bench_reply.py --page      # the page's share: no model, no server

`--page` times the server's work for a page edit's result after the job (one 1024x1024 result, a noise image and a
photo-like one): the Gallery and the before/after ImageSlider handed PIL images (Gradio writes a PNG at zlib
level 6 for each, and the history wrote its own), against the app's way (imgedit.web.page.tools.page_files: one PNG at
level 1 for the gallery, the slider's "after" and the history, one more for "before").
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import reference_image, rest_edit, served, write_results  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.engine.outputs import encoded  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

FORMATS = (("png", None), ("jpeg", 90), ("jpeg", 100), ("webp", 90))


def name(fmt: str, quality: int | None) -> str:
    return fmt + (f"-{quality}" if quality else "")


def fields(fmt: str, quality: int | None) -> dict:
    return {"output_format": fmt} | ({"output_compression": str(quality)} if quality else {})


def page() -> dict:
    import gradio as gr
    import numpy as np
    from PIL import Image

    from imgedit.engine.outputs import png_bytes
    from imgedit.web.page.tools import compare_pair, page_files

    rng = np.random.default_rng(0)
    smooth = np.asarray(reference_image(1024), dtype=np.float32)
    photo = Image.fromarray(np.clip(smooth + rng.normal(0, 4, smooth.shape), 0, 255).astype(np.uint8))
    noise = Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    with gr.Blocks():
        gallery, slider = gr.Gallery(format="png"), gr.ImageSlider(format="png", type="pil")
    req = EditRequest(images=(photo,), prompt="x")

    def median_s(work) -> float:
        work()
        times = []
        for _ in range(5):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        return round(statistics.median(times), 3)

    rows = {}
    for name, result in (("noise", noise), ("photo-like", photo)):
        result.info["seed"] = "1"

        def handed_images(result=result):
            png_bytes(result)  # the history's own PNG
            gallery.postprocess([result])
            slider.postprocess(compare_pair(photo, result, None))

        def handed_files(result=result):
            files, pair = page_files(req, result, [png_bytes(result)])
            gallery.postprocess(files)
            slider.postprocess(pair)

        rows[name] = {"pil_images_s": median_s(handed_images), "one_png_s": median_s(handed_files)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--device-map", default="cpu")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    parser.add_argument("--page", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.page:
        rows = page()
        write_results({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}, rows, args.json)
        return
    ckpt = Path(args.ckpt) if args.ckpt else build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="plus")
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": args.device_map, "ENCODE_CACHE": "0",
                              "OUTPUT_DIR": tempfile.mkdtemp(), "LOG_LEVEL": "WARNING"})
    manager = PipelineManager(settings).load(timeout=900)
    size, image = args.size, reference_image(args.size)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    form = {"prompt": "turn the sky into a sunset", "size": f"{size}x{size}", "seed": "1",
            "num_inference_steps": str(args.steps), "true_cfg_scale": "1"}
    try:
        req = EditRequest(images=(image,), prompt=form["prompt"], seed=1, num_inference_steps=args.steps,
                          true_cfg_scale=1.0, width=size, height=size, source="bench")
        result = manager.edit(req)  # warm-up
        out_image = result.images[0]
        walls: dict[str, list[float]] = {"manager": []}
        over: dict[str, list[float]] = {}
        with served(settings, manager) as url:
            for fmt, quality in FORMATS:  # warm-up
                rest_edit(url, buffer.getvalue(), form | fields(fmt, quality))
            for _ in range(args.repeats):  # interleaved: each REST edit beside a manager edit of the same round
                started = time.perf_counter()
                manager.edit(req)
                direct = time.perf_counter() - started
                walls["manager"].append(direct)
                for fmt, quality in FORMATS:
                    wall = rest_edit(url, buffer.getvalue(), form | fields(fmt, quality))
                    walls.setdefault(name(fmt, quality), []).append(wall)
                    over.setdefault(name(fmt, quality), []).append(wall - direct)
        rows: dict[str, dict] = {"manager": {"wall_s": round(statistics.median(walls["manager"]), 3)}}
        for fmt, quality in FORMATS:
            encode = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                data = encoded(out_image, fmt, quality or 100)
                encode.append(time.perf_counter() - started)
            key = name(fmt, quality)
            rows[key] = {"rest_wall_s": round(statistics.median(walls[key]), 3),
                         "over_manager_s": round(statistics.median(over[key]), 3),
                         "encode_s": round(statistics.median(encode), 4), "bytes": len(data)}
    finally:
        manager.close()
    out = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "size": size, "steps": args.steps,
           "device_map": args.device_map, "rows": rows}
    write_results(out, rows, args.json)


if __name__ == "__main__":
    main()
