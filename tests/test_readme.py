"""The README's and docs/api.md's API examples, run as printed against a live server with an API key (the tiny
checkpoint).

Each fenced block of the README's "API" section runs as it stands: the Python ones with this venv's
interpreter, the shell ones with bash and curl. Only what a reader replaces is replaced: the server's
address (the README says localhost:7860) and the `job_XXXX` placeholder (by the id the first line
printed). The inputs (photo.jpg, a.jpg, b.jpg, more-photos.zip) lie in the working folder, as the
reader's would. The server runs two steps per edit (DEFAULT_STEPS=2: the examples leave the steps to
the model), so the 1-megapixel `auto` edits stay affordable on two cores.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, http, make_manager, picture, start_server, wait_for
from PIL import Image

KEY = "readme-key"
pytestmark = pytest.mark.skipif(shutil.which("curl") is None or shutil.which("bash") is None,
                                reason="the README's shell examples need bash and curl")


def api_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the README's "API" section, then docs/api.md's (a block in both runs once)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## API\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    blocks += re.findall(r"```(\w+)\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    return list(dict.fromkeys(blocks))


@pytest.fixture(scope="module")
def server(plus_ckpt):
    with start_server(make_manager(plus_ckpt, DEFAULT_STEPS="2", API_KEY=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def server21(tmp_path_factory):
    from imgedit.model.demo_checkpoint import build_checkpoint

    ckpt = build_checkpoint(tmp_path_factory.mktemp("ckpt") / "q21", kind="21")
    with start_server(make_manager(ckpt, DEFAULT_STEPS="2", API_KEY=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The reader's working folder with the example inputs."""
    here = tmp_path_factory.mktemp("reader")
    picture(96, 64).convert("RGB").save(here / "photo.jpg")
    picture(80, 60, (200, 60, 60)).save(here / "a.jpg")
    picture(64, 64, (60, 200, 60)).save(here / "b.jpg")
    buf = io.BytesIO()
    picture(72, 48, (90, 90, 220)).save(buf, "PNG")
    with zipfile.ZipFile(here / "more-photos.zip", "w") as archive:
        archive.writestr("c.png", buf.getvalue())
    return here


def run(language: str, code: str, server, folder: Path) -> str:
    code = code.replace("http://localhost:7860", server.url).replace("localhost:7860", server.url)
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    env = {**os.environ, "IMGEDIT_API_KEY": KEY}  # the variable the examples (and the page's snippets) read
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{language} example failed:\n{code}\n--- out\n{done.stdout}\n--- err\n{done.stderr}"
    assert "Traceback" not in done.stdout + done.stderr
    return done.stdout


def made_here(path: Path) -> dict:
    """The PNG's settings (our text chunks); fails for anything else."""
    image = Image.open(path)
    # 512 wide (the README's examples, #62: seconds on the CPU demo) or size=auto's about 1 MP
    assert image.format == "PNG" and (image.size[0] == 512 or image.size[0] * image.size[1] > 500_000), image.size
    assert image.text["software"].startswith("imgedit") and image.text["prompt"] == "make the sky a sunset"
    return image.text


def test_the_api_sections_blocks_are_the_ones_this_test_runs():
    assert [language for language, _ in api_blocks()] == ["python", "bash", "python", "python", "bash", "python"]


def test_gradio_client_example(server, folder):
    language, code = api_blocks()[0]
    out = run(language, code, server, folder)
    lines = [line for line in out.splitlines() if not line.startswith("Loaded as API")]  # gradio_client's own
    path, seed = lines[0].rsplit(" ", 1)
    assert made_here(Path(path))["seed"] == seed
    assert "no GPU is visible" in lines[1] and "worker-0" in lines[1]


def test_rest_example(server, folder):
    language, code = api_blocks()[1]
    out = run(language, code, server, folder)
    health = json_values(out)[0]  # curl prints the JSON without a newline; the metrics text follows it
    assert health["status"] == "ok" and "# HELP" in out
    assert made_here(folder / "out.png")["seed"] == "42"
    (folder / "out.png").unlink()


def test_openai_sdk_example(server, folder):
    language, code = api_blocks()[2]
    run(language, code, server, folder)
    text = made_here(folder / "out.png")
    assert text["seed"] == "42" and text["negative_prompt"] == "blurry"


def test_front_end_example(server, folder):
    """docs/api.md's /v1/models and response_format=url example: the image fetched from its URL."""
    language, code = api_blocks()[5]
    run(language, code, server, folder)
    assert made_here(folder / "from-url.png")["seed"]


def test_text_to_image_example(server21, folder):
    """docs/api.md's /v1/images/generations example, against a Qwen-Image-2.1 server (the tiny one)."""
    language, code = api_blocks()[3]
    run(language, code, server21, folder)
    image = Image.open(folder / "made.png")
    assert image.size == (1024, 1024) and image.mode == "RGBA" and image.text["seed"] == "7"
    assert image.text["prompt"] == "a lighthouse at dusk, oil painting"


def test_jobs_example(server, folder):
    language, code = api_blocks()[4]
    lines = code.splitlines()
    submit = "\n".join(lines[:4])  # H=..., the comment, the two-line submit
    reply = json.loads(run(language, submit, server, folder))
    job = reply["id"]
    assert reply["state"] in ("queued", "running") and len(reply["items"]) == 3  # a.jpg, b.jpg, the zip's image
    status_url = f"{server.url}/v1/jobs/{job}"

    def finished() -> bool:
        state = http.get(status_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["state"]
        return state in ("succeeded", "partial", "failed", "cancelled")

    wait_for(finished, 240)  # a reader polls the status line, as the README says
    rest = "\n".join([lines[0], *lines[4:]]).replace("job_XXXX", job)
    status, cancelled, listing = json_values(run(language, rest, server, folder))  # status, DELETE, the list
    assert status["state"] == "succeeded" and [i["state"] for i in status["items"]] == ["succeeded"] * 3
    with zipfile.ZipFile(folder / "results.zip") as archive:
        assert len([n for n in archive.namelist() if n.endswith(".png")]) == 3
    made_here(folder / "2.png")
    # #62: DELETE of a finished job deletes it with its results
    assert cancelled == {"id": job, "deleted": True, "results_deleted": 3}, cancelled
    assert job not in [j["id"] for j in listing["data"]]


def json_values(text: str) -> list:
    """The JSON values curl printed one after another (each without a newline), skipping other text."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            at += 1
            continue
        values.append(value)
        at = end
    return values


def test_a_cancel_that_comes_after_the_end_changes_nothing():
    """The state a job reports (a DELETE after the end once turned a succeeded job into "cancelled", and so did
    the page's batch handler as it closed)."""
    from imgedit.engine.jobs.records import job_state

    assert job_state(["succeeded", "succeeded"], cancelled=True) == "succeeded"
    assert job_state(["succeeded", "failed"], cancelled=True) == "partial"
    assert job_state(["succeeded", "cancelled"], cancelled=True) == "cancelled"  # the cancel took an item away
    assert job_state(["succeeded", "queued"], cancelled=True) == "cancelling"
