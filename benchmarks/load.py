"""A load test of a running imgedit server over REST: N clients at once, each sending a realistic mix of requests
for a set time; what the server served and how long each kind waited.

    python3 benchmarks/load.py --url http://localhost:7860 --clients 8 --minutes 10 --json load.json

Each client loops: it takes the next request of one sequence shared by all clients (each kind drawn by its
weight, --mix, from --seed), sends it, waits for the answer, and takes the next. The kinds: `quality` (a
40-step edit, --steps), `fast` and `fastest` (speed=..., where the server offers them), `masked` (an 8-step
edit with a mask), `two` (two input images), `rewrite` (/v1/prompts/enhance, 160 tokens),
`t2i` (text to image, for a model that generates). A kind the server cannot run (its /health offers no fast
LoRA, its model does not generate) is left out of the mix and named. --think S: each client pauses a random
time between its requests (exponential, S seconds on average), as people do; 0 (the default) keeps every client
sending. --batch-items N: beside the clients, a batch keeps one job of N --steps edits running through the jobs
API (/v1/jobs) from start to end (submitted again when it finishes, cancelled at the end): the clients' latency
is then that of interactive edits while a batch runs. Meanwhile a sampler reads /health every --sample seconds:
the line's length and each GPU's utilisation.

The report: images a minute (in all and per GPU), latency p50/p95/p99 and the p99/p50 ratio per kind, errors
(every non-200 answer, by status and message: there should be none), the queue's length over time (min, mean,
max, and the samples in the JSON), the GPUs' mean utilisation and how many times the batch's items paused for
the clients' edits (PREEMPT_ITEMS: /metrics' imgedit_item_pauses_total, counted as each item ends), and the graphs
torch.compile compiled while the edits ran (imgedit_compiled_graphs_total: 0 after the warm-up). Every image
answered is checked to decode and to be neither blank nor one colour. Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image, ImageStat

PROMPT = "turn the sky into a sunset and keep everything else unchanged"
KINDS = ("quality", "fast", "fastest", "masked", "two", "rewrite", "t2i")
DEFAULT_MIX = "quality=4,fast=3,fastest=6,masked=2,two=2,rewrite=1,t2i=2"
# /metrics' counters the report gives the run's difference of, by the report's key
COUNTERS = {"imgedit_item_pauses_total": "item_pauses", "imgedit_compiled_graphs_total": "compiled_graphs"}


def picture(side: int, seed: int) -> bytes:
    """A side x side PNG with structure (gradients and a checkerboard), different per seed."""
    rng = random.Random(seed)
    image = Image.new("RGB", (side, side))
    pixels = image.load()
    shift = rng.randrange(256)
    for y in range(side):
        for x in range(side):
            board = 60 if ((x * 8 // side) + (y * 8 // side)) % 2 else 0
            pixels[x, y] = ((x * 255 // side + shift) % 256, (y * 255 // side) % 256, (board + shift) % 256)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def mask_png(side: int) -> bytes:
    """OpenAI's mask: transparent (to be edited) in a centred square."""
    mask = Image.new("RGBA", (side, side), (0, 0, 0, 255))
    quarter = side // 4
    mask.paste((0, 0, 0, 0), (quarter, quarter, side - quarter, side - quarter))
    buffer = io.BytesIO()
    mask.save(buffer, "PNG")
    return buffer.getvalue()


def sound(item: dict) -> bool:
    """An answered image decodes and is not a single colour."""
    image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).convert("RGB")
    return max(hi - lo for lo, hi in ImageStat.Stat(image).extrema) > 0


class Load:
    def __init__(self, args, health: dict):
        self.args, self.url = args, args.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
        self.pictures = [picture(args.size, seed) for seed in range(4)]
        self.mask = mask_png(args.size)
        self.lock = threading.Lock()
        self.done: list[dict] = []
        self.samples: list[dict] = []
        self.batches: list[dict] = []  # the --batch-items jobs, as they ended
        self.sequence = random.Random(args.seed)  # the requests' kinds and seeds, one sequence for every client
        self.stop = threading.Event()
        steps = {lora.get("lightning_steps") for lora in health.get("loras") or ()}
        turbo = any(worker.get("turbo") for worker in health.get("workers") or ())
        speeds = {speed for speed, n in (("fastest", 4), ("fast", 8)) if n in steps or turbo}
        generates = bool((health.get("defaults") or {}).get("text_to_image"))
        # the GPUs the workers hold, by NVML index ("cuda:1" as the server numbers them: its visible GPUs' order)
        visible = [g.get("index") for g in health.get("gpus") or ()]
        held = {int(d[5:]) for w in health.get("workers") or () for d in w.get("devices") or ()
                if d.startswith("cuda:")}
        self.gpus = [visible[i] for i in sorted(held) if i < len(visible)] or visible
        weights = dict(kind_weight.split("=") for kind_weight in args.mix.split(","))
        self.mix, self.left_out = {}, {}
        for kind, weight in weights.items():
            if kind not in KINDS:
                raise SystemExit(f"--mix: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
            if kind in ("fast", "fastest") and kind not in speeds and not args.assume_speeds:
                self.left_out[kind] = "no LoRA or Turbo for this speed in /health"
            elif kind == "t2i" and not generates and not args.assume_t2i:
                self.left_out[kind] = "the model does not generate from a prompt alone"
            elif float(weight) > 0:
                self.mix[kind] = float(weight)
        if not self.mix:
            raise SystemExit("nothing left in the mix to send")

    # ---- one request of each kind ----
    def send(self, client: httpx.Client, kind: str, seed: int) -> dict:
        size = f"{self.args.size}x{self.args.size}"
        fields = {"prompt": PROMPT, "size": size, "n": "1", "response_format": "b64_json", "seed": str(seed)}
        files = [("image", ("input-1.png", self.pictures[seed % 4], "image/png"))]
        if kind == "quality":
            fields["num_inference_steps"] = str(self.args.steps)
        elif kind in ("fast", "fastest"):
            fields["speed"] = kind
        elif kind == "masked":
            fields["num_inference_steps"] = "8"
            files.append(("mask", ("mask.png", self.mask, "image/png")))
        elif kind == "two":
            fields["num_inference_steps"] = "8"
            files.append(("image", ("input-2.png", self.pictures[(seed + 1) % 4], "image/png")))
        if kind == "rewrite":
            return self._post(client, "/v1/prompts/enhance",
                              data={"prompt": PROMPT, "max_new_tokens": "160"}, files=files)
        if kind == "t2i":
            body = {"prompt": PROMPT, "size": size, "n": 1, "response_format": "b64_json", "seed": seed,
                    "num_inference_steps": self.args.steps}
            return self._post(client, "/v1/images/generations", json=body)
        return self._post(client, "/v1/images/edits", data=fields, files=files)

    def _post(self, client: httpx.Client, path: str, **content) -> dict:
        t0 = time.perf_counter()
        try:
            response = client.post(f"{self.url}{path}", headers=self.headers, **content)
        except httpx.HTTPError as exc:
            return {"status": None, "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
        seconds = time.perf_counter() - t0
        if response.status_code != 200:
            return {"status": response.status_code, "error": response.text[:200], "seconds": seconds}
        body = response.json()
        images = body.get("data") or []
        bad = [i for i, item in enumerate(images) if "b64_json" in item and not sound(item)]
        if bad:
            return {"status": 200, "error": f"image(s) {bad} blank or one colour", "seconds": seconds}
        return {"status": 200, "seconds": seconds, "images": len(images)}

    # ---- the clients and the sampler ----
    def next_kind(self) -> tuple[str, int]:
        """The next request of the one sequence every client draws from, in turn (kind, seed): two runs of the
        same mix send the same kinds in the same order, whatever the number of clients or GPUs, so their images
        a minute compare (with a sequence per client, 4 minutes of 2 GPUs drew 21 % 40-step edits, of 1 GPU 17 %)."""
        with self.lock:
            return self.sequence.choices(list(self.mix), list(self.mix.values()))[0], self.sequence.randrange(1 << 30)

    def client(self, index: int, until: float) -> None:
        rng = random.Random(index)  # its pauses
        with httpx.Client(timeout=self.args.request_timeout) as client:
            while time.monotonic() < until and not self.stop.is_set():
                kind, seed = self.next_kind()
                started = time.monotonic()
                outcome = self.send(client, kind, seed)
                with self.lock:
                    self.done.append({"kind": kind, "client": index, "at": started, **outcome})
                if self.args.think > 0:
                    self.stop.wait(rng.expovariate(1 / self.args.think))

    def batch(self, until: float) -> None:
        """One job of --batch-items edits at a time through the jobs API, until `until` (then cancelled)."""
        fields = {"prompt": PROMPT, "size": f"{self.args.size}x{self.args.size}", "seed": "1",
                  "num_inference_steps": str(self.args.steps)}
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < until and not self.stop.is_set():
                files = [("batch", (f"batch-{i}.png", self.pictures[i % 4], "image/png"))
                         for i in range(self.args.batch_items)]
                started = time.monotonic()
                answer = client.post(f"{self.url}/v1/jobs", headers=self.headers, data=fields, files=files)
                if answer.status_code != 202:  # accepted
                    with self.lock:
                        self.batches.append({"at": started, "error": f"{answer.status_code}: {answer.text[:120]}"})
                    self.stop.wait(1)
                    continue
                view = self._follow(client, answer.json()["id"], until)
                states = [item["state"] for item in view["items"]]
                with self.lock:
                    self.batches.append({"at": started, "seconds": round(time.monotonic() - started, 2),
                                         "state": view["state"], "items": len(states),
                                         "succeeded": states.count("succeeded"),
                                         "errors": [item["error"] for item in view["items"]
                                                    if item["state"] == "failed"]})

    def _follow(self, client: httpx.Client, job_id: str, until: float) -> dict:
        """The job's view once it has ended; cancelled when `until` passes first."""
        cancelled = False
        while True:
            view = client.get(f"{self.url}/v1/jobs/{job_id}", headers=self.headers).json()
            if view["state"] not in ("queued", "running", "cancelling"):
                return view
            if not cancelled and time.monotonic() >= until:
                client.delete(f"{self.url}/v1/jobs/{job_id}", headers=self.headers)
                cancelled = True
            time.sleep(0.5)

    def sampler(self, began: float) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.wait(self.args.sample):
                try:
                    health = client.get(f"{self.url}/health").json()
                except (httpx.HTTPError, ValueError):
                    continue
                utils = [g.get("utilization_percent") for g in health.get("gpus") or ()
                         if g.get("index") in self.gpus]
                self.samples.append({"s": round(time.monotonic() - began, 1), "waiting": health.get("waiting"),
                                     "gpu_utilization": utils})

    def counters(self) -> dict[str, float]:
        """COUNTERS from /metrics (each missing where /metrics does not answer it): the times items of jobs
        paused for the edits, the graphs torch.compile compiled while edits ran."""
        try:
            text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30).text
        except httpx.HTTPError:
            return {}
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in COUNTERS:
                found[COUNTERS[name]] = float(value)
        return found

    def run(self) -> dict:
        before = self.counters()
        began = time.monotonic()
        until = began + self.args.minutes * 60
        sampler = threading.Thread(target=self.sampler, args=(began,), daemon=True)
        sampler.start()
        clients = [threading.Thread(target=self.client, args=(i, until)) for i in range(self.args.clients)]
        if self.args.batch_items:
            clients.append(threading.Thread(target=self.batch, args=(until,)))
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        self.stop.set()
        sampler.join(timeout=15)
        report = self.report(time.monotonic() - began)
        after = self.counters()
        for key in COUNTERS.values():
            report[key] = int(after[key] - before[key]) if key in before and key in after else None
        return report

    def report(self, elapsed: float) -> dict:
        ok = [d for d in self.done if d["status"] == 200 and "error" not in d]
        errors: dict[str, int] = {}
        for d in self.done:
            if d not in ok:
                key = f"{d['status']}: {d['error'][:120]}"
                errors[key] = errors.get(key, 0) + 1
        kinds = {}
        for kind in self.mix:
            seconds = sorted(d["seconds"] for d in ok if d["kind"] == kind)
            if seconds:
                p50, p95, p99 = (quantile(seconds, q) for q in (0.5, 0.95, 0.99))
                kinds[kind] = {"n": len(seconds), "p50_s": round(p50, 3), "p95_s": round(p95, 3),
                               "p99_s": round(p99, 3), "p99_over_p50": round(p99 / p50, 2)}
        batch_images = sum(b.get("succeeded", 0) for b in self.batches)
        for b in self.batches:
            for error in [b["error"]] if "error" in b else b["errors"]:
                key = f"batch: {error[:120]}"
                errors[key] = errors.get(key, 0) + 1
        images = sum(d.get("images", 0) for d in ok) + batch_images
        waiting = [s["waiting"] for s in self.samples if s["waiting"] is not None]
        utils = [u for s in self.samples for u in s["gpu_utilization"] if u is not None]
        gpus = len(self.gpus)
        return {
            "url": self.url, "clients": self.args.clients, "seconds": round(elapsed, 1), "mix": self.mix,
            "left_out": self.left_out, "requests": len(self.done), "ok": len(ok), "images": images,
            "images_per_minute": round(images / elapsed * 60, 2),
            "gpus": self.gpus,
            "images_per_minute_per_gpu": round(images / elapsed * 60 / gpus, 2) if gpus else None,
            "kinds": kinds, "errors": errors, "think_s": self.args.think,
            "batch": {"items_a_job": self.args.batch_items, "jobs": self.batches, "images": batch_images}
            if self.args.batch_items else None,
            "queue": {"min": min(waiting, default=None), "max": max(waiting, default=None),
                      "mean": round(statistics.fmean(waiting), 2) if waiting else None},
            "gpu_utilization_mean": round(statistics.fmean(utils), 1) if utils else None,
            "samples": self.samples,
        }


def quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default), from sorted values."""
    position = (len(sorted_values) - 1) * q
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:7860")
    parser.add_argument("--key", default=None, help="API_KEY of the server, if it has one")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--mix", default=DEFAULT_MIX, help=f"kind=weight,... (default {DEFAULT_MIX})")
    parser.add_argument("--steps", type=int, default=40, help="steps of the quality edits and text to image")
    parser.add_argument("--size", type=int, default=1024, help="side of the inputs and outputs")
    parser.add_argument("--seed", type=int, default=0, help="the sequence of kinds every client draws from")
    parser.add_argument("--think", type=float, default=0.0, help="a client's mean pause between its requests, "
                        "in seconds (exponential); 0: none")
    parser.add_argument("--batch-items", type=int, default=0, help="beside the clients, one /v1/jobs job of this "
                        "many --steps edits at a time (0: none)")
    parser.add_argument("--sample", type=float, default=2.0, help="seconds between /health samples")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--assume-speeds", action="store_true", help="send fast/fastest even if /health "
                        "offers no LoRA for them (they are then refused: errors)")
    parser.add_argument("--assume-t2i", action="store_true", help="send text to image whatever the model")
    parser.add_argument("--json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    health = httpx.get(f"{args.url.rstrip('/')}/health", timeout=30).json()
    load = Load(args, health)
    print(f"{args.clients} clients for {args.minutes} min: mix {load.mix}; left out {load.left_out or 'none'}",
          flush=True)
    report = load.run()
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
