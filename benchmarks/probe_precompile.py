"""What a compiled worker's restart could skip: dynamo's tracing, kept on disk by torch's `caching_precompile`.

A restart today finds inductor's kernels in COMPILE_CACHE_DIR but traces every compiled variant again (most of
the warm phase: 24-31 s on the 24 GB row, docs/BENCHMARKS.md). With `torch._dynamo.config.caching_precompile`
(TORCH_CACHING_PRECOMPILE=1) and `torch.compiler.save_cache_artifacts()` after the warm-up, dynamo's frames
(bytecode and guards) are stored too, and a fresh process loads them instead of tracing. This probe compiles
the edit models' transformer blocks as a worker does (imgedit.runtime.block_compile.compile_transformer: its
repeated blocks, fullgraph, dynamic) and times the first forward, each way in a fresh process:

- `cold`: an empty compile cache, dynamo's cache off (a first start);
- `restart`: the same cache again (today's restart: inductor's kernels found, every frame traced);
- `save`: an empty cache with `caching_precompile` on; after the forward, `save_cache_artifacts()` to a file;
- `load`: an empty cache, the file loaded (`load_cache_artifacts`) before compiling (frames traced: 0 expected);
- `other-processor`: `load`'s cache, dynamo's cache on, every block given an attention processor of another
  class that computes the same (as another ATTENTION or placement would install). `caching_precompile` drops
  the guards it cannot serialize (the processor's code among them): on the CPU (torch 2.13, 2026-11-30) this
  way failed inside dynamo ("Name '__builtins_dict___6' already exists in scope") where a fresh cache compiled
  it, so one cache directory must not serve two configurations.

On torch 2.11 (one H200, 2026-11-30, `3d78d49`) `load` and `other-processor` fail before any forward:
unpickling the saved guards raises a `TypeError` while the blocks are compiled (docs/gpu-runs/2026-11-30-1xh200.md).

Reported per way: the first forward's seconds, the graphs dynamo traced, the largest difference from the eager
forward of the same weights, or the failure.

    python benchmarks/probe_precompile.py --json /tmp/precompile.json                       # CPU, small blocks
    python benchmarks/probe_precompile.py --device cuda --size real --json $OUT/precompile.json   # a GPU machine
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fresh  # noqa: E402

# way: (its cache directory, dynamo's cache on, artifacts to load first, another processor class)
WAYS = {
    "cold": ("a", False, False, False),
    "restart": ("a", False, False, False),
    "save": ("b", True, False, False),
    "load": ("c", True, True, False),
    "other-processor": ("c", True, False, True),
}


def one(args) -> dict:
    import torch

    from imgedit.model.components import from_config
    from imgedit.model.demo_checkpoint import build_checkpoint
    from imgedit.runtime.block_compile import compile_transformer

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache, precompile, load, other = WAYS[args.one]
    artifacts = Path(args.work) / "artifacts.bin"
    if load:
        torch.compiler.load_cache_artifacts(artifacts.read_bytes())
    folder = Path(args.checkpoint or Path(args.work) / f"checkpoint-{args.size}")
    if not (folder / "model_index.json").is_file():
        build_checkpoint(folder, kind="plus", seed=0, size=args.size)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # built in its dtype (a real-size transformer in fp32 would take 82 GB)
    with torch.device(device):
        model = from_config("transformer", folder).eval()
    torch.set_default_dtype(torch.float32)
    if other:
        _other_processor(model)
    config = model.config
    side, text = args.latent, 12
    torch.manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, side * side, config.in_channels, device=device, dtype=dtype),
                  encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, device=device,
                                                    dtype=dtype),
                  encoder_hidden_states_mask=torch.ones(1, text, device=device),
                  timestep=torch.tensor([0.5], device=device, dtype=dtype), img_shapes=[(1, side, side)],
                  return_dict=False)
    row = dict(way=args.one, size=args.size, device=args.device, torch=torch.__version__,
               caching_precompile=bool(torch._dynamo.config.caching_precompile))
    with torch.no_grad():
        eager = model(**inputs)[0]
        compile_transformer(model, None)
        started = time.perf_counter()
        try:
            out = model(**inputs)[0]
        except Exception as exc:  # the probe reports how a way fails
            return row | dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    assert torch.isfinite(out).all(), f"{args.one}: the compiled forward is not finite"
    row |= dict(first_forward_s=round(seconds, 2), graphs_traced=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                max_diff_vs_eager=float((out.float() - eager.float()).abs().max()))
    if args.one == "save":
        data = torch.compiler.save_cache_artifacts()
        assert data is not None, "save: nothing to save"
        artifacts.write_bytes(data[0])
        row |= dict(artifact_bytes=len(data[0]), artifacts={k: len(v) for k, v in data[1].artifacts.items()})
    return row


Same = None  # _other_processor's class, made at module level: dynamo's cache refuses a class of a local scope


def _same_call(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
               attention_mask=None, image_rotary_emb=None):
    return super(Same, self).__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                      attention_mask, image_rotary_emb)


def _other_processor(model) -> None:
    """Every block's attention given a processor of another class (`Same`) that computes the same."""
    global Same
    base = type(model.transformer_blocks[0].attn.processor)
    Same = type("Same", (base,), {"__call__": _same_call, "__module__": __name__, "__qualname__": "Same"})
    for block in model.transformer_blocks:
        block.attn.set_processor(Same())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny", choices=("tiny", "real"))
    parser.add_argument("--latent", type=int, default=16, help="the image's side in patches (16: 256 tokens)")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--checkpoint", help="a built 2509-kind checkpoint whose transformer config to use "
                        "(default: build one of --size in the work folder)")
    parser.add_argument("--json")
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--one", choices=sorted(WAYS), help=argparse.SUPPRESS)  # a child process: one way
    args = parser.parse_args(argv)
    if args.one:
        fresh.report(one(args))
        return 0
    work = Path(tempfile.mkdtemp(prefix="probe-precompile-"))
    rows = []
    try:
        for way in args.ways.split(","):
            cache, precompile, _, _ = WAYS[way]
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / f"cache-{cache}"),
                       TORCH_CACHING_PRECOMPILE="1" if precompile else "0")
            command = [sys.executable, __file__, "--one", way, "--device", args.device, "--size", args.size,
                       "--latent", str(args.latent), "--work", str(work)]
            command += ["--checkpoint", args.checkpoint] if args.checkpoint else []
            row = fresh.run(command, env, "way", way)
            rows.append(row)
            print(row, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return fresh.finish(rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
