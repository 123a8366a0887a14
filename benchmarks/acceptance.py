"""The acceptance run of the app as users start it: `python app.py`, settings in the environment only.

    python benchmarks/acceptance.py [--rows balanced,auto,cuda0,...] [--restart] [--compile off|on]
        [--ckpt DIR] [--steps 40] [--other-steps N] [--size 1024] [--env KEY=VALUE ...] [--ready-timeout 900]
        [--out /tmp/acceptance] [--json FILE]
    python benchmarks/acceptance.py --tiny --rows balanced,auto --restart --json /tmp/acc.json   # CPU

For each row of ROWS (a name and its settings) the script starts `python app.py` as a subprocess in its
own session (its output, never piped, goes to OUT/<row>.log), with QWEN_MODEL_DIR (the real-size
random-weight checkpoint at --ckpt, built once; --tiny: the tiny one, on the CPU), LORA_DIR (a random
Lightning 4-step and 8-step LoRA, named as lightx2v names them, so that the speed presets find them),
GRADIO_SERVER_PORT (a free port), COMPILE_CACHE_DIR (OUT/compile-cache/<row>, emptied when the row
starts: the first start compiles from scratch, a restart finds the cache), OUTPUT_DIR, the row's own
settings and every --env. imgedit settings of the calling shell are not passed on: a row is exactly its
line below plus --env. (A `.env` file in the repository still fills in what a row leaves unset; the
script warns when there is one.)

Per row it polls GET /health until 200 (ready), "failed", the process's end or --ready-timeout, printing
every distinct loading message (each worker's state and detail, its fallbacks, errors) with the time it
appeared: what a user sees while waiting. Then, each timed and its images checked (count, size, and
"finite": not one constant colour, as NaN latents decode):

    REST /v1/images/edits   a --steps edit twice (first, steady); speed=fastest and speed=fast twice each
                            (the Lightning LoRAs must be offered); a masked edit (OpenAI's mask: transparent
                            = edit); enhance_prompt=true; the 8-step LoRA picked at lora_scale 0.5 on a
                            quality edit; cache=taylorseer (a 400 that says the server cannot run it is
                            recorded as "refused", which passes: compiled workers refuse it); n=2
    gradio_client /edit     an --other-steps edit once

The mask, enhance, LoRA, cache, n=2 and gradio edits take --other-steps (default: --steps) so that a GPU
run of every row fits the time a machine is held; their timings are then not 40-step figures.
    /v1/prompts/enhance     a prompt rewrite: seconds and, when the reply says how many tokens were written
                            (a random text encoder never ends its answer, so the notice says it was cut at
                            ENHANCE_MAX_TOKENS), milliseconds per token (queue and prefill included)

Rows 2511-one and 2511-16gb serve Qwen-Image-Edit-2511 (its real-size random checkpoint at --ckpt2511: 2509's
with zero_cond_t) with the edit rows' requests, for the comparison with 2.1's rows on the same card.

Row 21-turbo serves Qwen-Image-2.1 on one GPU with TURBO_MODEL_DIR (the real-size random-weight Turbo checkpoint
at --ckpt21turbo, `--kind 21turbo --size real`; --tiny: the tiny one): the 21 rows' requests, then speed=fastest
and speed=fast text to image twice each (first, steady), a speed=fastest edit of the input picture and one of 3
references (the Turbo's 8 steps, CFG off).

Rows 21-one, 21-pair and 21-16gb serve Qwen-Image-2.1 (its real-size random-weight checkpoint at --ckpt21,
built from the published configs; --tiny: the tiny one) with a random LoRA of its own, and make instead:

    REST /v1/images/generations   a --steps text to image twice (first, steady)
    REST /v1/images/edits         edits with 1, 3, 5 and 10 references at --steps; a 10-reference edit, an RGBA
                                  input (its alpha kept), the LoRA at lora_scale 0.5 and a masked edit at
                                  --other-steps
    gradio_client /edit           a text to image without an image at --other-steps
    /v1/prompts/enhance           a prompt rewrite (ms per token, as the edit rows)
    mixed-01 ... mixed-20         text to image and edits with 1-10 references, prompts of 4-60 words, at
                                  --other-steps (`--only mixed`): each fails if torch.compile compiled a graph
                                  while it ran (/metrics' imgedit_compiled_graphs_total), so the row counts the
                                  recompiles after the warm-up

With --load MINUTES, benchmarks/load.py then drives the same server for that long (--load-clients at once,
default 3 a GPU its workers hold; --load-mix, --load-think, --load-batch): images a minute, latency per kind,
the queue, GPU utilisation and errors (there must be none), kept in the row's JSON as "load".

With --restart the server is then stopped (SIGTERM) and started again with the same settings and compile
cache: the restart's time to ready, and one REST edit. The server is always stopped at the end of a row
(SIGTERM, then its whole process group killed if need be); processes of the group still alive after the
server exited are recorded as left over.

Output: --json FILE (date, GPUs, command, per row: settings, time to ready, loading messages, /health at
ready, every request), a markdown table printed and written to OUT/acceptance.md. The exit status is 1 when
a row did not get ready or a request that should succeed failed, came back with the wrong number or size
of images, or not finite; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from imgedit.config.settings import REGISTRY  # noqa: E402  (no torch: settings only)

# Each row: the settings it adds to the common ones (an absent DEVICE_MAP is the default, balanced).
ROWS: dict[str, dict[str, str]] = {
    "balanced": {},
    "auto": {"DEVICE_MAP": "auto"},
    "cuda0": {"DEVICE_MAP": "cuda:0"},
    "replicas": {"DEVICE_MAP": "replicas"},
    "cfg-parallel": {"DEVICE_MAP": "cfg-parallel"},
    "ulysses": {"DEVICE_MAP": "ulysses"},
    "24gb": {"MAX_MEMORY": "22GiB", "CUDA_VISIBLE_DEVICES": "0"},
    "split31": {"MAX_MEMORY": "31GiB", "CUDA_VISIBLE_DEVICES": "0,1"},
    "fp8": {"DEVICE_MAP": "auto", "FAST_QUANTIZE": "fp8", "FAST_QUANTIZE_SPEEDS": "fastest"},
    # Qwen-Image-2.1 (FAMILY_21): one GPU, two (auto: a replica each, no CFG pairs), a 16 GB card
    "21-one": {"DEVICE_MAP": "cuda:0"},
    "21-pair": {"DEVICE_MAP": "auto", "CUDA_VISIBLE_DEVICES": "0,1"},
    "21-16gb": {"MAX_MEMORY": "14.5GiB", "CUDA_VISIBLE_DEVICES": "0"},
    # Qwen-Image-2.1's latency mode on 2 GPUs: each forward's target image split over both (split21)
    "21-split": {"DEVICE_MAP": "ulysses", "CUDA_VISIBLE_DEVICES": "0,1"},
    # Qwen-Image-2.1 with its Turbo (TURBO_MODEL_DIR: the real-size random Turbo checkpoint at --ckpt21turbo)
    "21-turbo": {"DEVICE_MAP": "cuda:0"},
    # Qwen-Image-Edit-2511 (FAMILY_2511, its own checkpoint): the edit rows' requests, beside 2.1's rows
    "2511-one": {"DEVICE_MAP": "cuda:0"},
    "2511-16gb": {"MAX_MEMORY": "14.5GiB", "CUDA_VISIBLE_DEVICES": "0"},
}
FAMILY_21 = ("21-one", "21-pair", "21-16gb", "21-turbo", "21-split")
TURBO_ROWS = ("21-turbo",)
FAMILY_2511 = ("2511-one", "2511-16gb")
# --tiny: the same row names on the CPU (the harness itself is what is tested there). Rows that need GPUs
# run with DEVICE_MAP=cpu; fp8 needs a CUDA GPU, so its CPU row makes the int8 copy instead.
CPU_ROWS: dict[str, dict[str, str]] = {
    "balanced": {},
    "auto": {"DEVICE_MAP": "auto"},
    "cuda0": {"DEVICE_MAP": "cpu"},
    "replicas": {"DEVICE_MAP": "cpu"},
    "cfg-parallel": {"DEVICE_MAP": "cpu"},
    "ulysses": {"DEVICE_MAP": "cpu"},
    "24gb": {"DEVICE_MAP": "cpu"},
    "split31": {"DEVICE_MAP": "cpu"},
    "fp8": {"DEVICE_MAP": "cpu", "FAST_QUANTIZE": "int8", "FAST_QUANTIZE_SPEEDS": "fastest"},
    "21-one": {"DEVICE_MAP": "cpu"},
    "21-pair": {"DEVICE_MAP": "auto"},
    "21-16gb": {"DEVICE_MAP": "cpu"},
    "21-turbo": {"DEVICE_MAP": "cpu"},
    "21-split": {"DEVICE_MAP": "cpu"},
    "2511-one": {"DEVICE_MAP": "cpu"},
    "2511-16gb": {"DEVICE_MAP": "cpu"},
}
LORA_21 = "Acceptance-Style-21"  # a random LoRA of Qwen-Image-2.1's attention layers
LORA_FILES = {4: "Acceptance-Lightning-4steps-V1.0-bf16", 8: "Acceptance-Lightning-8steps-V1.0-bf16"}
PROMPT = "turn the sky into a sunset and keep everything else unchanged"
OTHER_PROMPT = "a lighthouse on a cliff at dawn, waves below"  # a prompt the server has not seen: its encode and prefix
SAME_LENGTH_PROMPT = "a cliff on a lighthouse at dawn, waves below"  # OTHER_PROMPT's tokens in another order
LONGER_PROMPT = "a red fox asleep in fresh snow under soft morning light, a pine forest behind it, mist rising"
POLL_S = 0.5
STOP_WAIT_S = 120  # SIGTERM: the server lets running jobs finish (none are running when it is sent)
CUT_AT = re.compile(r"cut at the (\d+)-token limit")
PHASE_SUM = re.compile(r'^imgedit_request_phase_seconds_sum\{phase="(\w+)"\} (\S+)$', re.M)
COMPILED_TOTAL = re.compile(r"^imgedit_compiled_graphs_total (\S+)$", re.M)
COMPILED = "compiled_graphs"  # phase_sums' key for it
MIXED_REQUESTS = 20  # 2.1's mixed-NN requests: "no recompile after the warm-up over 20 requests"
MIXED_WORDS = ("make the sky blue add a small cat on the left remove the text turn it into a watercolor with soft "
               "light and a red roof keep the face the same put the dog from picture two on the sofa of picture "
               "one a lighthouse at dawn waves below mist rising over a pine forest").split()


# ---- set-up: checkpoint, LoRAs, pictures ----

def prepare_checkpoint(path: Path, tiny: bool, kind: str = "plus") -> Path:
    """The checkpoint at `path`, built when it has no model_index.json (tiny, or real-size random)."""
    if (path / "model_index.json").is_file():
        return path
    from imgedit.model.demo_checkpoint import build_checkpoint

    print(f"building the {'tiny' if tiny else 'real-size random-weight'} {kind} checkpoint at {path}", flush=True)
    return build_checkpoint(path, kind=kind, size="tiny" if tiny else "real")


def family_settings(args, out_dir: Path, kind: str, given: str | None, real: str, prepare) -> dict[str, str]:
    """QWEN_MODEL_DIR and LORA_DIR of a family's own rows: its checkpoint (`given`, else the tiny one under
    `out_dir` or the real-size one at `real`, built when missing) and its LoRAs, written by `prepare`."""
    default = out_dir / f"tiny-checkpoint-{kind}" if args.tiny else Path(real)
    ckpt = prepare_checkpoint(Path(given or default).expanduser(), args.tiny, kind=kind)
    loras = out_dir / f"loras-{kind}-{'tiny' if args.tiny else 'real'}"
    loras.mkdir(parents=True, exist_ok=True)
    prepare(loras, ckpt, args.tiny)
    return {"QWEN_MODEL_DIR": str(ckpt), "LORA_DIR": str(loras)}


def prepare_lora_21(folder: Path, ckpt: Path, tiny: bool) -> str:
    """A random LoRA of Qwen-Image-2.1's attention (diffusers' names) in `folder`, kept when already there."""
    path = folder / f"{LORA_21}.safetensors"
    if not path.is_file():
        from imgedit.model.lora_random import random_lora
        from imgedit.model.loras import transformer_linears

        print(f"writing {path}", flush=True)
        random_lora(path, transformer_linears(ckpt), rank=4 if tiny else 64, std=0.02, style="diffusers")
    return LORA_21


def prepare_loras(folder: Path, ckpt: Path, tiny: bool) -> dict[int, str]:
    """A random Lightning-shaped LoRA per step count in `folder` (kept when already there); their names."""
    missing = [steps for steps, stem in LORA_FILES.items() if not (folder / f"{stem}.safetensors").is_file()]
    if missing:
        from imgedit.model.lora_random import random_lora
        from imgedit.model.loras import transformer_linears

        linears = transformer_linears(ckpt)
        for steps in missing:
            path = folder / f"{LORA_FILES[steps]}.safetensors"
            print(f"writing {path}", flush=True)
            random_lora(path, linears, rank=4 if tiny else 64, std=0.02, seed=steps)
    return dict(LORA_FILES)


def input_picture(size: int, alpha: bool = False) -> bytes:
    """A size x size PNG with structure: two gradients and a checkerboard (never one colour); with `alpha`,
    RGBA whose left half is transparent."""
    ramp = np.arange(size, dtype=np.float32) * 255 / max(1, size - 1)
    x, y = np.meshgrid(ramp, ramp)
    cells = np.arange(size) * 8 // size
    checker = ((cells[None, :] + cells[:, None]) % 2) * 255
    pixels = np.stack([x, y, checker.astype(np.float32)], axis=-1).astype(np.uint8)
    if alpha:
        opacity = np.full((size, size, 1), 255, dtype=np.uint8)
        opacity[:, : size // 2] = 0
        return png(Image.fromarray(np.concatenate([pixels, opacity], axis=-1), "RGBA"))
    return png(Image.fromarray(pixels, "RGB"))


def mask_picture(size: int) -> bytes:
    """OpenAI's mask form: an RGBA PNG whose transparent pixels (a centred square) are to be edited."""
    alpha = np.full((size, size), 255, dtype=np.uint8)
    alpha[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 0
    pixels = np.dstack([np.full((size, size, 3), 255, dtype=np.uint8), alpha])
    return png(Image.fromarray(pixels, "RGBA"))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def check_image(image: Image.Image, expected: tuple[int, int]) -> tuple[bool, bool, str]:
    """(size right, finite, size): finite = not every pixel the same (a NaN result decodes to one colour)."""
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    finite = bool((pixels != pixels[0]).any())
    return image.size == expected, finite, f"{image.width}x{image.height}"


# ---- the server process ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


class Server:
    """`python app.py` in its own session, its output to a log file; `stop` leaves no process behind."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.port = int(env["GRADIO_SERVER_PORT"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> dict:
        """SIGTERM, wait for the exit, then kill the group if anything is left: how it went."""
        out: dict = {}
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        try:
            if self.proc.poll() is None:
                t0 = time.monotonic()
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_WAIT_S)
                    out["stop_s"] = round(time.monotonic() - t0, 1)
                except subprocess.TimeoutExpired:
                    out["problem"] = f"the server did not exit within {STOP_WAIT_S} s of SIGTERM; killed"
            if self.proc.poll() is not None:
                out["exit_code"] = self.proc.returncode
                deadline = time.monotonic() + 5  # workers notice their parent's end within a second or two
                while (left := group_members(pgid)) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if left:
                    out["left_over_processes"] = len(left)
        finally:  # whatever happened (a timeout, a second Ctrl-C): nothing of the server's group survives
            if self.proc.poll() is None or group_members(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(30)
            self.log.close()
        return out


def health_messages(body: dict) -> list[str]:
    """What /health says a user is waiting for: the state, each worker's state and detail, its fallbacks
    and errors, the server's error."""
    lines = [f"status {body.get('status')}" + (f" - {body['detail']}" if body.get("detail") else "")]
    for worker in body.get("workers") or ():
        line = f"{worker.get('name')}: {worker.get('state')}"
        if worker.get("detail"):
            line += f" - {worker['detail']}"
        lines.append(line)
        if worker.get("error"):
            lines.append(f"{worker.get('name')} error: {worker['error']}")
        lines.extend(f"{worker.get('name')} fallback: {why}" for why in worker.get("fallbacks") or ())
    lines.extend(f"fallback: {why}" for why in body.get("fallbacks") or ())
    if body.get("error"):
        lines.append(f"error: {body['error']}")
    return lines


def wait_ready(server: Server, timeout: float) -> dict:
    """Poll /health until ready, failed, the process's end or the timeout; print every new message."""
    seen: set[str] = set()
    messages: list[dict] = []
    body: dict | None = None

    def note(text: str) -> None:
        if text not in seen:
            seen.add(text)
            messages.append({"s": round(server.elapsed(), 1), "message": text})
            print(f"    {server.elapsed():7.1f} s  {text}", flush=True)

    with httpx.Client(timeout=5) as http:
        while server.elapsed() < timeout:
            if server.proc.poll() is not None:
                return {"ready": False, "error": f"the server exited with status {server.proc.returncode}",
                        "log_tail": server.log_tail(), "messages": messages, "health": body}
            try:
                response = http.get(f"{server.url}/health")
            except httpx.HTTPError:
                note("not answering yet (the port is not open)")
                time.sleep(POLL_S)
                continue
            try:
                body = response.json()
            except ValueError:
                body = {"status": f"HTTP {response.status_code}", "text": response.text[:500]}
            for line in health_messages(body):
                note(line)
            if response.status_code == 200:
                return {"ready": True, "ready_s": round(server.elapsed(), 1), "messages": messages,
                        "health": body}
            if body.get("status") == "failed":
                error = body.get("error") or "; ".join(
                    f"{w.get('name')}: {w.get('error')}" for w in body.get("workers") or () if w.get("error"))
                return {"ready": False, "error": error or "failed", "health": body, "messages": messages,
                        "log_tail": server.log_tail()}
            time.sleep(POLL_S)
    return {"ready": False, "error": f"not ready after {timeout:.0f} s", "health": body, "messages": messages,
            "log_tail": server.log_tail()}


# ---- requests ----

class Requests:
    """The row's requests against one running server, each one a record."""

    def __init__(self, server: Server, args, picture: bytes, mask: bytes, picture_path: Path, row: str = ""):
        self.url = server.url
        self.args, self.row = args, row
        self.picture, self.mask, self.picture_path = picture, mask, picture_path
        self.expected = (args.size, args.size)
        self.http = httpx.Client(timeout=args.request_timeout)

    def close(self) -> None:
        self.http.close()

    def wanted(self, name: str) -> bool:
        """--only: the request names it lists; "mixed" selects every mixed-NN request."""
        only = self.args.only
        return not only or name in only or (name.startswith("mixed-") and "mixed" in only)

    def rest_edit(self, name: str, fields: dict, n: int = 1, mask: bool = False,
                  may_refuse: str | None = None, pictures: list[bytes] | None = None, prompt: str = PROMPT) -> dict:
        """POST /v1/images/edits as the openai SDK sends it (multipart, extensions as form fields). `pictures`:
        the input images (default: the one input picture)."""
        if not self.wanted(name):
            return {"name": name, "outcome": "skipped"}
        data = {"prompt": prompt, "size": f"{self.args.size}x{self.args.size}", "n": str(n),
                "response_format": "b64_json", "seed": "1", **fields}
        files = [("image", (f"input-{k + 1}.png", picture, "image/png"))
                 for k, picture in enumerate(pictures or [self.picture])]
        if mask:
            files.append(("mask", ("mask.png", self.mask, "image/png")))
        record = {"name": name, "api": "rest /v1/images/edits", "fields": data, "expected_images": n,
                  "inputs": len(files) - mask}
        return self._post(record, "/v1/images/edits", may_refuse, data=data, files=files)

    def rest_job_watched(self, name: str, fields: dict) -> dict:
        """POST /v1/jobs with preview=true, its status polled every 0.25 s as the page watches an edit, then its
        result: the live preview's cost through app.py (this job's later_steps against an unwatched edit's)."""
        if self.args.only and name not in self.args.only:
            return {"name": name, "outcome": "skipped"}
        data = {"prompt": PROMPT, "size": f"{self.args.size}x{self.args.size}", "seed": "1", "preview": "true",
                **fields}
        record = {"name": name, "api": "rest /v1/jobs preview=true", "fields": data, "expected_images": 1,
                  "inputs": 1}
        before = self.phase_sums()
        t0 = time.perf_counter()
        try:
            answer = self.http.post(f"{self.url}/v1/jobs", data=data,
                                    files=[("image", ("input-1.png", self.picture, "image/png"))])
            if answer.status_code != 202:
                return self._failed(record, t0, f"HTTP {answer.status_code}: {answer.text[:300]}")
            job_url = f"{self.url}/v1/jobs/{answer.json()['id']}"
            previews: set[str] = set()
            while True:
                status = self.http.get(job_url).json()
                if status.get("preview"):
                    previews.add(status["preview"])
                if status.get("state") not in ("queued", "running"):
                    break
                time.sleep(0.25)
            result = self.http.get(f"{job_url}/result")
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return self._failed(record, t0, f"{type(exc).__name__}: {exc}")
        record.update(status=result.status_code, seconds=round(time.perf_counter() - t0, 3), previews=len(previews))
        after = self.phase_sums()
        record["phases"] = {name: round(after[name] - before.get(name, 0.0), 3) for name in after
                            if after[name] - before.get(name, 0.0) > 0 and name != COMPILED}
        if result.status_code != 200 or status.get("state") != "succeeded":
            return self._failed(record, t0, f"job {status.get('state')}, result HTTP {result.status_code}")
        if not previews and int(fields.get("num_inference_steps", 0)) >= 10:  # a job long enough to watch
            return self._failed(record, t0, "no live preview reached the job's status")
        return self._judge(record, [Image.open(io.BytesIO(result.content))])

    def rest_generation(self, name: str, fields: dict, prompt: str = PROMPT) -> dict:
        """POST /v1/images/generations as the openai SDK sends it (JSON, extensions in the body)."""
        if not self.wanted(name):
            return {"name": name, "outcome": "skipped"}
        body = {"prompt": prompt, "size": f"{self.args.size}x{self.args.size}", "n": 1,
                "response_format": "b64_json", "seed": 1, **fields}
        record = {"name": name, "api": "rest /v1/images/generations", "fields": body, "expected_images": body["n"]}
        return self._post(record, "/v1/images/generations", None, json=body)

    def phase_sums(self) -> dict[str, float]:
        """/metrics' time budget so far: seconds per phase (imgedit_request_phase_seconds_sum), and under
        COMPILED the graphs torch.compile compiled while edits ran (imgedit_compiled_graphs_total)."""
        try:
            text = self.http.get(f"{self.url}/metrics").text
        except httpx.HTTPError:
            return {}
        sums = {m.group(1): float(m.group(2)) for m in PHASE_SUM.finditer(text)}
        compiled = COMPILED_TOTAL.search(text)
        if compiled:
            sums[COMPILED] = float(compiled.group(1))
        return sums

    def _post(self, record: dict, path: str, may_refuse: str | None, **content) -> dict:
        before = self.phase_sums()
        t0 = time.perf_counter()
        try:
            response = self.http.post(f"{self.url}{path}", **content)
        except httpx.HTTPError as exc:
            return self._failed(record, t0, f"{type(exc).__name__}: {exc}")
        record.update(status=response.status_code, seconds=round(time.perf_counter() - t0, 3))
        after = self.phase_sums()  # where this request's time went (REST's; the worker's phases inside)
        record["phases"] = {name: round(after[name] - before.get(name, 0.0), 3) for name in after
                            if after[name] - before.get(name, 0.0) > 0 and name != COMPILED}
        # a recompile after the warm-up: graphs compiled while this request ran (None: /metrics unread)
        record[COMPILED] = (int(after[COMPILED] - before[COMPILED]) if COMPILED in after and COMPILED in before
                            else None)
        body = _json(response)
        if response.status_code != 200:
            message = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
            record["error"] = message or response.text[:500]
            param = (body.get("error") or {}).get("param") if isinstance(body, dict) else None
            refused = may_refuse is not None and response.status_code == 400 and param == may_refuse
            record["outcome"] = "refused" if refused else "failed"
            return record
        images = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in body.get("data", [])]
        for key in ("notices", "weights", "seed", "size"):
            if key in body:
                record[key] = body[key]
        return self._judge(record, images)

    def gradio_edit(self, name: str, generate: bool = False, cfg: float = 4.0) -> dict:
        """The same quality edit through gradio_client's /edit, as the page's "Copy as API call" does;
        `generate`: without an input image (a model that makes one from the prompt)."""
        if self.args.only and name not in self.args.only:
            return {"name": name, "outcome": "skipped"}
        from gradio_client import Client, handle_file

        record = {"name": name, "api": "gradio_client /edit", "expected_images": 1,
                  "fields": {"num_inference_steps": self.args.other_steps, "width": self.args.size,
                             "height": self.args.size, "seed": 1}}
        t0 = time.perf_counter()
        try:
            client = Client(self.url, verbose=False)
            record["connect_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            size = self.args.size
            images = [] if generate else [handle_file(str(self.picture_path))]
            job = client.submit(images=images, prompt=PROMPT,
                                negative_prompt="", seed=1, randomize_seed=False,
                                num_inference_steps=self.args.other_steps, true_cfg_scale=cfg, num_images=1,
                                width=size, height=size, api_name="/edit")
            gallery, seed = job.result(timeout=self.args.request_timeout)
        except Exception as exc:  # noqa: BLE001 - recorded: gradio_client raises its own and others
            return self._failed(record, t0, f"{type(exc).__name__}: {exc}")
        record.update(status=200, seconds=round(time.perf_counter() - t0, 3), seed=seed)
        images = []
        for item in gallery:
            with Image.open(item["image"]) as image:
                images.append(image.copy())
        return self._judge(record, images)

    def enhance(self, name: str) -> dict:
        """POST /v1/prompts/enhance: seconds, and ms per token written when the reply says how many."""
        if self.args.only and name not in self.args.only:
            return {"name": name, "outcome": "skipped"}
        record = {"name": name, "api": "rest /v1/prompts/enhance", "expected_images": 0}
        t0 = time.perf_counter()
        try:
            response = self.http.post(f"{self.url}/v1/prompts/enhance", data={"prompt": PROMPT},
                                      files=[("image", ("input.png", self.picture, "image/png"))])
        except httpx.HTTPError as exc:
            return self._failed(record, t0, f"{type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - t0
        record.update(status=response.status_code, seconds=round(seconds, 3))
        body = _json(response)
        if response.status_code != 200:
            record.update(outcome="failed", error=response.text[:500])
            return record
        record.update(outcome="ok", prompt=str(body.get("prompt"))[:300], notice=body.get("notice"))
        tokens = rewrite_tokens(body)
        if tokens:
            record.update(tokens=tokens, ms_per_token=round(1000 * seconds / tokens, 2))
        return record

    def _failed(self, record: dict, t0: float, error: str) -> dict:
        record.update(status=None, seconds=round(time.perf_counter() - t0, 3), outcome="failed", error=error)
        return record

    def _judge(self, record: dict, images: list[Image.Image]) -> dict:
        """Count, size and finiteness of the returned images decide the outcome."""
        checks = [check_image(image, self.expected) for image in images]
        if self.args.save_images and images:  # to compare two rows' images of the same seed (PSNR)
            folder = Path(self.args.save_images)
            folder.mkdir(parents=True, exist_ok=True)
            images[0].save(folder / f"{self.row}-{record['name']}.png")
        record.update(images=len(images), sizes=[size for _, _, size in checks],
                      size_ok=all(ok for ok, _, _ in checks), finite=all(finite for _, finite, _ in checks))
        problems = []
        if len(images) != record["expected_images"]:
            problems.append(f"{len(images)} image(s) instead of {record['expected_images']}")
        if not record["size_ok"]:
            problems.append(f"size {record['sizes']} instead of {self.expected[0]}x{self.expected[1]}")
        if not record["finite"]:
            problems.append("a constant (non-finite) image")
        record["outcome"] = "failed" if problems else "ok"
        if problems:
            record["error"] = "; ".join(problems)
        return record


def _json(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return {}


def rewrite_tokens(body: dict) -> int | None:
    """How many tokens the rewrite wrote, where the reply says it."""
    for key in ("tokens", "new_tokens", "completion_tokens"):
        if isinstance(body.get(key), int):
            return body[key]
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    match = CUT_AT.search(str(body.get("notice") or ""))
    return int(match.group(1)) if match else None


def lightning_names(health: dict) -> dict[int, str]:
    """{steps: LoRA name} of the Lightning LoRAs the server offers (/health's loras)."""
    return {lora["lightning_steps"]: lora["name"] for lora in health.get("loras") or ()
            if lora.get("lightning_steps")}


def run_requests(requests: Requests, health: dict, steps: int, other_steps: int, records: list[dict]) -> None:
    """Every request of a row, in order, each added to `records` and printed as it finishes."""

    def add(record: dict) -> None:
        if record["outcome"] == "skipped":  # --only
            return
        records.append(record)
        print(f"    {describe(record)}", flush=True)

    quality = {"num_inference_steps": str(steps)}
    add(requests.rest_edit("edit-first", quality))
    add(requests.rest_edit("edit-steady", quality))
    add(requests.rest_job_watched("edit-watched", quality))  # the same edit with its live preview watched
    offered = lightning_names(health)
    for speed, lightning in (("fastest", 4), ("fast", 8)):
        for run in ("first", "steady"):
            if lightning in offered:
                add(requests.rest_edit(f"{speed}-{run}", {"speed": speed}))
            else:  # this script wrote the LoRA into LORA_DIR: the server should offer it
                add({"name": f"{speed}-{run}", "api": "rest /v1/images/edits", "outcome": "failed",
                     "error": f"no Lightning {lightning}-step LoRA offered in /health (loras: "
                              f"{health.get('loras')})"})
    quality = {"num_inference_steps": str(other_steps)}  # the rest: --other-steps
    add(requests.rest_edit("mask", quality, mask=True))
    add(requests.rest_edit("enhance-edit", {**quality, "enhance_prompt": "true"}))
    lora = offered.get(8) or LORA_FILES[8]
    add(requests.rest_edit("lora-0.5", {**quality, "lora": lora, "lora_scale": "0.5"}))
    add(requests.rest_edit("cache-taylorseer", {**quality, "cache": "taylorseer"}, may_refuse="cache"))
    add(requests.rest_edit("n2", quality, n=2))
    add(requests.gradio_edit("gradio"))
    add(requests.enhance("rewrite"))


def run_requests_21(requests: Requests, health: dict, steps: int, other_steps: int, records: list[dict]) -> None:
    """A Qwen-Image-2.1 row's requests (text to image, 3 and 10 references, RGBA, its LoRA, a mask)."""

    def add(record: dict) -> None:
        if record["outcome"] == "skipped":  # --only
            return
        records.append(record)
        print(f"    {describe(record)}", flush=True)

    size = requests.args.size
    references = [input_picture(size // 2 + 16 * k) for k in range(10)]  # ten different sizes and contents
    quality = {"num_inference_steps": str(steps)}
    add(requests.rest_generation("t2i-first", {"num_inference_steps": steps}))
    add(requests.rest_generation("t2i-steady", {"num_inference_steps": steps}))
    # the same request with a prompt not seen before: against t2i-steady, a new prompt's cost on a warm server
    add(requests.rest_generation("t2i-new-prompt", {"num_inference_steps": steps}, prompt=OTHER_PROMPT))
    # after it: the same prompt again (its encode memoised), the same words in another order (a new text of
    # a length seen) and a longer prompt (a new length): which of a new prompt's costs are once a length
    add(requests.rest_generation("t2i-new-again", {"num_inference_steps": steps}, prompt=OTHER_PROMPT))
    add(requests.rest_generation("t2i-new-same-length", {"num_inference_steps": steps}, prompt=SAME_LENGTH_PROMPT))
    add(requests.rest_generation("t2i-new-length", {"num_inference_steps": steps}, prompt=LONGER_PROMPT))
    add(requests.rest_edit("refs1", quality, pictures=references[:1]))
    add(requests.rest_edit("refs3", quality, pictures=references[:3]))
    add(requests.rest_edit("refs5", quality, pictures=references[:5]))
    add(requests.rest_edit("refs10-full", quality, pictures=references))
    other = {"num_inference_steps": str(other_steps)}
    add(requests.rest_edit("refs10", other, pictures=references))
    add(requests.rest_edit("rgba", other, pictures=[input_picture(size, alpha=True)]))
    add(requests.rest_edit("lora-0.5", {**other, "lora": LORA_21, "lora_scale": "0.5"}))
    # two images a prompt with the LoRA: a graph of its own, which the warm-up must have compiled
    add(requests.rest_edit("lora-0.5-n2", {**other, "lora": LORA_21, "lora_scale": "0.5"}, n=2))
    add(requests.rest_edit("mask", other, mask=True))
    add(requests.gradio_edit("gradio-t2i", generate=True, cfg=1.0))
    add(requests.enhance("rewrite"))
    run_mixed_21(requests, other_steps, references, add)
    if any(worker.get("turbo") for worker in health.get("workers", [])):  # TURBO_MODEL_DIR: the fast tier
        for speed in ("fastest", "fast"):  # both run the Turbo's 8 steps
            for run in ("first", "steady"):
                add(requests.rest_generation(f"turbo-t2i-{speed}-{run}", {"speed": speed}))
        add(requests.rest_edit("turbo-edit-fastest", {"speed": "fastest"}))
        add(requests.rest_generation("turbo-t2i-fastest-n2", {"speed": "fastest", "n": 2}))
        add(requests.rest_edit("turbo-refs3-fastest", {"speed": "fastest"}, pictures=references[:3]))


def run_mixed_21(requests: Requests, steps: int, references: list[bytes], add) -> None:
    """MIXED_REQUESTS requests as users mix them (the mixed-NN names; --only mixed selects them all): prompts
    of 4-60 words and 0-10 references, seeded, at --other-steps. Each record carries the graphs torch.compile
    compiled while it ran (/metrics); one compiled after the warm-up fails the record."""
    rng = random.Random(0)
    for i in range(MIXED_REQUESTS):
        name = f"mixed-{i + 1:02d}"
        prompt = " ".join(rng.choice(MIXED_WORDS) for _ in range(rng.randint(4, 60)))
        count = i % (len(references) + 1)  # 0, 1, ..., 10, 0, 1, ...
        if count:
            record = requests.rest_edit(name, {"num_inference_steps": str(steps)}, pictures=references[:count],
                                        prompt=prompt)
        else:
            record = requests.rest_generation(name, {"num_inference_steps": steps}, prompt=prompt)
        if record["outcome"] != "skipped":
            record.update(references=count, words=len(prompt.split()))
        if record["outcome"] == "ok" and record.get(COMPILED):
            record.update(outcome="failed", error=f"{record[COMPILED]} graph(s) compiled after the warm-up")
        elif record["outcome"] == "ok" and record.get(COMPILED, 0) is None:
            record.update(outcome="failed", error="/metrics' imgedit_compiled_graphs_total not read: not counted")
        add(record)


def mixed_summary(records: dict) -> str:
    """The mixed-NN requests in one cell: how many ran, the graphs compiled among them, the slowest."""
    mixed = [r for name, r in records.items() if name.startswith("mixed-")]
    if not mixed:
        return "—"
    ok = [r for r in mixed if r["outcome"] == "ok"]
    compiled = sum(r.get(COMPILED) or 0 for r in mixed)
    slowest = max((r.get("seconds") or 0.0 for r in mixed), default=0.0)
    return f"{len(ok)}/{len(mixed)} ok, {compiled} compiled, max {slowest:.2f} s"


def describe(record: dict) -> str:
    text = f"{record['name']:<16} {record['outcome']:<8}"
    if record.get("seconds") is not None:
        text += f" {record['seconds']:8.2f} s"
    if record.get("status") is not None:
        text += f"  HTTP {record['status']}"
    if "images" in record:
        text += f"  {record['images']} image(s) {','.join(record['sizes'])} finite={record['finite']}"
    if record.get("previews"):
        text += f"  {record['previews']} preview(s)"
    if record.get("ms_per_token"):
        text += f"  {record['tokens']} tokens, {record['ms_per_token']} ms/token"
    if "references" in record:  # a mixed-NN request
        text += f"  {record['references']} ref(s), {record['words']} words"
    if record.get(COMPILED):
        text += f"  {record[COMPILED]} graph(s) compiled"
    if record.get("error"):
        text += f"  ({record['error'][:300]})"
    if record.get("phases"):
        text += "  [" + " ".join(f"{name} {value:.2f}" for name, value in record["phases"].items()) + "]"
    return text


# ---- one row ----

def row_env(name: str, args, common: dict[str, str]) -> dict[str, str]:
    """The settings this row gives the server (besides the inherited, non-imgedit environment)."""
    table = CPU_ROWS if args.tiny else ROWS
    env = {**common, **table[name]}
    if args.compile:
        env["COMPILE"] = args.compile
    env.update(args.env_pairs)
    return env


def process_env(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment without any imgedit setting, then the row's settings."""
    names = {var.name for var in REGISTRY}
    inherited = {k: v for k, v in os.environ.items() if k not in names and k != "TORCHINDUCTOR_CACHE_DIR"}
    settings = dict(settings)
    if "CUDA_VISIBLE_DEVICES" in settings and inherited.get("CUDA_VISIBLE_DEVICES"):
        # a row's GPUs count within the ones this script was given (rows can run side by side on one host)
        given = inherited["CUDA_VISIBLE_DEVICES"].split(",")
        settings["CUDA_VISIBLE_DEVICES"] = ",".join(given[int(i)] for i in settings["CUDA_VISIBLE_DEVICES"].split(","))
    return {**inherited, "PYTHONUNBUFFERED": "1", **settings}


def run_row(row: dict, args, common: dict[str, str], pictures: tuple[bytes, bytes, Path]) -> None:
    """Fill `row` (its name set, already in the report: an interrupted row keeps what it measured)."""
    name = row["name"]
    out_dir = Path(args.out)
    cache_dir = out_dir / "compile-cache" / name
    shutil.rmtree(cache_dir, ignore_errors=True)  # the first start compiles as a new user's does
    settings = {**row_env(name, args, common), "COMPILE_CACHE_DIR": str(cache_dir),
                "OUTPUT_DIR": str(out_dir / "outputs" / name)}
    settings.setdefault("GRADIO_SERVER_PORT", str(free_port()))
    row.update(env=settings, log=str(out_dir / f"{name}.log"))
    own = " ".join(f"{k}={v}" for k, v in row_env(name, args, {}).items()) or "(every setting at its default)"
    print(f"\n== {name}: {own}", flush=True)
    server = Server(process_env(settings), out_dir / f"{name}.log")
    try:
        ready = wait_ready(server, args.ready_timeout)
        row.update(ready=ready["ready"], ready_s=ready.get("ready_s"), loading_messages=ready["messages"],
                   health_at_ready=ready.get("health"))
        if not ready["ready"]:
            row.update(error=ready.get("error"), log_tail=ready.get("log_tail"))
            print(f"    NOT READY: {ready.get('error')}\n{_indent(ready.get('log_tail') or '')}", flush=True)
            return
        print(f"    ready in {ready['ready_s']} s", flush=True)
        requests = Requests(server, args, *pictures, row=name)
        try:
            run = run_requests_21 if name in FAMILY_21 else run_requests
            run(requests, ready["health"], args.steps, args.other_steps, row["requests"])
        finally:
            requests.close()
        if args.load:
            row["load"] = run_load(server, args)
    finally:
        row["stop"] = server.stop()
        _warn_left_over(row["stop"])
    if args.restart:
        restart(row, settings, args, pictures)


def run_load(server: Server, args) -> dict:
    """benchmarks/load.py against the row's server for --load minutes: its report, without the samples' list
    when there are many (the JSON keeps the queue's and GPUs' summary)."""
    import load  # benchmarks/load.py, beside this script

    health = httpx.get(f"{server.url}/health", timeout=30).json()
    gpus = {d for w in health.get("workers") or () for d in w.get("devices") or () if d.startswith("cuda:")}
    clients = args.load_clients or 3 * max(1, len(gpus))
    argv = ["--url", server.url, "--clients", str(clients), "--minutes", str(args.load),
            "--steps", str(args.steps), "--size", str(args.size)]
    if args.load_mix:
        argv += ["--mix", args.load_mix]
    argv += ["--think", str(args.load_think), "--batch-items", str(args.load_batch)]
    runner = load.Load(load.parse_args(argv), health)
    print(f"    load: {clients} clients for {args.load} min, mix {runner.mix}; left out "
          f"{runner.left_out or 'none'}", flush=True)
    report = runner.run()
    kinds = ", ".join(f"{k} n={v['n']} p50 {v['p50_s']} p99 {v['p99_s']}" for k, v in report["kinds"].items())
    if report["batch"]:
        jobs = report["batch"]["jobs"]
        print(f"    load: the batch beside them: {len(jobs)} job(s), {report['batch']['images']} image(s), paused "
              f"{report['item_pauses']} time(s) for the clients' edits", flush=True)
    print(f"    load: {report['images_per_minute']} images a minute ({report['images_per_minute_per_gpu']} a GPU); "
          f"{kinds}; errors {report['errors'] or 'none'}; queue {report['queue']}; GPU utilisation "
          f"{report['gpu_utilization_mean']} %; graphs compiled {report['compiled_graphs']}", flush=True)
    return report


def restart(row: dict, settings: dict[str, str], args, pictures: tuple[bytes, bytes, Path]) -> None:
    """Start the stopped server again (same settings, same compile cache): time to ready, one edit."""
    print(f"  -- restart of {row['name']}", flush=True)
    log_path = Path(args.out) / f"{row['name']}.restart.log"
    server = Server(process_env(settings), log_path)
    try:
        ready = wait_ready(server, args.ready_timeout)
        row["restart"] = {"ready": ready["ready"], "ready_s": ready.get("ready_s"), "log": str(log_path),
                          "loading_messages": ready["messages"], "health_at_ready": ready.get("health")}
        row["restart_ready_s"] = ready.get("ready_s")
        if not ready["ready"]:
            row["restart"].update(error=ready.get("error"), log_tail=ready.get("log_tail"))
            print(f"    NOT READY after restart: {ready.get('error')}", flush=True)
            return
        print(f"    ready again in {ready['ready_s']} s", flush=True)
        requests = Requests(server, args, *pictures, row=f"{row['name']}-restart")
        try:
            record = requests.rest_edit("restart-edit", {"num_inference_steps": str(args.steps)})
        finally:
            requests.close()
        print(f"    {describe(record)}", flush=True)
        row["requests"].append(record)
    finally:
        row["restart"] = {**row.get("restart", {}), "stop": server.stop()}
        _warn_left_over(row["restart"]["stop"])


def _warn_left_over(stop: dict) -> None:
    if stop.get("problem"):
        print(f"    WARNING: {stop['problem']}", flush=True)
    if stop.get("left_over_processes"):
        print(f"    WARNING: {stop['left_over_processes']} process(es) of the server's group outlived it "
              "(killed)", flush=True)


def _indent(text: str) -> str:
    return "\n".join(f"      | {line}" for line in text.splitlines())


# ---- results ----

def row_failures(row: dict) -> list[str]:
    failures = []
    if not row.get("ready"):
        failures.append(f"not ready: {row.get('error')}")
    restart_info = row.get("restart")
    if restart_info is not None and not restart_info.get("ready"):
        failures.append(f"not ready after the restart: {restart_info.get('error')}")
    for stop in (row.get("stop"), (restart_info or {}).get("stop")):
        if stop and stop.get("left_over_processes"):
            failures.append(f"{stop['left_over_processes']} process(es) outlived the server")
    failures.extend(f"{r['name']}: {r.get('error')}" for r in row["requests"] if r["outcome"] == "failed")
    if row.get("load", {}).get("errors"):
        failures.append(f"load: {row['load']['errors']}")
    return failures


def _cell(records: dict, name: str) -> str:
    record = records.get(name)
    if record is None:
        return "—"
    if record["outcome"] == "ok":
        return f"{record['seconds']:.2f}"
    if record["outcome"] == "refused":
        return "refused"
    return f"FAIL {record['status']}" if record.get("status") else "FAIL"


def _pair(records: dict, speed: str) -> str:
    """The steady run's seconds, the first run's in brackets, and the lossy weights it ran on (if so)."""
    steady, first = _cell(records, f"{speed}-steady"), _cell(records, f"{speed}-first")
    text = steady if first == "—" else f"{steady} ({first})"
    weights = records.get(f"{speed}-steady", {}).get("weights")  # FAST_QUANTIZE's copy ran it
    return f"{text} {weights}" if weights else text


def _turbo_pair(records: dict, speed: str) -> str:
    """A Turbo text to image's steady seconds, the first run's in brackets."""
    steady, first = _cell(records, f"turbo-t2i-{speed}-steady"), _cell(records, f"turbo-t2i-{speed}-first")
    return steady if first == "—" else f"{steady} ({first})"


def table_21(rows: list[dict], device: str) -> str:
    """The Qwen-Image-2.1 rows' table."""
    head = ["row", "ready s", "restart s", "t2i first s", "t2i steady s", "1 ref", "3 refs", "5 refs", "10 refs",
            "10 refs (other steps)", "rgba", "lora 0.5", "mask", "gradio t2i", "rewrite ms/token",
            "turbo t2i fastest s", "turbo t2i fast s", "turbo edit s", "turbo 3 refs s", "mixed", "all finite"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        records = {r["name"]: r for r in row["requests"]}
        imaged = [r for r in row["requests"] if "finite" in r]
        finite = "—" if not imaged else ("yes" if all(r["finite"] for r in imaged) else "NO")
        ready = f"{row['ready_s']}" if row.get("ready") else "FAIL"
        restart_s = row.get("restart_ready_s")
        restarted = "—" if "restart" not in row else (f"{restart_s}" if restart_s is not None else "FAIL")
        rewrite = records.get("rewrite", {})
        cells = [f"{row['name']} ({device})", ready, restarted,
                 *(_cell(records, name) for name in ("t2i-first", "t2i-steady", "refs1", "refs3", "refs5",
                                                     "refs10-full", "refs10", "rgba", "lora-0.5", "mask",
                                                     "gradio-t2i")),
                 str(rewrite.get("ms_per_token", _cell(records, "rewrite"))),
                 _turbo_pair(records, "fastest"), _turbo_pair(records, "fast"),
                 _cell(records, "turbo-edit-fastest"), _cell(records, "turbo-refs3-fastest"),
                 mixed_summary(records), finite]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict], device: str) -> str:
    edits = [row for row in rows if row["name"] not in FAMILY_21]
    family_21 = [row for row in rows if row["name"] in FAMILY_21]
    parts = ([_table_edit(edits, device)] if edits else []) + ([table_21(family_21, device)] if family_21 else [])
    return "\n\n".join(parts)


def _table_edit(rows: list[dict], device: str) -> str:
    head = ["row", "ready s", "restart s", "first edit s", "steady edit s", "fastest s", "fast s", "mask",
            "enhance", "lora 0.5", "cache", "n=2", "gradio", "rewrite ms/token", "all finite"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        records = {r["name"]: r for r in row["requests"]}
        imaged = [r for r in row["requests"] if "finite" in r]
        finite = "—" if not imaged else ("yes" if all(r["finite"] for r in imaged) else "NO")
        rewrite = records.get("rewrite", {})
        ready = f"{row['ready_s']}" if row.get("ready") else "FAIL"
        if row.get("interrupted") and not row.get("ready"):
            ready = "interrupted"
        restart_s = row.get("restart_ready_s")
        restarted = "—" if "restart" not in row else (f"{restart_s}" if restart_s is not None else "FAIL")
        cells = [f"{row['name']} ({device})", ready, restarted, _cell(records, "edit-first"),
                 _cell(records, "edit-steady"), _pair(records, "fastest"), _pair(records, "fast"),
                 _cell(records, "mask"), _cell(records, "enhance-edit"), _cell(records, "lora-0.5"),
                 _cell(records, "cache-taylorseer"), _cell(records, "n2"), _cell(records, "gradio"),
                 str(rewrite.get("ms_per_token", _cell(records, "rewrite"))), finite]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ["cpu"]
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return names if out.returncode == 0 and names else ["cpu"]


def write_results(report: dict, args) -> str:
    rows = report["rows"]
    device = "cpu" if args.tiny else "gpu"
    markdown = (f"Acceptance run {report['date']} on {', '.join(report['host_gpus'])}: "
                f"{report['command']}\n\n{table(rows, device)}\n")
    Path(args.out, "acceptance.md").write_text(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return markdown


# ---- main ----

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder, built when it has no "
                        "model_index.json (default /tmp/qwen-image-edit-real-random; "
                        "--tiny: OUT/tiny-checkpoint)")
    parser.add_argument("--ckpt21", default=None, help="the Qwen-Image-2.1 rows' checkpoint, built when it has no "
                        "model_index.json (default /tmp/qwen-image-2.1-real-random; --tiny: OUT/tiny-checkpoint-21)")
    parser.add_argument("--ckpt21turbo", default=None, help="the 21-turbo row's TURBO_MODEL_DIR, built when it has "
                        "no model_index.json (default /tmp/qwen-image-2.1-turbo-real-random; --tiny: "
                        "OUT/tiny-checkpoint-21turbo)")
    parser.add_argument("--ckpt2511", default=None, help="the 2511 rows' checkpoint, built when it has no "
                        "model_index.json (default /tmp/qwen-image-edit-2511-real-random; --tiny: "
                        "OUT/tiny-checkpoint-2511)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU, 64x64, 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="steps of the quality edits (40; --tiny 2)")
    parser.add_argument("--other-steps", type=int, default=None,
                        help="steps of the mask, enhance, LoRA, cache, n=2 and gradio edits (default: --steps)")
    parser.add_argument("--size", type=int, default=None, help="input and output side (1024; --tiny 64)")
    parser.add_argument("--compile", choices=("off", "on"), default=None, help="COMPILE for every row "
                        "(default: unset, i.e. auto)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every row (repeatable)")
    parser.add_argument("--restart", action="store_true", help="restart each row's server: time, one edit")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--out", default="/tmp/acceptance", help="logs, LoRAs, compile caches, acceptance.md")
    parser.add_argument("--json", default="", help="write the whole run here as JSON")
    parser.add_argument("--only", default="", help="comma-separated request names (t2i-steady,refs1,...): the "
                        "row makes only these (a shorter GPU run); default: every request")
    parser.add_argument("--load", type=float, default=0.0, metavar="MINUTES", help="after a row's requests, "
                        "benchmarks/load.py against the same server for MINUTES (its report in the row's JSON)")
    parser.add_argument("--load-clients", type=int, default=0, help="--load's clients at once (default: 3 a GPU "
                        "the row's workers hold)")
    parser.add_argument("--load-mix", default="", help="--load's mix, kind=weight,... (default: load.py's)")
    parser.add_argument("--load-think", type=float, default=0.0, help="--load's clients' mean pause between "
                        "requests, seconds (load.py --think)")
    parser.add_argument("--load-batch", type=int, default=0, help="--load with a /v1/jobs job of this many "
                        "edits running beside the clients (load.py --batch-items)")
    parser.add_argument("--save-images", default="", help="save each request's first image here as "
                        "ROW-REQUEST.png (rows of one seed compare by PSNR: benchmarks/psnr.py)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 40)
    args.other_steps = args.other_steps or args.steps
    # 2.1's inputs are resized to at least 320² (imgedit.planning.families): the tiny run's size
    args.size = args.size or ((320 if any(r in FAMILY_21 for r in args.rows.split(",")) else 64) if args.tiny
                              else 1024)
    unknown = [r for r in args.rows.split(",") if r and r not in ROWS]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    args.row_names = [r for r in args.rows.split(",") if r]
    args.only = {name for name in args.only.split(",") if name}
    pairs = {}
    for pair in args.env:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            parser.error(f"--env takes KEY=VALUE, got {pair!r}")
        pairs[key] = value
    args.env_pairs = pairs
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a killed run still stops its server (finally blocks)
    if (ROOT / ".env").is_file():
        print(f"WARNING: {ROOT / '.env'} fills in every setting a row leaves unset", flush=True)
    default_ckpt = out_dir / "tiny-checkpoint" if args.tiny else Path("/tmp/qwen-image-edit-real-random")
    ckpt = Path(args.ckpt) if args.ckpt else default_ckpt
    edit_rows = [name for name in args.row_names if name not in FAMILY_21 + FAMILY_2511]
    lora_dir = out_dir / ("loras-tiny" if args.tiny else "loras-real")
    loras = {}
    if edit_rows:
        ckpt = prepare_checkpoint(ckpt.expanduser(), args.tiny)
        lora_dir.mkdir(parents=True, exist_ok=True)
        loras = prepare_loras(lora_dir, ckpt, args.tiny)
    common_2511 = common_21 = {}
    if any(name in FAMILY_2511 for name in args.row_names):  # 2511 rows: their own checkpoint and LoRAs
        common_2511 = family_settings(args, out_dir, "2511", args.ckpt2511, "/tmp/qwen-image-edit-2511-real-random",
                                      prepare_loras)
    if any(name in FAMILY_21 for name in args.row_names):  # Qwen-Image-2.1 rows: their own checkpoint and LoRA
        common_21 = family_settings(args, out_dir, "21", args.ckpt21, "/tmp/qwen-image-2.1-real-random",
                                    prepare_lora_21)
    common_turbo = {}
    if any(name in TURBO_ROWS for name in args.row_names):  # the 21 rows' settings and the Turbo checkpoint
        default = out_dir / "tiny-checkpoint-21turbo" if args.tiny else Path("/tmp/qwen-image-2.1-turbo-real-random")
        turbo = prepare_checkpoint(Path(args.ckpt21turbo or default).expanduser(), args.tiny, kind="21turbo")
        common_turbo = {**common_21, "TURBO_MODEL_DIR": str(turbo)}
    picture_path = out_dir / "input.png"
    picture = input_picture(args.size)
    picture_path.write_bytes(picture)
    pictures = (picture, mask_picture(args.size), picture_path)
    common = {"QWEN_MODEL_DIR": str(ckpt), "LORA_DIR": str(lora_dir)}
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
              "host_gpus": gpu_names(), "command": shlex.join([sys.executable, *sys.argv]),
              "checkpoint": str(ckpt), "loras": loras, "steps": args.steps, "other_steps": args.other_steps,
              "size": args.size,
              "tiny": args.tiny, "rows": []}
    status = 0
    try:
        for name in args.row_names:
            row = {"name": name, "requests": []}
            report["rows"].append(row)
            family = (common_turbo if name in TURBO_ROWS else common_21 if name in FAMILY_21
                      else common_2511 if name in FAMILY_2511 else common)
            run_row(row, args, family, pictures)
            row["failures"] = row_failures(row)
            write_results(report, args)  # after every row: a long GPU run keeps what it measured
    except KeyboardInterrupt:
        print("\ninterrupted: the server was stopped", flush=True)
        status = 130
        row = report["rows"][-1] if report["rows"] else None
        if row is not None and "failures" not in row:
            row["interrupted"] = True
            row["failures"] = ["interrupted"]
    failures = {row["name"]: row["failures"] for row in report["rows"] if row["failures"]}
    report["ok"] = not failures and status == 0
    markdown = write_results(report, args)
    print("\n" + markdown)
    for name, problems in failures.items():
        print(f"{name}: " + "; ".join(problems))
    print(f"logs and acceptance.md in {out_dir}" + (f"; JSON in {args.json}" if args.json else ""))
    return status or (1 if failures else 0)


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
