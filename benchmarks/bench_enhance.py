"""Benchmark prompt enhancement on this machine's GPU: the rewrite's latency and memory, and an edit right after.

    python benchmarks/bench_enhance.py [--size 1024] [--tokens 80] [--steps 8] [--repeats 3] [--json out.json]
    python benchmarks/bench_enhance.py --kind 21 --tokens 160    # Qwen-Image-2.1 (Qwen3-VL text encoder)
    python benchmarks/bench_enhance.py --tiny [--kind 21]        # CPU smoke run on the tiny checkpoint

Through imgedit's PipelineManager and a worker process, as the app runs it (DEVICE_MAP=cuda:0, COMPILE off or
--compile, ENCODE_CACHE=0), with the real-size random-weight checkpoint of --kind (trained-like init; built at
--ckpt when missing, by default /tmp/qwen-image-edit-real-random or /tmp/qwen-image-2.1-real-random). A random
text encoder never ends its answer, so with ENHANCE_MAX_TOKENS=--tokens every rewrite writes exactly that many
new tokens (and is then not used: the notice says it was cut, which the script checks): the latency of a
rewrite of that length. The worker hook fails a job on non-finite transformer outputs (bench.finite_check) and
a rewrite on a non-finite next-token score (checked on the GPU each token, read once after the rewrite: no
sync inside the compiled decoding step); on the GPU it also fails a rewrite that should decode with the static
cache (a 2.1 worker, or a compiled one) and does not.

Reported: a rewrite alone (one 1024x1024 input; for 2.1 also one without a picture, as for text to image), ms a
token, the GPU memory in use at its peak against idle (NVML, polled every 10 ms), and an edit (--steps; CFG 4,
2.1 without CFG as its default) after an edit against the same edit right after a rewrite.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import (  # noqa: E402
    finite_check,
    one_gpu_parser,
    one_gpu_settings,
    reference_image,
    request,
    timed,
    write_results,
)

from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.protocol import EditRequest  # noqa: E402

log = logging.getLogger("bench_enhance")


CHECKPOINTS = {"plus": "/tmp/qwen-image-edit-real-random", "21": "/tmp/qwen-image-2.1-real-random"}


class FiniteScores:
    """A generate() logits processor: whether every next-token score was finite, kept on the device (no host
    sync a token) and read once, after the rewrite."""

    def __init__(self):
        self.ok = None

    def __call__(self, input_ids, scores):
        import torch

        finite = torch.isfinite(scores).all()
        self.ok = finite if self.ok is None else self.ok & finite
        return scores


def hooks(pipe, spec) -> None:
    """Worker hook: bench.finite_check; every rewrite's next-token scores finite; and, on a GPU where it should
    (BENCH_EXPECT_STATIC=1), the rewrite decoding with the static KV cache (the compiled step)."""
    import os

    from transformers import LogitsProcessorList, StaticCache

    finite_check(pipe, spec)
    generate = pipe.text_encoder.generate
    expect_static = os.environ.get("BENCH_EXPECT_STATIC") == "1"

    def checked_generate(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        if expect_static and not isinstance(cache, StaticCache):
            raise RuntimeError(f"the rewrite decodes with {type(cache).__name__ if cache else 'a dynamic cache'}, "
                               "not the static cache: its steps are not compiled")
        scores = FiniteScores()
        output = generate(*args, logits_processor=LogitsProcessorList([scores]), **kwargs)
        if scores.ok is None or not bool(scores.ok):
            raise RuntimeError("non-finite next-token scores: the benchmark would be flattered")
        log.info("rewrite decoded with %s", type(cache).__name__ if cache else "the dynamic cache")
        return output

    pipe.text_encoder.generate = checked_generate


class RestServer:
    """The app (REST + gradio) for `manager` under uvicorn in a thread, on a free loopback port."""

    def __init__(self, manager):
        import socket

        import uvicorn

        from imgedit.web.app import build_app
        from imgedit.web.connections import uvicorn_options

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(build_app(manager.settings, manager), host="127.0.0.1", port=port,
                                log_level="warning", **uvicorn_options(manager.settings))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the REST server did not start")
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


class PeakMemory:
    """GPU 0's memory in use (NVML), polled every 10 ms while the block runs: the peak, in MiB."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # noqa: BLE001 - no NVML (CPU smoke run): no memory figures
            self._nvml = None
        self.peak = 0.0

    def used(self) -> float:
        if self._nvml is None:
            return 0.0
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20

    def __enter__(self):
        self.peak, self._stop = self.used(), threading.Event()

        def poll():
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self.used())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())


def main() -> None:
    parser = one_gpu_parser(__doc__, steps=8, repeats=3)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--kind", choices=sorted(CHECKPOINTS), default="plus",
                        help="the model family: plus (Qwen-Image-Edit-2509/2511) or 21 (Qwen-Image-2.1)")
    parser.add_argument("--compile", choices=("off", "auto"), default="auto",
                        help="COMPILE (auto, as the app starts: the transformer compiled and the rewrites' decoding "
                             "step; off: both eager)")
    args = parser.parse_args()
    if args.ckpt == parser.get_default("ckpt"):
        args.ckpt = CHECKPOINTS[args.kind]
    family_21 = args.kind == "21"
    settings, size, steps = one_gpu_settings(args, tiny_steps=2, kind=args.kind, COMPILE=args.compile,
                                             ENHANCE_MAX_TOKENS=str(args.tokens))
    if family_21 and args.tiny:
        size = 320  # 2.1's least output resolution (planning.families)
    device_map = "cpu" if args.tiny else "cuda:0"
    if not args.tiny and args.compile != "off":
        os.environ["BENCH_EXPECT_STATIC"] = "1"  # read by the worker's hook (workers inherit the environment)
    cfg = 1.0 if family_21 else 4.0
    t0 = time.perf_counter()
    manager = PipelineManager(settings, worker_hook="bench_enhance:hooks").load(timeout=900)
    image = reference_image(size)
    memory = PeakMemory()
    out: dict = {"kind": args.kind, "device_map": device_map, "compile": args.compile, "size": size,
                 "tokens": args.tokens, "steps": steps, "cfg": cfg, "startup_s": round(time.perf_counter() - t0, 1),
                 "fallbacks": [f for w in manager.status().workers for f in w.fallbacks], "rewrite_s": [],
                 "rewrite_alone_s": [], "rest_rewrite_s": [], "rest_rewrite_alone_s": [], "edit_after_edit": [],
                 "edit_after_rewrite": []}

    def rewrite(images=(image,)) -> float:
        started = time.perf_counter()
        result = manager.enhance(EditRequest(images=images, prompt="make it winter", source="bench"))
        seconds = time.perf_counter() - started
        if f"cut at the {args.tokens}-token limit" not in (result.notice or ""):
            raise RuntimeError(f"expected a rewrite of exactly {args.tokens} tokens, got: {result}")
        return round(seconds, 3)

    def rest_rewrite(url: str, images=(image,)) -> float:
        """The same rewrite through REST (/v1/prompts/enhance): what a user waits for, HTTP and the line included."""
        import io

        import httpx

        files = []
        for k, picture in enumerate(images):
            buffer = io.BytesIO()
            picture.save(buffer, "PNG")
            files.append(("image", (f"in{k}.png", buffer.getvalue(), "image/png")))
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/prompts/enhance", data={"prompt": "make it winter"},
                              files=files or {"x": ("x", b"", "text/plain")}, timeout=600)
        seconds = time.perf_counter() - started
        notice = response.json().get("notice") or "" if response.status_code == 200 else response.text
        if f"cut at the {args.tokens}-token limit" not in notice:
            raise RuntimeError(f"expected a REST rewrite of exactly {args.tokens} tokens, got: {notice}")
        return round(seconds, 3)

    def edit(steps_: int, seed: int = 0) -> dict:
        return timed(manager, request(image, steps_, (size, size), seed=seed, cfg=cfg))

    server = RestServer(manager)
    try:
        edit(2)  # warm-up (kernels, allocator)
        rewrite()
        if family_21:
            rewrite(())
        idle = memory.used()
        with memory:
            out["rewrite_s"].append(rewrite())
        out["idle_mib"], out["rewrite_peak_mib"] = round(idle), round(memory.peak)
        with memory:
            edit(steps)
        out["edit_peak_mib"] = round(memory.peak)
        for k in range(args.repeats):
            edit(2, seed=k)
            out["edit_after_edit"].append(edit(steps, seed=k))
            out["rewrite_s"].append(rewrite())
            out["edit_after_rewrite"].append(edit(steps, seed=k))
            out["rest_rewrite_s"].append(rest_rewrite(server.url))
            if family_21:  # text to image: a prompt alone
                out["rewrite_alone_s"].append(rewrite(()))
                out["rest_rewrite_alone_s"].append(rest_rewrite(server.url, ()))
            log.info("round %d: rewrite %.3f s; edit after an edit %.3f s, after a rewrite %.3f s", k,
                     out["rewrite_s"][-1], out["edit_after_edit"][-1]["wall_s"],
                     out["edit_after_rewrite"][-1]["wall_s"])
    finally:
        server.__exit__()
        manager.close()
    summary = {"kind": args.kind, "rewrite_s_median": statistics.median(out["rewrite_s"]),
               "ms_per_token": round(1000 * statistics.median(out["rewrite_s"]) / args.tokens, 2),
               "rewrite_adds_mib": out["rewrite_peak_mib"] - out["idle_mib"],
               "edit_adds_mib": out["edit_peak_mib"] - out["idle_mib"], "fallbacks": out["fallbacks"]}
    for key, name in (("rest_rewrite_s", "rest_ms_per_token"), ("rewrite_alone_s", "ms_per_token_without_a_picture"),
                      ("rest_rewrite_alone_s", "rest_ms_per_token_without_a_picture")):
        if out[key]:
            summary[name] = round(1000 * statistics.median(out[key]) / args.tokens, 2)
    for kind in ("edit_after_edit", "edit_after_rewrite"):
        summary[kind] = {key: statistics.median(r[key] for r in out[kind]) for key in ("wall_s", "s_per_step")}
    write_results(out, summary, args.json)


if __name__ == "__main__":
    main()
