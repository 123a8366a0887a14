"""Benchmark QUANTIZE / OFFLOAD on this machine's GPU with a real-size random-weight checkpoint.

    python benchmarks/bench_quant.py --modes bf16,cap22,cap30,cap46 [--steps 40] [--json out.json]
    python benchmarks/bench_quant.py --modes fp8,fp8-compiled,bf16-compiled --json out2.json
    python benchmarks/bench_quant.py --tiny          # CPU smoke run of the script on the tiny checkpoint

Every mode goes through imgedit's planner, PipelineManager and worker process, as the app does. The
workload: a Plus edit of one 1024x1024 image, true CFG 4, 40 steps, seed 0. `capNN` modes set
MAX_MEMORY=NNGiB (the worker caps torch's allocator there) and QUANTIZE/OFFLOAD=auto, emulating a
24 / 32 / 48 GB card: the planner picks the mode. Reported per mode: the plan, peak memory per GPU
(NVML, whole process, sampled during the edits, after loading), s/step, s/image, and fidelity
against the bf16 run with the same seed: cosine similarity and max abs error of the transformer's
noise prediction (cond and uncond) at several steps, and the PSNR of the final image. Step 0 sees the
same latents and prompt embeddings as bf16 (unless the text encoder is quantized): its figures are
the one-forward error; later steps add the drift of the whole edit.

Caveats, to print next to any figure: the weights are random (trained-like N(0, 0.02)) and lack the
outlier channels of trained weights, which are what makes fp8/int8 lose accuracy: fidelity here is
an upper bound. Random-weight checkpoints are built in bf16 on the GPU before they are quantized and
offloaded, so the cap applies from the end of loading (real checkpoints load part by part).

The bf16 reference (noise predictions and image) is saved to --ref and reused by later runs, so the
modes can be split over several calls; a run without a reference file runs `bf16` first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench import StepClock, contrast, finite_check, peak_sampler, reference_image, request  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.engine.workers.gpus import GpuMonitor  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402

log = logging.getLogger("bench_quant")
RECORD_DIR = "IMGEDIT_BENCH_RECORD_DIR"
RECORD_STEPS = "IMGEDIT_BENCH_RECORD_STEPS"
RECORD_TOKENS = "IMGEDIT_BENCH_RECORD_TOKENS"
_OFF = {"QUANTIZE": "none", "OFFLOAD": "none"}
_AUTO = {"QUANTIZE": "auto", "OFFLOAD": "auto"}
MODES: dict[str, dict[str, str]] = {  # settings per mode (DEVICE_MAP=cuda:0 unless --tiny)
    "bf16": {**_OFF, "COMPILE": "off"},
    "bf16-compiled": {**_OFF, "COMPILE": "on"},
    "fp8": {"QUANTIZE": "fp8", "OFFLOAD": "none", "COMPILE": "off"},  # img_mlp kept bf16 (QUANTIZE_SKIP)
    "fp8-compiled": {"QUANTIZE": "fp8", "OFFLOAD": "none", "COMPILE": "on"},
    "fp8-all": {"QUANTIZE": "fp8", "QUANTIZE_SKIP": "", "OFFLOAD": "none", "COMPILE": "off"},
    "fp8-all-compiled": {"QUANTIZE": "fp8", "QUANTIZE_SKIP": "", "OFFLOAD": "none", "COMPILE": "on"},
    "int8": {"QUANTIZE": "int8", "OFFLOAD": "none", "COMPILE": "off"},
    "int8-compiled": {"QUANTIZE": "int8", "OFFLOAD": "none", "COMPILE": "on"},
    "bf16-batched": {**_OFF, "BATCH_CFG": "on", "COMPILE": "off"},  # what batching CFG costs with every block resident
    "cap22": {**_AUTO, "MAX_MEMORY": "22GiB", "COMPILE": "off"},  # a 24 GB card (BATCH_CFG=auto: on, blocks stream)
    "cap22-unbatched": {**_AUTO, "MAX_MEMORY": "22GiB", "BATCH_CFG": "off", "COMPILE": "off"},
    "cap22-compiled": {**_AUTO, "MAX_MEMORY": "22GiB", "COMPILE": "on"},
    "cap22-all": {**_AUTO, "QUANTIZE_SKIP": "", "MAX_MEMORY": "22GiB", "COMPILE": "off"},
    "cap22-nf4": {"QUANTIZE": "nf4", "OFFLOAD": "text_encoder", "MAX_MEMORY": "22GiB", "COMPILE": "off"},
    "nf4": {"QUANTIZE": "nf4", "OFFLOAD": "none", "COMPILE": "off"},  # cap22-nf4's reference: the same, uncapped
    "cap22-bf16": {"QUANTIZE": "none", "OFFLOAD": "text_encoder,blocks", "MAX_MEMORY": "22GiB", "COMPILE": "off"},
    "2x24": {**_AUTO, "MAX_MEMORY": "22GiB", "DEVICE_MAP": "auto", "COMPILE": "off"},  # two 24 GB cards (2 GPUs)
    "cap30": {**_AUTO, "MAX_MEMORY": "30GiB", "COMPILE": "off"},  # a 32 GB card
    "cap46": {**_AUTO, "MAX_MEMORY": "46GiB", "COMPILE": "off"},  # a 48 GB card
}
# what --tiny runs on the CPU (fp8 and offload are refused there)
TINY_MODES = ("bf16", "bf16-batched", "int8", "cap22-nf4")


# ---- worker side ----

def record(pipe, spec) -> None:
    """Worker hook: the finite check of bench.py, plus the transformer's output (the noise
    prediction, image tokens only) at the steps listed in IMGEDIT_BENCH_RECORD_STEPS, saved when the
    VAE decodes. Forwards alternate cond, uncond within a step (true CFG)."""
    import torch

    finite_check(pipe, spec)
    folder = os.environ[RECORD_DIR]
    steps = {int(s) for s in os.environ[RECORD_STEPS].split(",")}
    tokens = int(os.environ[RECORD_TOKENS])
    state: dict = {"n": 0, "saved": {}}

    def after_proj(module, args, output):
        # BATCH_CFG runs cond and uncond as one forward of batch 2 (the benchmark edits one image)
        for part in (output[:1], output[1:]) if output.shape[0] == 2 else (output,):
            step, branch = divmod(state["n"], 2)
            state["n"] += 1
            if step in steps:
                state["saved"][f"{step}.{'cond' if branch == 0 else 'uncond'}"] = part[:, :tokens].float().cpu()

    def before_decode(module, args):
        torch.save(state["saved"], os.path.join(folder, "last.pt"))
        state["n"], state["saved"] = 0, {}

    def after_decode(module, args, output):  # the decode is the job's last GPU work: its peaks, then reset
        if torch.cuda.is_available():
            log.info("torch peak this job: allocated %.2f GiB, reserved %.2f GiB",
                     torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)
            torch.cuda.reset_peak_memory_stats()

    pipe.transformer.proj_out.register_forward_hook(after_proj)
    pipe.vae.decoder.register_forward_pre_hook(before_decode)
    pipe.vae.decoder.register_forward_hook(after_decode)


# ---- measuring ----

def fidelity(ref: dict, got: dict) -> dict:
    import torch

    out = {}
    for key, a in ref.items():
        b = got.get(key)
        if b is None or b.shape != a.shape:
            out[key] = "missing"
            continue
        cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
        out[key] = {"cosine": round(float(cos), 5), "max_abs_err": round(float((a - b).abs().max()), 4),
                    "ref_max_abs": round(float(a.abs().max()), 4)}
    return out


def psnr(a, b) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else round(10 * np.log10(255.0**2 / mse), 2)


def edit(manager, image, steps: int, size: int, folder: Path) -> tuple[dict, object, dict]:
    import torch

    clock = StepClock()
    t0 = time.perf_counter()
    result = manager.edit(request(image, steps, (size, size), seed=0), on_step=clock)
    wall = time.perf_counter() - t0
    if contrast(result.images[0]) < 1.0:
        raise RuntimeError("a flat (black/NaN) image came back")
    timing = {"s_per_image": round(wall, 3), "worker_s": round(result.seconds, 3),
              "s_per_step": round(clock.per_step, 4), "to_first_step_s": round(clock.times[0] - t0, 3)}
    return timing, result.images[0], torch.load(folder / "last.pt")


def run_mode(name: str, args, ckpt: Path, image, monitor, folder: Path, ref) -> tuple[dict, object, dict]:
    env = {"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu" if args.tiny else "cuda:0",
           "COMPILE_CACHE_DIR": args.cache, "LOG_LEVEL": "INFO", "MAX_STEPS": "200", "ENCODE_CACHE": "0",
           **MODES[name]}
    if args.skip is not None and "QUANTIZE_SKIP" not in MODES[name]:
        env["QUANTIZE_SKIP"] = args.skip  # another layer set kept in bf16 (the -all modes keep none)
    if args.tiny:
        env.pop("MAX_MEMORY", None)
        env["OFFLOAD"] = "none"  # the CPU has nothing to offload to
    t0 = time.perf_counter()
    manager = PipelineManager(load_settings(env), worker_hook="bench_quant:record",
                              warmup_sizes=((args.size, args.size),)).load(timeout=900)
    out: dict = {"mode": name, "settings": {k: v for k, v in env.items() if k != "QWEN_MODEL_DIR"},
                 "plan": manager.plan.describe(),
                 "startup_s": round(time.perf_counter() - t0, 1),
                 "worker_info": {w.name: w.info for w in manager.workers}}
    stop, peaks = threading.Event(), {}
    sampler = threading.Thread(target=peak_sampler, args=(monitor, stop, peaks), daemon=True)
    sampler.start()
    try:
        if MODES[name]["COMPILE"] == "off":
            manager.edit(request(image, 2, (args.size, args.size)))  # warm-up (compiled ones warm up at start)
        out["edit"], picture, noise = edit(manager, image, args.steps, args.size, folder)
    finally:
        stop.set()
        sampler.join()
        out["peak_used_gib"] = peaks  # after loading: the edits only
        manager.close()
    if ref is not None:
        out["fidelity_vs_bf16"] = fidelity(ref["noise"], noise)
        out["psnr_vs_bf16_db"] = psnr(picture, ref["image"])
    return out, picture, noise


def summarize(results: list[dict]) -> list[str]:
    by = {r["mode"]: r for r in results if "edit" in r}
    lines = []
    for name, r in by.items():
        step = r["edit"]["s_per_step"]
        ratios = [f"{by[b]['edit']['s_per_step'] / step:.2f}x the speed of {b}" for b in ("bf16", "bf16-compiled")
                  if b in by and b != name]
        cosines = [v["cosine"] for v in r.get("fidelity_vs_bf16", {}).values() if isinstance(v, dict)]
        fid = (f"cos min {min(cosines):.4f}, PSNR {r['psnr_vs_bf16_db']} dB" if cosines else "")
        peak = ", ".join(f"{d} {g:.1f} GiB" for d, g in r["peak_used_gib"].items()) or "n/a"
        lines.append(f"{name}: {step:.3f} s/step ({', '.join(ratios) or '-'}), {r['edit']['s_per_image']:.1f} "
                     f"s/image, peak {peak}; {fid}")
    for capped, base in (("cap22", "bf16"), ("cap22-unbatched", "bf16"), ("cap22-compiled", "bf16-compiled"),
                         ("cap22-all", "fp8-all")):
        if capped in by and base in by:
            ratio = by[capped]["edit"]["s_per_step"] / by[base]["edit"]["s_per_step"]
            lines.append(f"{capped} vs {base} uncapped: {ratio:.2f}x per step (target <= 1.5x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--cache", default="/tmp/imgedit-compile-cache")
    parser.add_argument("--ref", default="/tmp/imgedit-quant-ref.pt", help="bf16 reference: read, or written")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--record-steps", default="0,10,20,30,39")
    parser.add_argument("--modes", default="bf16,cap22,cap30,cap46")
    parser.add_argument("--skip", default=None, help="QUANTIZE_SKIP for the modes that do not set it "
                        "(default: the setting's default, img_mlp), e.g. img_mlp,txt_mlp")
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny checkpoint")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    if args.tiny:
        args.ckpt = str(Path(tempfile.mkdtemp(prefix="imgedit-tiny-")) / "plus")
        args.ref = str(Path(args.ckpt).parent / "ref.pt")
        args.steps, args.size, args.record_steps = min(args.steps, 4), 64, "0,1,3"
        args.modes = ",".join(TINY_MODES)
        build_checkpoint(args.ckpt, kind="plus")
    ckpt = Path(args.ckpt)
    if not (ckpt / "model_index.json").is_file():
        build_checkpoint(ckpt, kind="plus", size="real")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    folder = Path(tempfile.mkdtemp(prefix="imgedit-record-"))
    os.environ[RECORD_DIR] = str(folder)  # worker processes inherit these
    os.environ[RECORD_STEPS] = args.record_steps
    os.environ[RECORD_TOKENS] = str((args.size // 16) ** 2)
    image = reference_image(args.size)
    monitor = GpuMonitor()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpus": [r.name for r in monitor.read()], "command": " ".join(sys.argv),
              "note": "random trained-like weights: no real outlier channels, fidelity is an upper bound",
              "results": []}
    ref = torch.load(args.ref, weights_only=False) if Path(args.ref).is_file() else None
    modes = args.modes.split(",")
    if ref is None and "bf16" not in modes:
        modes.insert(0, "bf16")
    if "bf16" in modes:  # the reference first, so the others compare against this run's weights
        modes.remove("bf16")
        modes.insert(0, "bf16")
    for name in modes:
        try:
            res, picture, noise = run_mode(name, args, ckpt, image, monitor, folder, ref if name != "bf16" else None)
            if name == "bf16":
                ref = {"noise": noise, "image": np.asarray(picture)}
                torch.save(ref, args.ref)
        except Exception as exc:
            log.exception("mode %s failed", name)
            res = {"mode": name, "error": repr(exc)}
        report["results"].append(res)
        print(json.dumps(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    report["summary"] = summarize(report["results"])
    print("\n".join(report["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if any("error" in r for r in report["results"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
