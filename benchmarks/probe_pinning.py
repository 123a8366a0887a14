"""How a capped plan's streamed weights get into page-locked CPU memory, measured per way of pinning them.

diffusers' group offloading pins each streamed weight with `Tensor.pin_memory()`, through torch's caching host
allocator: each block rounded up to a power of two, one `cudaHostAlloc` each. At the 16 GB plan's start that
took 13.0 s for 2.1's 7.8 GiB of streamed blocks and 26.4 s for its 16.3 GiB text encoder (2× H200 host,
2026-11-29). Each way runs in a fresh process on the weights of --component (the real model's shapes, from
its config, filled in CPU memory as loaded weights are):

- `default`: `pin_memory()` per weight, torch's allocator as it is;
- `torch-register`: the same calls with torch's own allocator options (`PYTORCH_ALLOC_CONF`):
  `pinned_use_cuda_host_register:True,pinned_num_register_threads:8` (malloc and cudaHostRegister on 8
  threads; torch 2.11 knows both);
- `torch-register-exact`: those and `pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1` (no
  rounding above 1 MB, and no caching above it: an unrounded block that is cached can be handed to a larger
  request, a heap overflow that pytorch/pytorch#192722 fixed in August 2026). torch 2.11 refuses the first
  ("Unrecognized key ... in CUDA allocator config", 2× H200, 2026-11-29): the row says so;
- `one-buffer`: every weight copied into one buffer locked once at its exact size
  (imgedit.runtime.pinned.copy_into_one, where this tree has it: until 2026-11-30 the lock first, then the
  copies; since, the copies first, then the lock);
- `from-gpu`: `one-buffer` with the weights on the GPU first, as a benchmark checkpoint's random weights are
  built (copy_into_one fills their places with zeros, locks, then copies them in by DMA);
- `gpu-to-cpu`: those GPU weights moved to pageable CPU memory one by one (`.cpu()`, what diffusers' group
  offloading does with a weight on a GPU) and then `one-buffer`: the way a 24 GB worker went before;
- `copy-then-lock`: the same buffer, the copies first and then the lock (the pages already filled);
- `huge-pages`: `copy-then-lock` in 2 MiB pages (MADV_HUGEPAGE).

Reported per way: seconds to pin everything, the bytes locked (torch's host_memory_stats, or the buffer), the
process's resident memory after, and a host-to-device copy of everything (GB/s: pinned memory copies at PCIe
speed, pageable memory at a fraction of it). Every pinned tensor must say `is_pinned()` and hold its values.

    python benchmarks/probe_pinning.py --component text_encoder --json $OUT/pinning.json    # a GPU machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fresh  # noqa: E402

WAYS = {
    "default": None,
    "torch-register": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "torch-register-exact": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
                            "pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1",
    "one-buffer": None,
    "from-gpu": None,
    "gpu-to-cpu": None,
    "copy-then-lock": None,
    "huge-pages": None,
}


def weights(args) -> list:
    """CPU tensors of the component's parameter shapes (bf16), filled so their pages are resident."""
    import torch

    from imgedit.model.components import from_config
    from imgedit.model.demo_checkpoint import build_checkpoint

    folder = Path(args.checkpoint or f"/tmp/probe-pinning-{args.kind}")
    if not (folder / "model_index.json").is_file():
        build_checkpoint(folder, kind=args.kind, seed=0, size="real")
    with torch.device("meta"):
        model = from_config(args.component, folder)
    out, total = [], 0
    for p in model.parameters():
        if args.gib and total >= args.gib * 2**30:
            break
        out.append(torch.full(p.shape, 0.5, dtype=torch.bfloat16))
        total += out[-1].numel() * 2
    return out


def resident_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def copy_then_lock(tensors: list, huge: bool) -> tuple[list, int]:
    """The `copy-then-lock` and `huge-pages` ways: one buffer, the copies first (torch fills its pages on its
    CPU threads), then one lock of the filled pages (imgedit.runtime.pinned.lock); `huge`: the buffer an
    anonymous mapping that asks Linux for 2 MiB pages (MADV_HUGEPAGE). Tried on the CPU with mlock standing in
    for the lock (2026-11-29), neither order nor huge pages was clearly faster, and that machine's counters
    showed no huge page given: only the GPU host's lock can say."""
    import mmap

    import torch

    from imgedit.runtime import pinned

    starts, size = pinned.offsets(tensors)
    if huge:
        mapping = mmap.mmap(-1, size)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    copies = []
    for i, start in enumerate(starts):
        tensor = tensors[i]
        copy = buffer[start:start + tensor.numel() * tensor.element_size()].view(tensor.dtype)
        copies.append(copy.view(tensor.shape).copy_(tensor))
        tensors[i] = None
    assert pinned.lock(buffer), "CUDA refused to lock the buffer"
    return copies, size


def one(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)  # a GPU worker's (WORKER_THREADS: 4 on a 16-core host)
    tensors = weights(args)
    size = sum(t.numel() * t.element_size() for t in tensors)
    rss_before = resident_gib()
    torch.cuda.init()
    if args.one in ("from-gpu", "gpu-to-cpu"):
        tensors = [t.to("cuda") for t in tensors]  # built on the GPU (before the clock: not part of the way)
        torch.cuda.synchronize()
    started = time.perf_counter()
    if args.one == "gpu-to-cpu":
        tensors = [t.cpu() for t in tensors]
    if args.one in ("one-buffer", "from-gpu", "gpu-to-cpu"):
        from imgedit.runtime import pinned  # not in every tree: the way is skipped then

        if hasattr(pinned, "set_copy_threads"):  # as a one-GPU worker: every CPU copies (modes.copy_threads)
            pinned.set_copy_threads(len(os.sched_getaffinity(0)))
        held: list = [None] * len(tensors)

        def place(i, copy):
            held[i] = copy

        pinned.copy_into_one(tensors, place)
        tensors = held
        locked = size
    elif args.one in ("copy-then-lock", "huge-pages"):
        tensors, locked = copy_then_lock(tensors, huge=args.one == "huge-pages")
    else:
        tensors = [t.pin_memory() for t in tensors]
        stats = torch.cuda.host_memory_stats()  # torch 2.13 names it allocated_bytes.current; 2.11 read 0 for
        # allocated_bytes.all.current (2026-11-29), so the first of the names this torch has
        names = ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current")
        locked = int(next((stats[name] for name in names if name in stats), 0))
    seconds = time.perf_counter() - started
    assert all(t.is_pinned() for t in tensors), f"{args.one}: a tensor is not pinned"
    assert all(float(t[(0,) * t.dim()]) == 0.5 for t in tensors), f"{args.one}: a value changed"
    torch.cuda.synchronize()
    copy_started = time.perf_counter()
    on_gpu = [t.to("cuda", non_blocking=True) for t in tensors]
    torch.cuda.synchronize()
    copy_seconds = time.perf_counter() - copy_started
    assert torch.isfinite(on_gpu[0]).all()
    return dict(way=args.one, component=args.component, kind=args.kind, tensors=len(tensors),
                gib=round(size / 2**30, 2), seconds=round(seconds, 2), locked_gib=round(locked / 2**30, 2),
                resident_gib_before=round(rss_before, 2), resident_gib_after=round(resident_gib(), 2),
                copy_gb_per_s=round(size / copy_seconds / 1e9, 1), torch=torch.__version__,
                alloc_conf=os.environ.get("PYTORCH_ALLOC_CONF", ""), threads=args.threads or None,
                gpu=torch.cuda.get_device_name(0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="21", help="the checkpoint family whose shapes are used")
    parser.add_argument("--component", default="text_encoder", choices=("text_encoder", "transformer"))
    parser.add_argument("--gib", type=float, default=None, help="only the first GiB of the weights")
    parser.add_argument("--checkpoint")
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads in each way (0: its default)")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json")
    parser.add_argument("--one", choices=sorted(WAYS), help=argparse.SUPPRESS)  # a child process: one way
    args = parser.parse_args(argv)
    if args.one:
        fresh.report(one(args))
        return 0
    rows = []
    for way in args.ways.split(","):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
        if WAYS[way]:
            env["PYTORCH_ALLOC_CONF"] = WAYS[way]
        command = [sys.executable, __file__, "--one", way, "--kind", args.kind, "--component", args.component]
        command += ["--gib", str(args.gib)] if args.gib else []
        command += ["--checkpoint", args.checkpoint] if args.checkpoint else []
        command += ["--threads", str(args.threads)] if args.threads else []
        row = fresh.run(command, env, "way", way)
        rows.append(row)
        if "failed" not in row:
            print(f"{way:15s} {row['gib']:6.2f} GiB in {row['tensors']} tensors: pinned in "
                  f"{row['seconds']:6.2f} s, {row['locked_gib']:6.2f} GiB locked, RSS "
                  f"{row['resident_gib_before']} -> {row['resident_gib_after']} GiB, copy "
                  f"{row['copy_gb_per_s']} GB/s", flush=True)
    return fresh.finish(rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
