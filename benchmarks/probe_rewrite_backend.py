"""How prompt rewriting's decoding step is compiled, measured per torch.compile backend.

A worker's rewrite decodes with a static KV cache (imgedit.runtime.enhance.static_cache). transformers'
generate() would compile each decoding step, by default with inductor and CUDA graphs (CompileConfig's
mode="reduce-overhead"); on Qwen-Image-2.1 that compile was most of a worker's start-up warm-up (56.9 s of a
130.1 s first start, 2× H200, 2026-11-29). A worker now captures the eager step as CUDA graphs instead
(imgedit.runtime.decode_graphs: the `graphs` backend). This probe runs each of --backends in a fresh process
with an empty inductor cache, on a real-size random-weight text encoder (--kind 21: Qwen3-VL; plus: Qwen2.5-VL,
trained-like init), through imgedit's own rewrite (imgedit.runtime.enhance.rewrite):

- the warm-up the worker does (imgedit.runtime.warmup.warm_up_rewrite): one 8-token rewrite with a picture and,
  for 2.1, one without: its seconds;
- --repeats rewrites of --tokens tokens with one 1024x1024 picture (a random encoder never ends its answer, so
  each writes exactly --tokens): ms a token;
- the same rewrite decoded eagerly (generate()'s dynamic cache) in the same process: how many of the first
  tokens agree, and the text encoder's logits on the prompt finite (asserted);
- the GPU memory: the weights', and the peak over the warm-up and the rewrites (a backend that copies the
  weights into its graphs' memory shows there), with torch's cudagraph counters (inputs copied, graphs skipped).

Backends: `inductor` (the default: reduce-overhead), `cudagraphs` (dynamo's graph replayed as CUDA graphs,
no inductor code generation), `regional` (the decoder layer compiled once for all layers, for the decoding
steps: a 36th of the code to compile; no CUDA graphs), `graphs` (no compile: the eager decoding step captured
as CUDA graphs, what a worker does: imgedit.runtime.decode_graphs), `eager` (no static cache, no compile).

    python benchmarks/probe_rewrite_backend.py --device cuda --kind 21 --json $OUT/rewrite-backends.json
    python benchmarks/probe_rewrite_backend.py --backends eager,cudagraphs   # CPU smoke run, tiny checkpoint
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fresh  # noqa: E402

BACKENDS = ("inductor", "cudagraphs", "regional", "graphs", "eager")
PROCESSOR = {"21": "Qwen3VLProcessor", "plus": "Qwen2VLProcessor"}


def encoder_pipe(args):
    """The text encoder and processor of --kind at --size, as a rewrite sees them (`pipe.text_encoder`,
    `pipe.processor`): random weights of the published config (real) or the tiny checkpoint's."""
    from types import SimpleNamespace

    import torch

    from imgedit.model.components import from_config, trained_like_init
    from imgedit.model.demo_checkpoint import build_checkpoint
    from imgedit.model.processor import load_processor

    folder = Path(args.checkpoint or f"/tmp/probe-rewrite-{args.kind}-{args.size}")
    if not (folder / "model_index.json").is_file():
        build_checkpoint(folder, kind=args.kind, seed=0, size=args.size)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    try:
        with torch.device(args.device):
            encoder = from_config("text_encoder", folder)
    finally:
        torch.set_default_dtype(previous)
    trained_like_init(encoder)
    encoder.eval().requires_grad_(False)
    processor = load_processor(folder / "processor", PROCESSOR[args.kind])
    return SimpleNamespace(text_encoder=encoder, processor=processor, _execution_device=torch.device(args.device))


def regional(encoder) -> None:
    """The `regional` backend: generate() compiles nothing (disable_compile); instead the decoder layer's
    forward is compiled once (inductor's default mode: one graph for every layer, the weights its inputs, as
    diffusers' compile_repeated_blocks does for a transformer's blocks) and runs for the decoding steps (one
    token); the prefill runs the layers as they are. Not reduce-overhead: its CUDA graph trees replay one graph
    for each layer in turn, so a layer's output is overwritten by the next layer's run ("accessing tensor output
    of CUDAGraphs that has been overwritten by a subsequent run", 2× H200, 2026-11-29); without graphs the
    kernels launch one by one, which this row measures."""
    import torch
    from transformers.cache_utils import StaticCache

    # The cache's update runs outside the graphs, so a layer's `layer_idx` (which only indexes the cache) is
    # not in them: dynamo still traces each layer's attention anew (it guards `self.layer_idx == i` where the
    # graph breaks: 5 graphs for the tiny checkpoint's 2 layers on the CPU, 2026-11-29), but the traced graphs
    # are the same, so inductor's cache serves every layer after the first; each layer needs its own entry
    # under the recompile limit.
    StaticCache.update = torch._dynamo.disable(StaticCache.update)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(
        encoder.model.language_model.layers))
    encoder.generation_config.disable_compile = True
    layers = encoder.model.language_model.layers
    plain = type(layers[0]).forward
    compiled = torch.compile(plain, dynamic=False)
    for layer in layers:
        def forward(hidden_states, *rest, _layer=layer, **kwargs):
            run = compiled if hidden_states.shape[1] == 1 else plain
            return run(_layer, hidden_states, *rest, **kwargs)

        layer.forward = forward


def one(args) -> dict:
    """One backend in this process: warm-up seconds, ms a token, agreement with eager decoding."""
    import torch
    from PIL import Image
    from transformers import CompileConfig

    from imgedit.model import internals
    from imgedit.runtime import decode_graphs, enhance

    pipe = encoder_pipe(args)
    encoder = pipe.text_encoder
    if args.device == "cpu":  # the static-cache path on the CPU, as the tests run it (a smoke run)
        enhance.STATIC_DEVICES = (*enhance.STATIC_DEVICES, "cpu")
    # set on the encoder before its first rewrite: whatever imgedit's own choice is, this backend runs
    graphed = decode_graphs.install(encoder)  # what a worker does: the static cache kept, the steps captured
    if args.one != "graphs":  # the cache kept, the steps transformers' own (compiled, or regional's)
        internals.restore_compiled_call(encoder)
    if args.one == "eager":
        enhance.no_static_cache(encoder)
    elif args.one == "cudagraphs":
        encoder.generation_config.compile_config = CompileConfig(backend="cudagraphs", mode=None)
    elif args.one == "graphs":
        encoder.generation_config.compile_config = CompileConfig()  # generate() asks for it; none is made
    elif args.one == "regional":
        encoder.generation_config.compile_config = CompileConfig()  # unused: generate() compiles nothing
        regional(encoder)
    else:  # transformers' default: inductor, mode="reduce-overhead"
        encoder.generation_config.compile_config = CompileConfig()
    if args.device == "cpu" and args.one != "eager":
        encoder.generation_config.compile_config._compile_all_devices = True
    static = enhance.decodes_with_graphs(encoder)  # the compiled decoding step with the static cache
    cuda = args.device == "cuda"
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    picture = Image.new("RGB", (1024, 1024), (120, 130, 140))
    cancel = threading.Event()

    def rewrite(pictures, tokens):
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = enhance.rewrite(pipe, pictures, "make the sky a deep evening blue", tokens, cancel)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - started

    started = time.perf_counter()
    rewrite([picture], 8)
    if args.kind == "21":  # text to image's rewrite: no picture (the worker warms both)
        rewrite([], 8)
    warm = time.perf_counter() - started
    runs = [rewrite([picture], args.tokens) for _ in range(args.repeats)]
    tokens = runs[-1][0].token_ids
    ms = sorted(seconds * 1e3 / max(len(result.token_ids), 1) for result, seconds in runs)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    from torch._dynamo.utils import counters  # what the CUDA graphs copied or skipped (torch's own counters)

    graphs = {key: value for key, value in counters["inductor"].items() if "cudagraph" in key}
    compiles = int(counters["stats"]["unique_graphs"])  # dynamo's graphs: a recompile per layer shows here
    enhance.no_static_cache(encoder)
    for layer in encoder.model.language_model.layers:  # `regional`'s wrappers off: the reference is eager
        layer.__dict__.pop("forward", None)
    eager, _ = rewrite([picture], args.tokens)
    same = next((i for i, (a, b) in enumerate(zip(tokens, eager.token_ids, strict=False)) if a != b),
                min(len(tokens), len(eager.token_ids)))
    with torch.inference_mode():
        ids = pipe.processor.tokenizer(["make the sky a deep evening blue"], return_tensors="pt").input_ids
        logits = encoder(input_ids=ids.to(args.device)).logits
    finite = bool(torch.isfinite(logits).all())
    assert finite, f"{args.one}: the text encoder's logits are not finite"
    return dict(backend=args.one, kind=args.kind, size=args.size, device=args.device,
                static_cache=static,
                warmup_s=round(warm, 2), ms_per_token=[round(m, 2) for m in ms], tokens=len(tokens),
                weights_gib=round(weights_gib, 2), peak_gib=round(peak_gib, 2), cudagraph_counters=graphs,
                compiled_graphs=compiles, captured_graphs=graphed.captures if args.one == "graphs" else None,
                agree_with_eager=same, finite=finite, torch=torch.__version__,
                gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kind", choices=sorted(PROCESSOR), default="21")
    parser.add_argument("--size", choices=("tiny", "real"), default=None, help="default: real on a GPU")
    parser.add_argument("--checkpoint")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--one", choices=BACKENDS, help=argparse.SUPPRESS)  # a child process: one backend
    args = parser.parse_args(argv)
    args.size = args.size or ("real" if args.device == "cuda" else "tiny")
    if args.device == "cpu" and args.size == "tiny":
        args.tokens = min(args.tokens, 16)
    if args.one:
        fresh.report(one(args))
        return 0
    rows = []
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix="probe-rewrite-inductor-") as cache:
            # an empty compile cache each: the warm-up as a fresh host's first start pays it
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            command = [sys.executable, __file__, "--one", backend, "--device", args.device, "--kind", args.kind,
                       "--size", args.size, "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            if args.checkpoint:
                command += ["--checkpoint", args.checkpoint]
            row = fresh.run(command, env, "backend", backend)
        rows.append(row)
        if "failed" not in row:
            print(f"{backend:10s} warm-up {row['warmup_s']:7.2f} s   {row['ms_per_token']} ms a token   "
                  f"{row['agree_with_eager']} of {row['tokens']} tokens as eager   GPU memory "
                  f"{row['weights_gib']} GiB weights, {row['peak_gib']} GiB peak   {row['compiled_graphs']} graphs "
                  f"compiled   {row['cudagraph_counters']}",
                  flush=True)
    return fresh.finish(rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
