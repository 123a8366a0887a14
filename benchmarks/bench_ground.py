"""Time `mask_prompt` (select what to edit by words) through `python app.py`'s REST, as users call it.

    python benchmarks/bench_ground.py [--kind plus|21] [--ckpt DIR] [--size 1024] [--repeats 3]
        [--env KEY=VALUE ...] [--out /tmp/bench-ground] [--json FILE]
    python benchmarks/bench_ground.py --tiny          # CPU smoke run on the tiny checkpoint (64x64)

Starts `python app.py` (benchmarks/acceptance.py's Server: its own process group, its log to OUT/server.log) on the
real-size random-weight checkpoint of --kind (built at --ckpt when missing: /tmp/qwen-image-edit-real-random or
/tmp/qwen-image-2.1-real-random; --tiny: a tiny one under OUT), DEVICE_MAP=cuda:0 unless --env says otherwise,
waits for /health, then times, each --repeats times (the first apart: the encoder's first vision call):

    POST /v1/masks              mask_prompt's outline alone (the page's Select)
    POST /v1/images/edits       an edit with mask_prompt (the outline inside the edit's job)

Random weights never write a box, so each request is expected to be refused (400, param mask_prompt, "found
nothing it could outline"), the outline given up after model.boxes.BOX_WITHIN (48) tokens without a box
begun: what is timed is what a user waits for "nothing found" (a trained model writes its boxes to its
answer's end, at most engine.validation.OUTLINE_MAX_TOKENS, 256). A 200 is recorded with its boxes. The
worker's own account of each outline (tokens and seconds, from its log line "outline of ...") gives ms a
token. Exit status 1 when the server did not get ready or a request was neither refused as expected nor
answered.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
from acceptance import (  # noqa: E402  (its imports put the repository on the path)
    Server,
    free_port,
    input_picture,
    prepare_checkpoint,
    process_env,
    wait_ready,
)

CHECKPOINTS = {"plus": "/tmp/qwen-image-edit-real-random", "21": "/tmp/qwen-image-2.1-real-random"}
PHRASE = "the red car"
OUTLINED = re.compile(r"outline of .*?: (\d+) token\(s\) in ([\d.]+)s")


def timed_post(http: httpx.Client, url: str, path: str, picture: bytes, fields: dict) -> dict:
    """One request: seconds, status, and what came back (refused as expected, or the boxes)."""
    t0 = time.perf_counter()
    response = http.post(f"{url}{path}", files={"image": ("input.png", picture, "image/png")}, data=fields)
    seconds = time.perf_counter() - t0
    record = {"path": path, "status": response.status_code, "s": round(seconds, 3)}
    try:
        body = response.json()
    except ValueError:
        return {**record, "ok": False, "error": response.text[:300]}
    if response.status_code == 400:
        error = body.get("error") or {}
        record["refused"] = error.get("message", "")[:200]
        record["ok"] = error.get("param") == "mask_prompt" and "found nothing" in record["refused"]
    elif response.status_code == 200:
        record["boxes"] = body.get("boxes") or body.get("mask_boxes")
        record["ok"] = bool(record["boxes"])
    else:
        record.update(ok=False, error=str(body)[:300])
    return record


def worker_outlines(log_path: Path) -> list[tuple[int, float]]:
    """(tokens, seconds) of every outline the workers logged."""
    return [(int(t), float(s)) for t, s in OUTLINED.findall(log_path.read_text(errors="replace"))]


def summary(records: list[dict]) -> dict:
    steady = [r["s"] for r in records[1:]] or [records[0]["s"]]
    return {"first_s": records[0]["s"], "steady_median_s": round(statistics.median(steady), 3),
            "all_ok": all(r["ok"] for r in records)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--kind", choices=tuple(CHECKPOINTS), default="plus",
                        help="plus (Qwen2.5-VL encoder) or 21 (Qwen-Image-2.1, Qwen3-VL)")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder, built when it has no model_index.json")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU, a 64x64 input")
    parser.add_argument("--size", type=int, default=None, help="the input's side (1024; --tiny 64)")
    parser.add_argument("--steps", type=int, default=4, help="steps of the edit (never reached when refused)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="a server setting")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--out", default="/tmp/bench-ground", help="the server's log, a tiny checkpoint")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default = out / f"tiny-checkpoint-{args.kind}" if args.tiny else Path(CHECKPOINTS[args.kind])
    ckpt = prepare_checkpoint(Path(args.ckpt or default).expanduser(), args.tiny, kind=args.kind)
    settings = {"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu" if args.tiny else "cuda:0",
                "GRADIO_SERVER_PORT": str(free_port()), "OUTPUT_DIR": str(out / "outputs")}
    settings.update(pair.split("=", 1) for pair in args.env)
    size = args.size or (64 if args.tiny else 1024)
    picture = input_picture(size)
    print(f"starting app.py: {' '.join(f'{k}={shlex.quote(v)}' for k, v in settings.items())}", flush=True)
    server = Server(process_env(settings), out / "server.log")
    report: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "kind": args.kind,
                    "size": size, "settings": settings}
    try:
        ready = wait_ready(server, args.ready_timeout)
        report["ready_s"] = ready.get("ready_s")
        if not ready["ready"]:
            print(f"not ready: {ready.get('error')}\n{ready.get('log_tail', '')}", flush=True)
            report["error"] = ready.get("error")
            return 1
        with httpx.Client(timeout=900) as http:
            for name, path, fields in (
                    ("masks", "/v1/masks", {"mask_prompt": PHRASE}),
                    ("edit", "/v1/images/edits", {"mask_prompt": PHRASE, "prompt": "paint it blue",
                                                  "num_inference_steps": str(args.steps)})):
                records = [timed_post(http, server.url, path, picture, fields) for _ in range(args.repeats)]
                report[name] = {"requests": records, **summary(records)}
                print(f"{path:18s} first {records[0]['s']:.3f} s, then "
                      f"{report[name]['steady_median_s']:.3f} s (median); "
                      f"{'as expected' if report[name]['all_ok'] else 'UNEXPECTED: ' + json.dumps(records)}",
                      flush=True)
    finally:
        report["stop"] = server.stop()
        outlines = worker_outlines(out / "server.log")
        if outlines:
            report["worker_outlines"] = [{"tokens": t, "s": s} for t, s in outlines]
            per_token = [1000 * s / t for t, s in outlines[1:] or outlines if t]
            report["ms_per_token_median"] = round(statistics.median(per_token), 2) if per_token else None
            print(f"worker: {len(outlines)} outline(s), {outlines[-1][0]} tokens each, "
                  f"{report['ms_per_token_median']} ms a token (median, first left out)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(report[k]["all_ok"] for k in ("masks", "edit")) else 1


if __name__ == "__main__":
    sys.exit(main())
