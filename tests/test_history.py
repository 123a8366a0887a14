"""Stored results: per browser, they survive a restart, and retention / size pruning removes them."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from conftest import make_manager, picture, start_server
from gradio_client import Client, handle_file
from PIL import Image

from imgedit.history import HistoryStore
from imgedit.identity import COOKIE
from imgedit.jobs import EditRequest

FIELDS = {"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "7"}
A = {"Authorization": "Bearer token-a"}


def edit_args(files, seed=1, prompt="make it blue"):
    return ([handle_file(str(f)) for f in files], prompt, "", seed, False, 2, 4.0, 1, 64, 64)


def png() -> bytes:
    buffer = io.BytesIO()
    picture().save(buffer, format="PNG")
    return buffer.getvalue()


def test_history_is_per_browser_and_survives_a_restart(plus_ckpt, image_file, tmp_path):
    outputs = tmp_path / "outputs"
    with start_server(make_manager(plus_ckpt, OUTPUT_DIR=str(outputs))) as server:
        browser = Client(server.url, verbose=False)
        _, seed = browser.predict(*edit_args([image_file], seed=11), api_name="/edit")
        assert seed == 11
        mine = browser.predict(api_name="/history")
        assert [(e["prompt"], e["seed"], e["width"]) for e in mine] == [("make it blue", 11, 64)]
        assert Client(server.url, verbose=False).predict(api_name="/history") == []  # another browser
        cookie = browser.cookies[COOKIE]
        job = httpx.post(f"{server.url}/v1/jobs", files=[("image", ("a.png", png(), "image/png"))], data=FIELDS,
                         headers=A, timeout=60).json()
        deadline = time.time() + 120
        while httpx.get(f"{server.url}/v1/jobs/{job['id']}", headers=A).json()["state"] != "succeeded":
            assert time.time() < deadline
            time.sleep(0.2)
        before = httpx.get(f"{server.url}/v1/jobs/{job['id']}/result", headers=A, timeout=30).content
        failed = httpx.post(f"{server.url}/v1/images/edits", files=[("image", ("a.png", png(), "image/png"))],
                            data={**FIELDS, "num_inference_steps": "0"}, timeout=60)
        assert failed.status_code == 400

    with start_server(make_manager(plus_ckpt, OUTPUT_DIR=str(outputs))) as server:  # a new process, same disk
        again = Client(server.url, verbose=False, httpx_kwargs={"cookies": {COOKIE: cookie}})
        assert again.predict(api_name="/history") == mine
        view = httpx.get(f"{server.url}/v1/jobs/{job['id']}", headers=A, timeout=30).json()
        assert view["state"] == "succeeded" and view["restored"] and view["items"][0]["seed"] == 7
        after = httpx.get(f"{server.url}/v1/jobs/{job['id']}/result", headers=A, timeout=30)
        assert after.headers["content-type"] == "image/png" and after.content == before
        other = httpx.get(f"{server.url}/v1/jobs/{job['id']}", headers={"Authorization": "Bearer b"}, timeout=30)
        assert other.status_code == 404
    store = HistoryStore(outputs)
    assert len(store._select("", ())) == 2  # the edit and the job; nothing for the refused request


@pytest.fixture(scope="module")
def result(plus_manager):
    req = EditRequest(images=(picture(),), prompt="p", num_inference_steps=2, width=64, height=64, seed=5)
    return req, plus_manager.edit(req)


def test_save_writes_pngs_inputs_and_a_thumbnail(tmp_path, result):
    req, res = result
    store = HistoryStore(tmp_path)
    entry = store.save("browser:x", "job-1", 0, req, res, "photo.png")
    assert [Image.open(p).size for p in entry.output_paths] == [(64, 64)]
    stored = Image.open(entry.output_paths[0]).text  # the settings travel with the stored PNG
    assert (stored["prompt"], stored["seed"], stored["num_inference_steps"]) == ("p", "5", "2")
    assert [Image.open(p).size for p in entry.input_paths] == [(80, 60)]
    assert entry.thumb_path.exists() and entry.bytes == sum(p.stat().st_size for p in entry.folder.iterdir())
    assert store.get("browser:x", entry.id) == entry
    assert store.get("browser:y", entry.id) is None and store.list("browser:y") == []
    assert not list(tmp_path.glob("*/.partial-*"))


def test_pruned_by_age_and_by_size(tmp_path, result):
    req, res = result
    store = HistoryStore(tmp_path, retention_hours=1)
    old, new = (store.save("o", "job-a", i, req, res) for i in range(2))
    assert store.prune(now=time.time() + 1800) == 0
    store._db.execute("UPDATE results SET created = created - 7200 WHERE id = ?", (old.id,))
    assert store.prune() == 1
    assert [e.id for e in store.list("o")] == [new.id] and not old.folder.exists() and new.folder.exists()
    store.close()

    capped = HistoryStore(tmp_path, max_bytes=int(new.bytes * 2.5))
    for i in range(3):
        time.sleep(0.01)
        capped.save("o", "job-b", i, req, res)
    kept = capped.list("o")
    assert len(kept) == 2 and capped.total_bytes() <= new.bytes * 2.5
    assert [e.job_id for e in kept] == ["job-b", "job-b"] and {e.item for e in kept} == {1, 2}
    assert sorted(p.name for p in Path(tmp_path).glob("*/*") if p.is_dir()) == sorted(e.folder.name for e in kept)


def test_reopening_drops_a_half_written_folder(tmp_path, result):
    req, res = result
    HistoryStore(tmp_path).save("o", "job", 0, req, res)
    partial = next(tmp_path.glob("*/")) / ".partial-deadbeef"
    partial.mkdir()
    (partial / "out-0.png").write_bytes(b"half")
    assert len(HistoryStore(tmp_path).list("o")) == 1 and not partial.exists()


def test_page_batch_of_five_fills_in_with_per_item_errors_and_a_zip(plus_ckpt, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    files = []
    for i in range(5):
        path = folder / f"photo{i}.png"
        picture(80, 60, (40 * i, 100, 200)).save(path)
        files.append(path)
    notes = folder / "notes.png"
    notes.write_text("not an image")
    files.insert(2, notes)
    with start_server(make_manager(plus_ckpt)) as server:
        client = Client(server.url, verbose=False)
        job = client.submit([handle_file(str(f)) for f in files], "make it red", "", 4, False, 2, 4.0, 1, 64, 64,
                            api_name="/batch")
        sizes = []
        while not job.done():
            sizes += [len(out[0]) for out in job.outputs()[len(sizes):]]
            time.sleep(0.05)
        gallery, report, archive = job.result(timeout=300)
        sizes += [len(out[0]) for out in job.outputs()[len(sizes):]]
        assert len(gallery) == 5 and sizes == sorted(sizes), sizes  # never shrinks
        assert len(set(sizes)) >= 3, sizes  # the gallery filled in as items finished
        assert "notes.png: notes.png is not a readable image" in report and "5 of 6 done, 1 failed" in report
        with zipfile.ZipFile(archive) as z:
            names = z.namelist()
            assert names == ["001-photo0.png", "002-photo1.png", "004-photo2.png", "005-photo3.png",
                             "006-photo4.png", "errors.txt"]
            assert "notes.png" in z.read("errors.txt").decode()
        assert len(client.predict(api_name="/history")) == 5  # stored per item, for this browser
