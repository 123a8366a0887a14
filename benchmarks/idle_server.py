"""The CPU an idle server process spends, per second: the app as it runs, and with Gradio's own queue polling.

    python benchmarks/idle_server.py [--seconds 20]

The server process only (REST + the Gradio page under uvicorn, in a thread, as app.py serves it), on the tiny
checkpoint with one CPU worker process (its CPU is not counted), no page open, no request. "gradio" puts the
queue's idle polls back to Gradio's values (gradio.queueing.Queue on Linux: 1 ms and 10 ms); "app" keeps the
app's (imgedit.web.app.QUEUE_IDLE_POLL_S, PROGRESS_POLL_S).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imgedit.config.settings import load_settings  # noqa: E402
from imgedit.engine.manager import PipelineManager  # noqa: E402
from imgedit.model.demo_checkpoint import build_checkpoint  # noqa: E402
from imgedit.web.app import build_app  # noqa: E402

GRADIO_POLLS = {"sleep_when_free": 0.001, "progress_update_sleep_when_free": 0.01}


def idle_cpu(app, seconds: float, polls: dict | None) -> float:
    import gradio as gr
    import uvicorn

    blocks = next(route.app.blocks for route in app.routes if isinstance(getattr(route, "app", None), gr.routes.App))
    for name, value in (polls or {}).items():
        setattr(blocks._queue, name, value)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    time.sleep(2)  # start-up work done
    started, cpu = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    used = (time.process_time() - cpu) / (time.perf_counter() - started)
    server.should_exit = True
    thread.join(10)
    return round(used, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    args = parser.parse_args()
    ckpt = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="plus")
    settings = load_settings({"QWEN_MODEL_DIR": str(ckpt), "DEVICE_MAP": "cpu", "LOG_LEVEL": "WARNING",
                              "OUTPUT_DIR": tempfile.mkdtemp()})
    manager = PipelineManager(settings).load()
    try:
        result = {}
        for label, polls in (("gradio", GRADIO_POLLS), ("app", None)):
            result[label] = idle_cpu(build_app(settings, manager), args.seconds, polls)
    finally:
        manager.close()
    print(json.dumps({"cpu_s_per_s": result, "seconds": args.seconds, "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
