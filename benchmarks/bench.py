"""Benchmark the worker modes on this machine's GPUs with a real-size random-weight checkpoint.

    python benchmarks/bench.py [--steps 40] [--size 1024] [--modes one-eager,one-compiled,pair-eager,
                               pair-compiled,replicas-eager,pairs-throughput,app] [--json out.json]
    python benchmarks/bench.py --quick   # one GPU, eager and compiled, 10 steps

Every mode goes through imgedit's PipelineManager and its worker processes, exactly as the app does;
`app` also goes through the HTTP server (REST), to measure what the server adds. Workload: a Plus
edit of one 1024x1024 reference image, true CFG 4, 40 steps. Weights are random but trained-like
(imgedit.model.components.trained_like_init), and every worker checks that every transformer output is finite
and the benchmark that every image has contrast: NaN data runs a power-capped GPU faster.

Reports per mode: start-up seconds (spawn, weights, compile and warm-up), seconds per step and per
image, the first request at a size not warmed up, throughput with several jobs in flight, per-GPU
peak memory (NVML, whole process) and the process overhead (NVML process memory minus torch's
reserved memory), and the fraction of the compute floor (167 TFLOP per forward at 1024^2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image, ImageStat  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.engine.workers.gpus import GpuMonitor  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

FORWARD_TFLOP = 167.0
PEAK_TFLOPS = 790.0
log = logging.getLogger("bench")
MODES = {  # name: (DEVICE_MAP, COMPILE)
    "one-eager": ("cuda:0", "off"),
    "one-compiled": ("cuda:0", "on"),
    "pair-eager": ("cfg-parallel", "off"),
    "pair-compiled": ("cfg-parallel", "on"),
    "replicas-eager": ("replicas", "off"),
    "pairs-throughput": ("cfg-parallel", "off"),
    "app": ("cfg-parallel", "on"),
}


def finite_check(pipe, spec) -> None:
    """Worker hook: fail the job if a transformer output (proj_out, where real work ends) is not
    finite. The flag stays on the GPU (no sync per forward) and is read when the VAE decodes."""
    import torch

    state = {"ok": None}

    def after_proj(module, args, output):
        ok = torch.isfinite(output).all()
        state["ok"] = ok if state["ok"] is None else state["ok"] & ok

    def before_decode(module, args):
        if state["ok"] is not None and not bool(state["ok"]):
            state["ok"] = None
            raise RuntimeError("non-finite transformer output: the benchmark would be flattered")
        if not bool(torch.isfinite(args[0]).all()):
            raise RuntimeError("non-finite latents before decoding")
        state["ok"] = None

    for transformer in (pipe.transformer, *getattr(pipe, "imgedit_fast_copies", ())):  # FAST_QUANTIZE's copies too
        transformer.proj_out.register_forward_hook(after_proj)
    pipe.vae.decoder.register_forward_pre_hook(before_decode)


def reference_image(size: int) -> Image.Image:
    """A deterministic, non-flat test picture."""
    image = Image.new("RGB", (size, size))
    image.putdata([((x * 255) // size, (y * 255) // size, ((x ^ y) * 255) // size)
                   for y in range(size) for x in range(size)])
    return image


def one_gpu_parser(doc: str, steps: int, repeats: int) -> argparse.ArgumentParser:
    """The options every one-GPU manager benchmark takes (bench_mask, bench_enhance, bench_cache)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 64x64")
    return parser


def one_gpu_settings(args, tiny_steps: int, kind: str = "plus", **env) -> tuple[object, int, int]:
    """(settings, size, steps): the real-size random checkpoint of `kind` (imgedit.model.demo_checkpoint) on
    cuda:0 (built once at --ckpt), or the tiny one on the CPU with --tiny; COMPILE off, ENCODE_CACHE 0, plus
    `env`."""
    import tempfile

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tiny:
        ckpt = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind=kind)
        device_map, size, steps = "cpu", 64, tiny_steps
    else:
        ckpt = Path(args.ckpt)
        if not (ckpt / "model_index.json").is_file():
            build_checkpoint(ckpt, kind=kind, size="real")
        device_map, size, steps = "cuda:0", args.size, args.steps
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": device_map, "COMPILE": "off",
                              "ENCODE_CACHE": "0", "LOG_LEVEL": "INFO", **env})
    return settings, size, steps



def write_results(out: dict, summary: dict, path: str) -> None:
    """Print the summary; the whole run (summary included) to `path` as JSON when given."""
    out["summary"] = summary
    print(json.dumps(summary, indent=2))
    if path:
        Path(path).write_text(json.dumps(out, indent=2))

class StepClock:
    def __init__(self):
        self.times: list[float] = []

    def __call__(self, step: int, total: int) -> None:
        self.times.append(time.perf_counter())

    @property
    def per_step(self) -> float:
        """Seconds per step, first step excluded (it holds the prompt encoding and VAE encode)."""
        return (self.times[-1] - self.times[0]) / max(1, len(self.times) - 1)


def contrast(image: Image.Image) -> float:
    return max(ImageStat.Stat(image).stddev)


def request(image, steps, size, seed=0, cfg=4.0) -> EditRequest:
    return EditRequest(images=(image,), prompt="turn the sky into a sunset", seed=seed, num_inference_steps=steps,
                       true_cfg_scale=cfg, width=size[0], height=size[1], source="bench")


def timed(manager, req) -> dict:
    clock = StepClock()
    t0 = time.perf_counter()
    result = manager.edit(req, on_step=clock)
    wall = time.perf_counter() - t0
    if contrast(result.images[0]) < 1.0:
        raise RuntimeError("a flat (black/NaN) image came back")
    end = t0 + wall
    return {"wall_s": round(wall, 3), "worker_s": round(result.seconds, 3), "s_per_step": round(clock.per_step, 4),
            "steps": result.steps, "size": f"{result.width}x{result.height}",
            # where the time outside the steps goes: up to the first step's end, after the last step
            "to_first_step_s": round(clock.times[0] - t0, 3), "after_last_step_s": round(end - clock.times[-1], 3)}


def memory(manager, monitor) -> dict:
    readings = monitor.read(manager.status())
    workers = manager.status().workers
    reserved = {}
    for w in manager.workers:
        reserved[w.name] = w.info.get("memory_reserved_gib")
    return {"gpus": {f"cuda:{r.index}": {"used_gib": round(r.used_mib / 1024, 2),
                                         "workers_gib": round(r.workers_mib / 1024, 2)} for r in readings},
            "reserved_gib_per_rank0": reserved, "pids": [w.pids for w in workers]}


def peak_sampler(monitor, stop: threading.Event, peaks: dict) -> None:
    while not stop.wait(0.2):
        for r in monitor.read():
            key = f"cuda:{r.index}"
            peaks[key] = max(peaks.get(key, 0.0), round(r.used_mib / 1024, 2))


def run_mode(name: str, args, ckpt: Path, image, monitor, workers: str = "local") -> dict:
    device_map, compile_mode = MODES[name]
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": device_map, "COMPILE": compile_mode,
                              "COMPILE_CACHE_DIR": args.cache, "LOG_LEVEL": "INFO", "MAX_STEPS": "200",
                              # every benchmark edits the same picture: no memo, so figures stay comparable
                              "ENCODE_CACHE": "0", "QUEUE_MAX_SIZE": "32", "WORKERS": workers})
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench:finite_check").load(timeout=540)
    out: dict = {"mode": name, "workers": workers, "device_map": device_map, "compile": compile_mode,
                 "plan": manager.plan.describe(),
                 "startup_s": round(time.perf_counter() - t0, 1),
                 "worker_info": {w.name: w.info for w in manager.workers}}
    size = (args.size, args.size)
    stop, peaks = threading.Event(), {}
    sampler = threading.Thread(target=peak_sampler, args=(monitor, stop, peaks), daemon=True)
    sampler.start()
    try:
        out["memory_loaded"] = memory(manager, monitor)
        if name in ("pairs-throughput", "replicas-eager"):
            manager.edit(request(image, 2, size))  # warm every worker once
            manager.edit(request(image, 2, size))
            jobs, results, errors = args.jobs, [], []

            def one(i):
                try:
                    results.append(manager.edit(request(image, args.throughput_steps, size, seed=i)))
                except Exception as exc:  # reported, not hidden
                    errors.append(repr(exc))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(jobs)]
            t1 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t1
            out["throughput"] = {"jobs": jobs, "steps": args.throughput_steps, "wall_s": round(wall, 2),
                                 "images_per_min": round(60 * len(results) / wall, 2), "errors": errors,
                                 "flat_images": sum(contrast(r.images[0]) < 1.0 for r in results)}
        elif name == "app":
            out["app"] = run_app(manager, settings, image, args)
        else:
            if compile_mode == "off":
                manager.edit(request(image, 2, size))  # warm-up (compiled workers warmed up at start)
            out["edit"] = timed(manager, request(image, args.steps, size))
            if args.repeat > 1:  # more timed edits of the same request: the spread says what a difference means
                out["edit_repeats"] = [out["edit"]] + [timed(manager, request(image, args.steps, size))
                                                       for _ in range(args.repeat - 1)]
            if compile_mode == "on":  # a size the warm-up did not see: how long does its first request take?
                new = (1216, 832)
                out["new_size_first"] = timed(manager, request(image, args.short_steps, new, seed=1))
                out["new_size_second"] = timed(manager, request(image, args.short_steps, new, seed=2))
                out["warm_size_short"] = timed(manager, request(image, args.short_steps, size, seed=3))
            if "pair" in name:  # CFG off: the pair runs on one rank
                out["cfg_off"] = timed(manager, request(image, args.short_steps, size, seed=4, cfg=1.0))
            step = out["edit"]["s_per_step"]
            out["floor_fraction"] = round(2 * FORWARD_TFLOP / PEAK_TFLOPS / step / (2 if "pair" in name else 1), 3)
    finally:
        stop.set()
        sampler.join()
        out["peak_used_gib"] = peaks
        manager.close()
    return out


@contextlib.contextmanager
def served(settings, manager):
    """The app's HTTP server (REST + page) on a free local port, in a thread; yields its base URL."""
    import socket

    import uvicorn

    from imgedit.web.app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(settings, manager), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def rest_edit(url: str, png: bytes, form: dict) -> float:
    """One edit through REST; its wall time. Fails on an error or a flat (NaN) image."""
    import base64
    import io

    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/images/edits", data=form, files={"image": ("in.png", png, "image/png")}, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    if image.format != form.get("output_format", "png").upper() or contrast(image) < 1.0:
        raise RuntimeError(f"a flat image, or not the format asked for ({image.format}), came back over REST")
    return round(wall, 3)


def run_app(manager, settings, image, args) -> dict:
    """The same edit through the HTTP server (REST) and straight through the manager."""
    import io

    import httpx

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    form = {"prompt": "turn the sky into a sunset", "size": f"{args.size}x{args.size}", "seed": "0",
            "num_inference_steps": str(args.steps), "true_cfg_scale": "4"}
    with served(settings, manager) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        rest = [rest_edit(url, buf.getvalue(), form) for _ in range(2)]
    direct = [timed(manager, request(image, args.steps, (args.size, args.size))) for _ in range(2)]
    worker = min(d["worker_s"] for d in direct)
    return {"rest_wall_s": rest, "direct": direct,
            "overhead_vs_worker": round(min(rest) / worker - 1, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--cache", default="/tmp/imgedit-compile-cache")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--short-steps", type=int, default=10)
    parser.add_argument("--throughput-steps", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default="")
    parser.add_argument("--workers", default="local", help="local, ray, or both (local,ray): WORKERS for each mode")
    parser.add_argument("--repeat", type=int, default=1, help="timed edits per mode")
    parser.add_argument("--quick", action="store_true",
                        help="one GPU, eager and compiled, 10 steps, 2 timed edits each: "
                             "--modes one-eager,one-compiled --steps 10 --repeat 2 (a check that nothing got slower)")
    args = parser.parse_args()
    if args.quick:
        args.modes, args.steps, args.repeat = "one-eager,one-compiled", 10, 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ckpt = Path(args.ckpt)
    if not (ckpt / "model_index.json").is_file():
        build_checkpoint(ckpt, kind="plus", size="real")
    image = reference_image(args.size)
    monitor = GpuMonitor()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpus": [r.name for r in monitor.read()], "command": " ".join(sys.argv), "results": []}
    runs = [(name, workers) for name in args.modes.split(",") for workers in args.workers.split(",")]
    for name, workers in runs:
        try:
            res = run_mode(name, args, ckpt, image, monitor, workers)
        except Exception as exc:
            log.exception("mode %s (WORKERS=%s) failed", name, workers)
            res = {"mode": name, "workers": workers, "error": repr(exc)}
        report["results"].append(res)
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
