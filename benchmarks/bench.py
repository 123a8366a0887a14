"""Benchmark every placement on the GPUs of this machine with a real-size random-weight checkpoint.

    python benchmarks/bench.py [--steps 40] [--quick] [--modes baseline,cuda:0,balanced,split,replicas]
                               [--ckpt /tmp/qwen-real] [--json out.json]

Workload: a 1024x1024 edit, Plus pipeline, one reference image, true CFG 4, after a warm-up.
`baseline` is bare diffusers: the pipeline on one GPU, called directly. Every other mode goes through
imgedit's PipelineManager exactly as the app does. `split` caps each GPU (MAX_MEMORY, default
22GiB: what a 24 GB card leaves) so that the transformer must be split by blocks. Reports seconds
per step and per image, images/min, per-GPU peak memory, the ratio to the baseline and the
fraction of the compute floor (167 TFLOP per transformer forward at this size, 790 TFLOP/s per GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from imgedit import loader  # noqa: E402
from imgedit.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.encoding import install_token_type_fix  # noqa: E402
from imgedit.jobs import EditRequest  # noqa: E402
from imgedit.manager import PipelineManager  # noqa: E402
from imgedit.placement import Placement, WorkerPlan  # noqa: E402
from imgedit.settings import load_settings  # noqa: E402

FORWARD_TFLOP = 167.0
PEAK_TFLOPS = 790.0
GIB = 1024**3
log = logging.getLogger("bench")


def reference_image(size: int) -> Image.Image:
    """A deterministic, non-flat test picture."""
    x = torch.linspace(0, 1, size)
    r = (x[None, :] * 255).expand(size, size)
    g = (x[:, None] * 255).expand(size, size)
    b = ((x[None, :] * x[:, None]) * 255)
    return Image.fromarray(torch.stack([r, g, b], -1).to(torch.uint8).numpy())


def reset_peaks() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)


def peaks() -> dict[str, float]:
    return {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / GIB, 2) for i in range(torch.cuda.device_count())}


class StepClock:
    """Seconds per denoising step, from the step callbacks (first step excluded: it holds the prompt
    encoding and VAE work)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, step: int, total: int) -> None:
        self.times.append(time.perf_counter())

    @property
    def per_step(self) -> float:
        return (self.times[-1] - self.times[0]) / max(1, len(self.times) - 1)


def run_manager(mode: str, args, ckpt: Path, image: Image.Image) -> dict:
    env = {"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": mode, "LOG_LEVEL": "INFO"}
    if mode == "split":
        env.update(DEVICE_MAP="balanced", MAX_MEMORY=args.split_cap)
    settings = load_settings(env)
    t0 = time.perf_counter()
    manager = PipelineManager(settings).load()
    load_s = time.perf_counter() - t0
    placement = {w.name: w.plan.components and {n: p.describe() for n, p in w.plan.components.items()}
                 for w in manager.workers}
    torch.cuda.synchronize()
    weights = {f"cuda:{i}": round(torch.cuda.memory_allocated(i) / GIB, 2) for i in range(torch.cuda.device_count())}
    n_inputs = (1, 2, 3) if args.check_inputs else (1,)
    for n in n_inputs:  # warm-up, and the 1-3 input images device check
        manager.edit(EditRequest(images=(image,) * n, prompt="warm up", seed=0, num_inference_steps=2,
                                 width=args.size, height=args.size, source="bench"))
    reset_peaks()
    clocks = [StepClock() for _ in manager.workers]
    results, errors = [], []

    def one(i: int) -> None:
        try:
            results.append(manager.edit(
                EditRequest(images=(image,), prompt="turn the sky into a sunset", seed=i,
                            num_inference_steps=args.steps, true_cfg_scale=4.0, width=args.size, height=args.size,
                            source="bench"), on_step=clocks[i]))
        except Exception as exc:  # report, do not hide
            errors.append(repr(exc))

    util: list[float] = []
    done = threading.Event()

    def sample_utilization() -> None:  # how busy the GPUs are while the jobs run
        while not done.wait(0.5):
            util.extend(torch.cuda.utilization(i) for i in range(torch.cuda.device_count()))

    sampler = threading.Thread(target=sample_utilization, daemon=True)
    sampler.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(manager.workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu_cores = (time.process_time() - cpu0) / wall  # > ~1 means more than the GIL's one thread ran
    done.set()
    torch.cuda.synchronize()
    out = {
        "mode": mode if mode != "split" else f"balanced, MAX_MEMORY={args.split_cap}",
        "plan": manager.plan.describe(), "placement": placement, "workers": len(manager.workers),
        "load_s": round(load_s, 1), "weights_gib": weights, "peak_gib": peaks(),
        "s_per_step": round(sum(c.per_step for c in clocks) / len(clocks), 4),
        "s_per_image": round(sum(r.seconds for r in results) / max(1, len(results)), 2),
        "images_per_min": round(60 * len(results) / wall, 2), "errors": errors,
        "process_cpu_cores": round(cpu_cores, 2),
        "gpu_utilization_mean": round(sum(util) / len(util), 1) if util else None,
    }
    for worker in manager.workers:  # drop the pipelines so the next mode starts on empty GPUs
        worker.pipe = None
    results.clear()
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_baseline(args, ckpt: Path, image: Image.Image) -> dict:
    """Bare diffusers: the pipeline on cuda:0, called directly (same random components)."""
    checkpoint = loader.open_checkpoint(str(ckpt))
    plan = WorkerPlan("baseline", {n: Placement("cuda:0") for n in loader.MODEL_COMPONENTS})
    t0 = time.perf_counter()
    pipe = loader.load_pipeline(checkpoint, plan, torch.bfloat16)
    if args.fix:
        install_token_type_fix(pipe.text_encoder)
    load_s = time.perf_counter() - t0
    kwargs = dict(image=[image], prompt="turn the sky into a sunset", negative_prompt=" ", true_cfg_scale=4.0,
                  width=args.size, height=args.size)
    pipe(num_inference_steps=2, generator=torch.Generator().manual_seed(0), **kwargs)
    reset_peaks()
    clock = StepClock()

    def cb(p, step, t, kw):
        clock(step + 1, args.steps)
        return {}

    t0 = time.perf_counter()
    pipe(num_inference_steps=args.steps, generator=torch.Generator().manual_seed(0), callback_on_step_end=cb,
         callback_on_step_end_tensor_inputs=[], **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"mode": "baseline (bare diffusers, cuda:0)", "load_s": round(load_s, 1), "peak_gib": peaks(),
           "s_per_step": round(clock.per_step, 4), "s_per_image": round(wall, 2),
           "images_per_min": round(60 / wall, 2), "errors": []}
    del pipe
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="8 steps: a placement check, not a benchmark")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--modes", default="baseline,cuda:0,balanced,split,replicas")
    parser.add_argument("--split-cap", default="auto",
                        help="MAX_MEMORY for the split mode; auto: 31GiB each on 2 GPUs, 22GiB each on 4+")
    parser.add_argument("--check-inputs", action="store_true", help="warm up with 1, 2 and 3 input images")
    parser.add_argument("--no-fix", dest="fix", action="store_false", help="baseline without the encoding fix")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.quick:
        args.steps = 8
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ckpt = Path(args.ckpt)
    if not (ckpt / "model_index.json").is_file():
        build_checkpoint(ckpt, kind="plus", size="real")
    image = reference_image(args.size)
    if args.split_cap == "auto":
        args.split_cap = "31GiB" if torch.cuda.device_count() <= 2 else "22GiB"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpus": gpus,
              "torch": torch.__version__, "command": " ".join(sys.argv), "steps": args.steps, "size": args.size,
              "results": []}
    import diffusers
    import transformers

    report["versions"] = {"diffusers": diffusers.__version__, "transformers": transformers.__version__}
    for mode in args.modes.split(","):
        if mode == "replicas" and len(gpus) < 2:
            continue
        try:
            res = run_baseline(args, ckpt, image) if mode == "baseline" else run_manager(mode, args, ckpt, image)
        except Exception as exc:
            log.exception("mode %s failed", mode)
            res = {"mode": mode, "errors": [repr(exc)]}
        report["results"].append(res)
        print(json.dumps(res), flush=True)
    base = next((r for r in report["results"] if r["mode"].startswith("baseline") and "s_per_step" in r), None)
    for r in report["results"]:
        if "s_per_step" not in r:
            continue
        r["floor_fraction"] = round(2 * FORWARD_TFLOP / PEAK_TFLOPS / r["s_per_step"], 3)
        if base:
            r["step_vs_baseline"] = round(r["s_per_step"] / base["s_per_step"], 3)
            r["throughput_vs_baseline"] = round(r["images_per_min"] / base["images_per_min"], 3)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
