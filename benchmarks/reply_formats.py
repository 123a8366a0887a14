"""The reply's format against the request's time: start `python app.py` (Qwen-Image-2.1 with its Turbo in fp8 by
default: the settings below), wait for /health, then time `/v1/images/generations` at `speed=fastest`, 1024², one
image, for each `output_format` in turn (PNG, JPEG, WebP, twice over, then JPEG twice), seconds end to end and the
reply's size, and that each image is finite (benchmarks/acceptance.py's check: not one constant colour, as NaN
latents decode; the exit status is 1 otherwise). The real-size random-weight checkpoints are the ones
benchmarks/acceptance.py builds (rows 21-one, 21-turbo); COMPILE_CACHE_DIR points at the 21-turbo row's cache, so
this start is a restart.

    python benchmarks/reply_formats.py [--port 7991] [--env KEY=VALUE ...] > formats.txt
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import subprocess
import sys
import time

import httpx
from acceptance import check_image
from PIL import Image

SETTINGS = {"QWEN_MODEL_DIR": "/tmp/qwen-image-2.1-real-random",
            "TURBO_MODEL_DIR": "/tmp/qwen-image-2.1-turbo-real-random",
            "QUANTIZE": "fp8", "DEVICE_MAP": "cuda:0", "COMPILE_CACHE_DIR": "/tmp/acc-tfp8/compile-cache/21-turbo",
            "OUTPUT_DIR": "/tmp/reply-formats-out"}
FORMATS = ("png", "jpeg", "webp", "png", "jpeg", "webp", "jpeg", "jpeg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=7991)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE over the defaults above")
    parser.add_argument("--log", default="/tmp/reply-formats-server.log", help="the server's log")
    args = parser.parse_args()
    env = {**os.environ, **SETTINGS, "GRADIO_SERVER_PORT": str(args.port),
           **dict(item.split("=", 1) for item in args.env)}
    started = time.time()
    with open(args.log, "w") as log:
        proc = subprocess.Popen([sys.executable, "app.py"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while time.time() - started < 400:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        print(f"ready {time.time() - started:.1f}", flush=True)
        finite = True
        with httpx.Client(timeout=120) as client:
            for image_format in FORMATS:
                begun = time.perf_counter()
                reply = client.post(url + "/v1/images/generations",
                                    json={"prompt": "a red fox in the snow, photograph", "size": "1024x1024",
                                          "seed": 7, "speed": "fastest", "output_format": image_format})
                seconds = time.perf_counter() - begun
                image = Image.open(io.BytesIO(base64.b64decode(reply.json()["data"][0]["b64_json"])))
                _, ok, size = check_image(image, (1024, 1024))
                finite = finite and ok
                print(f"{image_format:5s} {reply.status_code} {seconds:.3f} s  {len(reply.content) / 1e6:.2f} MB "
                      f"{size} finite={ok}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    sys.exit(0 if finite else 1)


if __name__ == "__main__":
    main()
