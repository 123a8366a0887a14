"""Where a 4-step CFG-off edit spends the time outside its denoising loop: a timeline per rank.

    python benchmarks/bench_outside.py [--modes one,pair] [--compile off] [--repeats 3] [--json out.json]
    python benchmarks/bench_outside.py --tiny      # CPU smoke run (tiny model, 64x64, one worker)

Each mode is one PipelineManager on the real-size random checkpoint (trained-like init): `one` on cuda:0, `pair`
a CFG pair with PAIR_ULYSSES=on (a CFG-off job splits every forward over both GPUs). Jobs: 4 steps, CFG off, the
default scheduler, a 1024x1024 input and output, ENCODE_CACHE=0, one warm-up job then seeds 1..N. The worker hook
(`phases`) stamps, on every rank with the wall clock (time.time(), comparable across processes), the job's
arrival in the runner, the pipeline call, prompt encoding, the input resizes, VAE encode, every transformer
forward, VAE decode and postprocessing; each stamp syncs the GPU first, so a stamp is where the GPU work ends
(the syncs cost a little, the same in every mode). The server side stamps submit and return. The finite check
(bench.finite_check) is installed too: the latents before decoding must be finite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import contrast, finite_check, reference_image, write_results  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("bench_outside")
STAMPS = Path(tempfile.gettempdir()) / "imgedit-phases"
SWITCH = STAMPS / "on"  # the hook stamps while this file exists (bench_fast_fp8 times its runs without stamps)
MODES = {"one": {"DEVICE_MAP": "cuda:0"}, "pair": {"DEVICE_MAP": "cfg-parallel", "PAIR_ULYSSES": "on"}}


def phases(pipe, spec) -> None:
    """Worker hook: the finite check, then wall-clock stamps of each phase into STAMPS/rank<r>.jsonl."""
    import functools

    import torch

    import imgedit.runtime.runner as runner_module

    finite_check(pipe, spec)
    cuda = torch.cuda.is_available()
    if os.environ.get("BENCH_THREADS"):  # a variant: this worker's intra-op CPU threads
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    if os.environ.get("BENCH_CUDNN") == "1":  # a variant: cuDNN picks its convolution kernels by timing them
        torch.backends.cudnn.benchmark = True
    if os.environ.get("BENCH_PIXELS") == "0":  # a variant: the processor's own pre- and postprocessing
        vars(pipe.image_processor).pop("preprocess", None)
        vars(pipe.image_processor).pop("postprocess", None)
    log.info("rank %d: %d CPU threads (%d CPUs allowed), cudnn.benchmark %s, pixels on the %s", spec.rank,
             torch.get_num_threads(), len(os.sched_getaffinity(0)), torch.backends.cudnn.benchmark,
             "GPU" if "postprocess" in vars(pipe.image_processor) else "CPU")
    out = (STAMPS / f"rank{spec.rank}.jsonl").open("a", buffering=1)

    def mark(name: str) -> None:
        if not SWITCH.exists():
            return
        if cuda:
            torch.cuda.synchronize()
        out.write(json.dumps({"rank": spec.rank, "name": name, "t": time.time()}) + "\n")

    def wrap(owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def stamped(*args, **kwargs):
            mark(name + ">")
            try:
                return original(*args, **kwargs)
            finally:
                mark(name + "<")

        setattr(owner, attribute, stamped)

    wrap(runner_module.Runner, "run", "job")  # the class: the runner already exists
    wrap(type(pipe), "__call__", "pipe")  # a worker process of its own: patching the class touches nothing else
    wrap(pipe, "encode_prompt", "prompt")
    wrap(pipe.image_processor, "resize", "resize")
    wrap(pipe.image_processor, "preprocess", "preprocess")
    wrap(type(pipe.processor), "__call__", "processor")
    wrap(pipe.vae, "encode", "vae_encode")
    wrap(pipe.vae, "decode", "vae_decode")
    wrap(pipe.image_processor, "postprocess", "postprocess")
    for name, module in (("text_encoder", pipe.text_encoder),
                         ("visual", getattr(getattr(pipe.text_encoder, "model", None), "visual", None))):
        if module is not None:
            module.register_forward_pre_hook(lambda module, args, name=name: mark(name + ">"))
            module.register_forward_hook(lambda module, args, output, name=name: mark(name + "<"))
    for transformer in (pipe.transformer, *getattr(pipe, "imgedit_fast_copies", ())):  # FAST_QUANTIZE's copies too
        transformer.register_forward_pre_hook(lambda module, args: mark("forward>"))
        transformer.register_forward_hook(lambda module, args, output: mark("forward<"))


def timeline(submitted: float, returned: float) -> dict:
    """Each rank's stamps of the last job, in seconds after submit: phases as [start, end]."""
    ranks: dict[int, dict] = {}
    for path in sorted(STAMPS.glob("rank*.jsonl")):
        stamps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        stamps = [s for s in stamps if s["t"] >= submitted - 0.01]  # a rank may stamp after the result is back
        phases_: dict[str, list] = {}
        forwards = []
        for s in stamps:
            name, edge, t = s["name"][:-1], s["name"][-1], round(s["t"] - submitted, 4)
            if name == "forward":
                if edge == ">":
                    forwards.append([t, None])
                elif forwards:
                    forwards[-1][1] = t
                continue
            key = name
            n = 2
            while edge == ">" and key in phases_:
                key, n = f"{name}{n}", n + 1
            if edge == ">":
                phases_[key] = [t, None]
            else:
                open_ = [k for k in phases_ if re.fullmatch(re.escape(name) + r"\d*", k) and phases_[k][1] is None]
                if open_:
                    phases_[open_[-1]][1] = t
        if stamps:
            ranks[stamps[0]["rank"]] = {"phases": phases_, "forwards": forwards}
    return {"returned": round(returned - submitted, 4), "ranks": ranks}


def stamped_edit(manager, req: EditRequest) -> dict:
    """One job with every rank stamping its phases (the hook's switch on): its timeline. The image must have
    contrast (not a flat, NaN-made one)."""
    for path in STAMPS.glob("rank*.jsonl"):
        path.write_text("")
    submitted = time.time()
    result = manager.edit(req)
    returned = time.time()
    if contrast(result.images[0]) < 1.0:
        raise RuntimeError("a flat (black/NaN) image came back")
    time.sleep(0.2)  # the ranks' last stamps (rank 1 may still be decoding) reach the files
    return timeline(submitted, returned)


def run_mode(name: str, variant: str, args, ckpt: Path) -> dict:
    extra = dict(pair.split("=", 1) for pair in variant.split(",") if "=" in pair)
    for key in ("BENCH_THREADS", "BENCH_CUDNN", "BENCH_PIXELS"):  # the hook's: worker processes read this one's
        os.environ.pop(key, None)
        if key in extra:
            os.environ[key] = extra.pop(key)
    env = {"QWEN_MODEL_DIR": str(ckpt), "COMPILE": args.compile, "ENCODE_CACHE": "0", "LOG_LEVEL": "INFO",
           **MODES[name], **extra}  # the rest are settings (WORKER_THREADS=..., PAIR_ULYSSES=...)
    if args.tiny:
        env["DEVICE_MAP"] = "cpu"
    size = 64 if args.tiny else args.size
    t0 = time.perf_counter()
    manager = PipelineManager(load_settings(env), worker_hook="bench_outside:phases",
                              warmup_sizes=((size, size),) if args.compile == "on" else ()).load(timeout=1500)
    startup = round(time.perf_counter() - t0, 1)
    image = reference_image(size)
    runs = []
    try:
        for seed in range(args.repeats + 1):
            req = EditRequest(images=(image,), prompt="turn the sky into a sunset", seed=seed, width=size, height=size,
                              num_inference_steps=4, true_cfg_scale=1.0, source="bench")
            run = stamped_edit(manager, req)
            log.info("%s seed %d: %s", name, seed, json.dumps(run))
            if seed:
                runs.append(run)
    finally:
        manager.close()
    return {"mode": name, "variant": variant, "env": env, "startup_s": startup, "runs": runs,
            "wall_s": statistics.median(r["returned"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, choices=range(1, 100), metavar="N")
    parser.add_argument("--modes", default="one,pair")
    parser.add_argument("--compile", default="off", choices=("off", "on"))
    parser.add_argument("--variants", default="base", help="';'-separated, each [MODE:]'base' or KEY=V,KEY=V: the "
                        "hook's BENCH_THREADS (PyTorch CPU threads; WORKER_THREADS=auto otherwise), BENCH_CUDNN=1, "
                        "BENCH_PIXELS=0, or settings (WORKER_THREADS=32, ...)")
    parser.add_argument("--json", default="")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    STAMPS.mkdir(exist_ok=True)
    SWITCH.touch()
    if args.tiny:
        ckpt, args.modes = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="plus"), "one"
    else:
        ckpt = Path(args.ckpt)
        if not (ckpt / "model_index.json").is_file():
            build_checkpoint(ckpt, kind="plus", size="real")
    rows = []
    for variant in args.variants.split(";"):  # MODE:VARIANT runs that mode only
        mode, _, rest = variant.partition(":")
        mode, variant = (mode, rest) if rest and all(m.strip() in MODES for m in mode.split(",")) else ("", variant)
        rows += [run_mode(m.strip(), variant.strip(), args, ckpt) for m in (mode or args.modes).split(",")]
    out = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    write_results(out, {f'{r["mode"]} {r["variant"]}': {"wall_s": r["wall_s"], "startup_s": r["startup_s"],
                                    "last": r["runs"][-1]} for r in rows}, args.json)


if __name__ == "__main__":
    main()
