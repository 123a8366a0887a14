"""Where a compiled Qwen-Image-2.1 denoising step spends its time: torch.profiler over the cached steps
(the steps after the prefill, compiled as the workers compile them: imgedit.runtime.compile21 with
imgedit.model.attention21's processor), on one real-size random-weight transformer.

Per run: the step's wall time without the profiler (mean of the later steps), then one profiled call whose
trace covers only the later steps (started and stopped in the step callback). Printed: the GPU time per step by
kind of kernel (GEMM, attention, inductor's fused Triton kernels, copies, the rest), the GPU's idle share of the
step (no device work on any stream) and its idle stretches named by the kernel that ended each, the CPU ops that
wait for the GPU (syncs per step), the GEMMs' achieved TFLOP/s (FLOPs counted by the profiler on
aten::mm/addmm), and the top kernels.
Every image must be finite.

--resident N streams the other blocks from pinned CPU memory as a capped plan does (imgedit.runtime.offload.stream,
the worker's code; streamed blocks run eager, so use it with --eager as the 16 GB row runs), and the summary adds
the host-to-device copies' time and how much of it ran while a kernel computed (overlap 1 = hidden, 0 = serial).
--no-kv-cache calls the pipeline with use_kv_cache=False, as a capped worker does (imgedit.runtime.prefix_cache).
--split N runs N processes, one per GPU, each with the target split over them as `DEVICE_MAP=ulysses` runs 2.1
(imgedit.runtime.split21, NCCL; gloo on the CPU); rank 0 profiles, and the summary adds the exchanges' kernels
(NCCL) and how much of their time ran while another kernel computed.

    python3 benchmarks/profile_21_step.py --device cuda --size real --steps 12 --json /tmp/prof21.json
    python3 benchmarks/profile_21_step.py --device cuda --size real --eager --resident 13 --no-kv-cache --refs 0
    python3 benchmarks/profile_21_step.py --device cuda --size real --split 2 --refs 0,1   # 2 GPUs
    python3 benchmarks/profile_21_step.py --device cuda --size real --split 2 --refs 0 --graphs

--graphs then times the cached step's 60 blocks captured as one CUDA graph against the same blocks launched
one by one (graph_probe): the idle time CUDA graphs would take off a step, and whether the capture works with
the split's gathers inside.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_21_compile import call, load, model_arguments, square_side  # noqa: E402

KINDS = (  # first match wins; names as cuBLAS, cuDNN, flash and inductor give their kernels (inductor names a
    # fused kernel after the ops it fused: "triton_..._scaled_dot_product_..." is the Q/K norm and RoPE before it)
    ("nccl", ("nccl",)),
    ("triton", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "matmul")),
    ("copy", ("memcpy", "memset", "copy_", "copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profiled_call(pipe, args, req):
    """One call, the profiler running from the end of step 1 to the end of the last step."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, with_flops=True, record_shapes=True)
    marks = {}

    def step_end(pipe_, step, t, kwargs):
        if step == 1:
            if cuda:  # only at the trace's ends: a wait every step would add idle GPU time of its own (call()
                # waits only when it times the steps)
                torch.cuda.synchronize()
            prof.start()
            marks["start"] = time.perf_counter()
        elif step == args.steps - 1:
            if cuda:
                torch.cuda.synchronize()
            marks["end"] = time.perf_counter()
            prof.stop()
        return {}

    out = call(pipe, args, req, callback=step_end)
    return prof, out, marks["end"] - marks["start"]


def graph_probe(pipe, args, req, reps: int = 20) -> dict:
    """The later steps' blocks captured as one CUDA graph, against the same blocks launched one by one: what
    CUDA graphs would take off a cached step (the GPU's idle time between the blocks' kernels; with --split
    the gathers are inside the graph, every rank capturing in step). One request runs first, and its last
    cached step's inputs (block 0's keyword arguments and the prefix cache) are kept as the static inputs."""
    import time

    import torch

    transformer = pipe.transformer
    blocks = transformer.transformer_blocks
    seen: dict = {}

    def grab_cache(module, args_, kwargs):
        if kwargs.get("kv_cache_mode") == "cached":
            seen["kv_cache"] = kwargs["kv_cache"]

    def grab_block(module, args_, kwargs):
        if kwargs.get("kv_cache_mode") == "cached":
            seen["block"] = dict(kwargs)

    hooks = [transformer.register_forward_pre_hook(grab_cache, with_kwargs=True),
             blocks[0].register_forward_pre_hook(grab_block, with_kwargs=True)]
    try:
        call(pipe, args, req)
    finally:
        for hook in hooks:
            hook.remove()
    kwargs, cache = seen["block"], seen["kv_cache"]
    static = kwargs["hidden_states"].clone()

    def blocks_forward():
        hidden = static
        for i, block in enumerate(blocks):
            hidden = block(**{**kwargs, "hidden_states": hidden, "layer_cache": cache.get_layer(i)})
        return hidden

    cuda = args.device == "cuda"

    def timed(fn):
        if not cuda:
            started = time.perf_counter()
            for _ in range(reps):
                out = fn()
            return (time.perf_counter() - started) * 1e3 / reps, out
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            out = fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps, out

    with torch.inference_mode():
        launched_ms, launched = timed(blocks_forward)
        launched = launched.clone()
        assert torch.isfinite(launched).all(), "the blocks' output is not finite"
        if not cuda:  # the inputs' replay checked; nothing to capture
            return dict(launched_ms=round(launched_ms, 3), error="no CUDA graphs on the CPU")
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up on a side stream before capturing, as torch's notes ask
            blocks_forward()
        torch.cuda.current_stream().wait_stream(side)
        try:
            with torch.cuda.graph(graph):
                captured = blocks_forward()
        except Exception as exc:  # noqa: BLE001 - what failed to capture is the finding
            return dict(launched_ms=round(launched_ms, 3), error=f"{type(exc).__name__}: {exc}"[:400])
        replay_ms, _ = timed(graph.replay)
        finite = bool(torch.isfinite(captured).all())
        same = bool(torch.equal(captured, launched))
        assert finite, "the captured blocks' output is not finite"
    return dict(launched_ms=round(launched_ms, 3), replay_ms=round(replay_ms, 3),
                saved_ms=round(launched_ms - replay_ms, 3), same_as_launched=same, finite=finite, reps=reps)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_of(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def spans(prof) -> dict:
    """From the trace's device events (microseconds): the host-to-device copies, the kernels that compute (every
    other copy and memset excluded), how much of the first ran during the second, and the union of all device
    work (the GPU's busy time, streams overlapping counted once)."""
    from torch.autograd import DeviceType

    upload, compute, comm, every = [], [], [], []
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA or evt.name.startswith("## "):
            continue
        span = (evt.time_range.start, evt.time_range.end)
        every.append(span)
        name = evt.name.lower()
        if "memcpy htod" in name:
            upload.append(span)
        elif "nccl" in name:
            comm.append(span)
        elif "memcpy" not in name and "memset" not in name:
            compute.append(span)
    gaps = idle_gaps(prof)
    upload, compute, comm, every = union(upload), union(compute), union(comm), union(every)
    copy_us = sum(b - a for a, b in upload)
    compute_us = sum(b - a for a, b in compute)
    hidden = overlap_of(upload, compute)
    return dict(copy_us=copy_us, compute_us=compute_us, hidden_us=hidden, busy_us=sum(b - a for a, b in every),
                overlap=round(hidden / min(copy_us, compute_us), 3) if copy_us and compute_us else None,
                comm_us=sum(b - a for a, b in comm), comm_hidden_us=overlap_of(comm, compute), gaps=gaps)


GAP_US = 10  # shorter idle stretches are the GPU's own scheduling
SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::repeat_interleave", "cudaStreamSynchronize",
         "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def idle_gaps(prof) -> dict:
    """Where the GPU waited for the CPU: every stretch of GPU time (microseconds) with no device work on any
    stream, over GAP_US, named by the kernel that ended it (the first launched after the CPU caught up or a
    device-to-host wait returned); and the CPU ops that wait for the GPU or launch small copies (SYNCS: count
    and CPU time)."""
    from torch.autograd import DeviceType

    device = sorted((evt.time_range.start, evt.time_range.end, evt.name) for evt in prof.events()
                    if getattr(evt, "device_type", None) == DeviceType.CUDA and not evt.name.startswith("## ")
                    and not evt.name.startswith("nccl:"))
    by_next: dict[str, list[float]] = {}
    reach = None
    for start, end, name in device:
        if reach is not None and start - reach > GAP_US:
            by_next.setdefault(name[:100], []).append(start - reach)
        reach = end if reach is None else max(reach, end)
    syncs: dict[str, list[float]] = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA and evt.name in SYNCS:
            syncs.setdefault(evt.name, []).append(evt.time_range.end - evt.time_range.start)
    top = sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:12]
    return dict(total_us=sum(sum(v) for v in by_next.values()), count=sum(len(v) for v in by_next.values()),
                before=[dict(kernel=k, count=len(v), us=round(sum(v), 1)) for k, v in top],
                syncs={k: dict(count=len(v), us=round(sum(v), 1)) for k, v in sorted(syncs.items())})


def summarise(prof, steps: int, wall_s: float) -> dict:
    from torch.autograd import DeviceType

    kernels, by_kind = {}, {}
    flops = 0.0
    for evt in prof.key_averages():
        # "nccl:<collective>" is c10d's annotation on the device around the NCCL kernel it launched: counted once
        if getattr(evt, "device_type", None) == DeviceType.CUDA and not evt.key.startswith(("## ", "nccl:")):
            us = device_us(evt)
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us
            by_kind[kind_of(evt.key)] = by_kind.get(kind_of(evt.key), 0.0) + us
        elif evt.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm") and evt.flops:
            flops += float(evt.flops)
    found = spans(prof)
    busy = found["busy_us"] / 1e6
    per_step = {k: round(v / 1e6 / steps * 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    gemm_s = by_kind.get("gemm", 0.0) / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return dict(copy_ms_per_step=round(found["copy_us"] / 1e3 / steps, 2),
                compute_ms_per_step=round(found["compute_us"] / 1e3 / steps, 2),
                copy_hidden_ms_per_step=round(found["hidden_us"] / 1e3 / steps, 2), copy_overlap=found["overlap"],
                nccl_ms_per_step=round(found["comm_us"] / 1e3 / steps, 2),
                nccl_hidden_ms_per_step=round(found["comm_hidden_us"] / 1e3 / steps, 2),
                profiled_steps=steps, wall_ms_per_step=round(wall_s / steps * 1e3, 2),
                busy_ms_per_step=round(busy / steps * 1e3, 2), idle_share=round(1 - busy / wall_s, 3),
                ms_per_step_by_kind=per_step,
                gemm_tflops=round(flops / gemm_s / 1e12, 1) if gemm_s and flops else None,
                gemm_tflop_per_step=round(flops / steps / 1e12, 2),
                top_kernels=[dict(name=k[:140], kind=kind_of(k), ms_per_step=round(v / 1e3 / steps, 3))
                             for k, v in top],
                idle_ms_per_step=round(found["gaps"]["total_us"] / 1e3 / steps, 2),
                idle_gaps_per_step=round(found["gaps"]["count"] / steps, 1),
                idle_before=[dict(kernel=g["kernel"], count_per_step=round(g["count"] / steps, 1),
                                  ms_per_step=round(g["us"] / 1e3 / steps, 3)) for g in found["gaps"]["before"]],
                syncs_per_step={k: dict(count=round(v["count"] / steps, 1), cpu_ms=round(v["us"] / 1e3 / steps, 3))
                                for k, v in found["gaps"]["syncs"].items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--refs", default="0,1", help="reference counts to profile, e.g. 0,1,5")
    parser.add_argument("--eager", action="store_true", help="profile the eager steps (no compile21)")
    parser.add_argument("--resident", type=int, help="blocks kept on the GPU; the others streamed (a capped plan)")
    parser.add_argument("--no-kv-cache", action="store_true", help="use_kv_cache=False, as a capped worker calls")
    parser.add_argument("--split", type=int, default=1, help="processes (GPUs) splitting the target, as ulysses")
    parser.add_argument("--trace", help="a folder for one Chrome trace per reference count")
    parser.add_argument("--graphs", action="store_true", help="after the profiles (first reference count): "
                        "the cached step's blocks as one CUDA graph against launched one by one (GPU only)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.split > 1:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:  # a free port for the group's rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(run, args=(args, port), nprocs=args.split)
        return 0
    run(0, args)
    return 0


def run(rank: int, args, port: int | None = None) -> None:
    """One process: rank 0 profiles and writes the summary; with --split every rank runs the same calls (the
    exchanges need them all) with its share of the target."""
    side = square_side(args)

    import numpy as np
    import torch

    from imgedit.model import attention21
    from imgedit.runtime import compile21

    if port is not None:
        import torch.distributed as dist

        from imgedit.runtime.split21 import TargetSplit

        if args.device == "cuda":
            torch.cuda.set_device(rank)  # "cuda" below is this rank's GPU
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.split)
    pipe = load(args)
    attention21.install(pipe.transformer, attention21.CHUNK if args.resident is not None else None)
    if not args.eager:  # before the split, as a worker's features install them (Metadata21, SplitTarget)
        compile21.memoize_21_metadata(pipe.transformer)
    if port is not None:
        TargetSplit(rank, args.split).install(pipe.transformer)
    if args.resident is not None:
        from imgedit.planning.plan import MemoryMode
        from imgedit.runtime.offload import stream

        stream(pipe.transformer, args.device, MemoryMode(resident_blocks=args.resident))
    if not args.eager:
        compile21.compile_21(pipe.transformer)
    rows = []
    for k in (int(k) for k in args.refs.split(",")):
        req = dict(words=12, images=k, width=side, height=side, seed=7 + k,
                   pipe_kwargs={"use_kv_cache": False} if args.no_kv_cache else {})
        for _ in range(2):
            call(pipe, args, req)  # the warm-up: compiles this shape
        times = []
        out = call(pipe, args, req, times)
        assert np.isfinite(out).all(), f"{k} references: a non-finite image"
        if rank:
            call(pipe, args, req)  # beside rank 0's profiled call
            continue
        prof, out, wall = profiled_call(pipe, args, req)
        assert np.isfinite(out).all(), f"{k} references, profiled: a non-finite image"
        row = dict(refs=k, step_s_unprofiled=round(times[0][1], 4), **summarise(prof, args.steps - 2, wall))
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace) / f"step21-refs{k}.json"))
        rows.append(row)
        print(json.dumps({key: v for key, v in row.items() if key not in ("top_kernels", "idle_before")}),
              flush=True)
        for gap in row["idle_before"][:8]:
            print(f"  idle {gap['ms_per_step']:7.3f} ms ({gap['count_per_step']} a step) before {gap['kernel']}",
                  flush=True)
        for kernel in row["top_kernels"][:12]:
            print(f"  {kernel['ms_per_step']:8.3f} ms  {kernel['kind']:9s} {kernel['name']}", flush=True)
    graphs = None
    if args.graphs:  # every rank: the gathers inside the graph need them all
        k = int(args.refs.split(",")[0])
        graphs = graph_probe(pipe, args, dict(words=12, images=k, width=side, height=side, seed=7 + k))
        if not rank:
            print("graphs " + json.dumps(graphs), flush=True)
    if port is not None:
        torch.distributed.destroy_process_group()
    if rank:
        return
    summary = dict(device=args.device, size=args.size, steps=args.steps, compiled=not args.eager,
                   resident=args.resident, use_kv_cache=not args.no_kv_cache, split=args.split,
                   torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                   rows=rows, graphs=graphs)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
