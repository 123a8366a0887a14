"""The running server on the GPUs: end-to-end edit time through gradio_client, and the GPU panel
against nvidia-smi while the edit runs.

    python benchmarks/app_check.py [--device-map balanced] [--steps 40] [--size 1024] [--json out.json]

Starts the real app (REST + Gradio, one port) on a real-size random-weight checkpoint, submits
edits with gradio_client, and while each runs polls `/gpu_status` and `nvidia-smi` at the same
moment. Reports client-side seconds per image, the manager's own job seconds (the difference is the
queue/UI/transfer overhead) and the largest panel-vs-nvidia-smi difference per GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvicorn  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from PIL import Image  # noqa: E402

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.web.app import build_app  # noqa: E402


def smi() -> dict[str, float]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return {u.strip(): float(m) for u, m in (line.split(",") for line in out.strip().splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/qwen-image-edit-real-random")
    parser.add_argument("--device-map", default="balanced")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ckpt = Path(args.ckpt)
    if not (ckpt / "model_index.json").is_file():
        build_checkpoint(ckpt, kind="plus", size="real")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": args.device_map,
                              "GRADIO_SERVER_PORT": str(port)})
    manager = PipelineManager(settings).load()
    jobs = []
    manager.listeners.append(jobs.append)
    server = uvicorn.Server(uvicorn.Config(build_app(settings, manager), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    image_path = Path("/tmp/app_check_input.png")
    Image.new("RGB", (args.size, args.size), (40, 90, 160)).save(image_path)
    client = Client(url, verbose=False)
    client.predict([handle_file(str(image_path))], "warm up", "", 0, False, 2, 4.0, 1, args.size, args.size,
                   api_name="/edit")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device_map": args.device_map,
              "steps": args.steps, "size": args.size, "command": " ".join(sys.argv), "runs": []}
    poller = Client(url, verbose=False)  # a second client, as a second browser tab would be
    for run in range(args.runs):
        done: dict[str, float] = {}

        def one(seed: int = run, done: dict = done) -> None:
            t0 = time.perf_counter()
            client.predict([handle_file(str(image_path))], "turn the sky into a sunset", "", seed, False,
                           args.steps, 4.0, 1, args.size, args.size, api_name="/edit")
            done["client_s"] = time.perf_counter() - t0

        worker = threading.Thread(target=one)
        worker.start()
        worst: dict[str, float] = {}
        moving: dict[str, int] = {}
        samples = 0
        while worker.is_alive():
            # nvidia-smi just before and just after the panel read: memory moves fast during a job,
            # so compare only samples where it held still around the read.
            before = smi()
            panel = poller.predict(api_name="/gpu_status")
            truth = smi()
            for g in panel["gpus"]:
                used = truth[g["uuid"]]
                if before[g["uuid"]] != used:
                    moving[f"cuda:{g['index']}"] = moving.get(f"cuda:{g['index']}", 0) + 1
                    continue
                key = f"cuda:{g['index']}"
                worst[key] = round(max(worst.get(key, 0.0), abs(g["used_mib"] - used) / max(used, 1.0)), 4)
                report.setdefault("panel_example", panel["gpus"])
                report.setdefault("smi_example", truth)
            samples += 1
            time.sleep(1.0)
        worker.join()
        client_s = done["client_s"]
        manager_s = jobs[-1].seconds
        report["runs"].append({"client_s_per_image": round(client_s, 2), "manager_s": round(manager_s, 2),
                               "overhead_s": round(client_s - manager_s, 2),
                               "overhead_pct": round(100 * (client_s - manager_s) / manager_s, 2),
                               "panel_samples": samples, "panel_vs_smi_max_rel_diff": worst,
                               "samples_skipped_memory_moving": moving})
        print(json.dumps(report["runs"][-1]), flush=True)
    server.should_exit = True
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
