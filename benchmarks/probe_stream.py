"""Do a capped plan's streamed blocks hide their copies behind the compute? One GPU, no checkpoint, ~1 min.

The 16 GB plan of Qwen-Image-2.1 keeps 13 of its 32 blocks on the GPU and streams the other 19 from pinned CPU
memory every step (imgedit.runtime.offload.stream: diffusers' group offloading, one block a group, the next
group fetched on its own CUDA stream while the current one computes; the streamed blocks spread among the
resident ones, imgedit.planning.plan.MemoryMode.streamed). A capped step measured 0.274 s against 0.118 s
uncapped: the difference is the copy time at 55 GB/s, so either the copies do not overlap the compute or the
copy rate is lower than that on the machine. This probe tells the two apart on blocks of 2.1's size (MLPs only:
its compute is lighter than 2.1's block, which also attends):

1. the copy rate: one block's weights, pinned, to the GPU (GB/s), and one pinned 1 GiB tensor (the copy
   time of 4. counts the faster);
2. a forward with every block resident (the compute alone);
3. the same forward with the plan's streaming (`stream()` itself, the worker's code);
4. the overlap: (compute + copies - streamed) / min(compute, copies): 1 = the copies are hidden, 0 = serial
   (the plan streams block 0, whose copy nothing can hide: even a perfect overlap reads about 0.1 below 1).

Each block is two MLPs (width -> width*mult -> width), bf16, at 2.1's block size by default (0.42 GiB), run on
`--tokens` tokens; activations must stay finite (random weights, N(0, 0.02)).

    python3 benchmarks/probe_stream.py --json /tmp/res/stream.json           # the GPU machine
    python3 benchmarks/probe_stream.py --device cpu --blocks 4 --resident 2 --width 64 --tokens 32   # it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from imgedit.planning.plan import MemoryMode  # noqa: E402
from imgedit.runtime.offload import stream  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, width: int, mult: int):
        super().__init__()
        self.mlps = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(width, width * mult), torch.nn.GELU(), torch.nn.Linear(width * mult, width))
            for _ in range(2))

    def forward(self, x):
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


class Stack(torch.nn.Module):
    def __init__(self, blocks: int, width: int, mult: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, mult) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def timed(cuda: bool, call, repeats: int) -> float:
    """Seconds per call, after one warm-up call (the prefetch order is traced on the first forward)."""
    call()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = call()
    if cuda:
        torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite activations"
    return (time.perf_counter() - start) / repeats


def copy_rates(device: str, block: torch.nn.Module, repeats: int) -> dict[str, float]:
    """GB/s of a pinned block's tensors (one copy each, as group offloading makes them) and of one 1 GiB tensor."""
    if torch.device(device).type != "cuda":
        return {}
    tensors = [p.detach().pin_memory() for p in block.parameters()]
    big = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rates = {}
    for name, parts, size in (("block", tensors, nbytes), ("one_gib", [big], big.numel())):
        seconds = timed(True, lambda parts=parts: torch.stack(
            [t.to(device, non_blocking=True).view(-1)[:1].float() for t in parts]), repeats)
        rates[name] = size / seconds / 1e9
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--resident", type=int, default=13, help="blocks kept on the GPU (the 16 GB plan: 13)")
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--mult", type=int, default=6, help="2 MLPs of width -> width*mult -> width a block")
    parser.add_argument("--tokens", type=int, default=4160, help="2.1's text to image at 1024²: 4096 + 64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):  # built and drawn on the GPU: seconds, not minutes of CPU
        model = Stack(args.blocks, args.width, args.mult).to(dtype)
    with torch.no_grad():  # random, and small enough that 2 x blocks residual MLPs stay finite in bf16
        for mlp in (m for block in model.blocks for m in block.mlps):
            torch.nn.init.normal_(mlp[0].weight, std=args.width**-0.5)
            torch.nn.init.normal_(mlp[2].weight, std=0.1 * (args.width * args.mult) ** -0.5)
            torch.nn.init.zeros_(mlp[0].bias)
            torch.nn.init.zeros_(mlp[2].bias)
    x = torch.randn(1, args.tokens, args.width, dtype=dtype, device=args.device)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    rates = copy_rates(args.device, model.blocks[0].cpu(), args.repeats)
    model.blocks[0].to(args.device)

    def forward():
        with torch.inference_mode():
            return model(x)

    resident = timed(cuda, forward, args.repeats)
    model.to("cpu")
    memory = MemoryMode(resident_blocks=args.resident)
    stream(model, args.device, memory)  # the worker's own call: pins the streamed blocks, hooks them
    streamed = timed(cuda, forward, args.repeats)

    count = len(memory.streamed(args.blocks))
    # the faster of the two rates: one tensor at a time (the "block" rate) undercounts what the streamed
    # forward reaches (H200, 2026-11-29: 24 GB/s a block alone, while the streamed forward moved its 8.6 GB in
    # 0.16 s, ~54 GB/s, the 1 GiB rate), and an undercounted copy time reads as an overlap above 1
    copies = count * block_bytes / (max(rates.values()) * 1e9) if rates else 0.0
    overlap = (resident + copies - streamed) / min(resident, copies) if copies else None
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "blocks": args.blocks, "streamed_blocks": count,
              "block_gib": block_bytes / 2**30, "copy_gb_per_s": rates, "resident_s": resident,
              "streamed_s": streamed, "copies_s": copies, "overlap": overlap}
    for key, value in report.items():
        print(f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
