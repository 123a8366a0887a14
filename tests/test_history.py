"""Stored results: per browser, they survive a restart, and retention / size pruning removes them."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import http, make_manager, picture, start_server
from gradio_client import Client, handle_file
from PIL import Image

from imgedit.engine.jobs.history import HistoryStore
from imgedit.protocol import EditRequest
from imgedit.web.identity import COOKIE
from imgedit.web.page.requests import edit_fields

FIELDS = {"prompt": "make it red", "size": "64x64", "num_inference_steps": "2", "seed": "7"}
# select-by-words with the tiny model's answer scripted (tests/faults.py): one box, the edit's mask
SCRIPTED = 'the door [answer:[{"bbox_2d": [7, 14, 28, 42], "label": "the door"}]:answer]'
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
        gallery, seed = browser.predict(*edit_args([image_file], seed=11), api_name="/edit")
        assert seed == 11
        # One PNG for the client and the store: the file Gradio served is the stored one, byte for byte.
        [stored] = outputs.glob("*/*/out-0.png")
        assert Path(gallery[0]["image"]).read_bytes() == stored.read_bytes()
        mine = browser.predict(api_name="/history")
        assert [(e["prompt"], e["seed"], e["width"]) for e in mine] == [("make it blue", 11, 64)]
        assert Client(server.url, verbose=False).predict(api_name="/history") == []  # another browser
        cookie = browser.cookies[COOKIE]
        job = http.post(f"{server.url}/v1/jobs", files=[("image", ("a.png", png(), "image/png"))], data=FIELDS,
                         headers=A, timeout=60).json()
        deadline = time.time() + 120
        while http.get(f"{server.url}/v1/jobs/{job['id']}", headers=A).json()["state"] != "succeeded":
            assert time.time() < deadline
            time.sleep(0.2)
        before = http.get(f"{server.url}/v1/jobs/{job['id']}/result", headers=A, timeout=30).content
        failed = http.post(f"{server.url}/v1/images/edits", files=[("image", ("a.png", png(), "image/png"))],
                            data={**FIELDS, "num_inference_steps": "0"}, timeout=60)
        assert failed.status_code == 400

    with start_server(make_manager(plus_ckpt, OUTPUT_DIR=str(outputs))) as server:  # a new process, same disk
        again = Client(server.url, verbose=False, httpx_kwargs={"cookies": {COOKIE: cookie}})
        assert again.predict(api_name="/history") == mine
        view = http.get(f"{server.url}/v1/jobs/{job['id']}", headers=A, timeout=30).json()
        assert view["state"] == "succeeded" and view["restored"] and view["items"][0]["seed"] == 7
        assert view["items"][0]["num_inference_steps"] == 2 and "total_steps" not in view["items"][0], view
        after = http.get(f"{server.url}/v1/jobs/{job['id']}/result", headers=A, timeout=30)
        assert after.headers["content-type"] == "image/png" and after.content == before
        other = http.get(f"{server.url}/v1/jobs/{job['id']}", headers={"Authorization": "Bearer b"}, timeout=30)
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


def test_a_key_named_as_a_login_takes_over_what_an_older_version_stored_under_the_key(tmp_path, result):
    """#62: a key of API_KEYS named as a GRADIO_AUTH user owns as that user (one History for page and scripts);
    what was stored under the key before (`key:<name>`) moves to the user when the server's parts are built
    (web.app.Application, as `python app.py` builds them), results and jobs."""
    from imgedit.config.settings import load_settings
    from imgedit.engine.jobs.records import JobRecords
    from imgedit.web.app import Application
    from imgedit.web.identity import user_owner

    req, res = result
    store, records = HistoryStore(tmp_path), JobRecords(tmp_path)
    kept = store.save("key:alice", "job-1", 0, req, res, "a.png")
    apart = store.save("key:ci", "job-2", 0, req, res, "b.png")
    records.write("job-1", "key:alice", "rest", time.time(), {}, [])
    settings = load_settings({"OUTPUT_DIR": str(tmp_path), "GRADIO_AUTH": "alice:pw-1,bob:pw-2",
                              "API_KEYS": "alice:alice-key-01,ci:ci-key-0001"})
    Application.build(settings, engine=None)  # no worker is needed to open the stores
    assert [e.id for e in store.list(user_owner("alice"))] == [kept.id] and store.list("key:alice") == []
    assert records.read(user_owner("alice"), "job-1") is not None and records.read("key:alice", "job-1") is None
    assert [e.id for e in store.list("key:ci")] == [apart.id]  # no login of that name: the key's own


def test_the_columns_keep_what_the_declaration_says_as_asked_or_as_it_ran(tmp_path, result):
    """Each parameter column is filled from the declaration: as asked for (CFG and size left to the model stay
    None, no LoRA's word is None), or where declared `kept_as_ran` as the edit ran (the rewritten prompt, the
    seed drawn, the model's steps, the images made)."""
    from dataclasses import replace

    from imgedit.engine.jobs.history import COLUMNS
    from imgedit.protocol import parameters

    req, res = result
    asked = replace(req, seed=None, num_inference_steps=None, speed="", lora="none", lora_scale=0.5)
    entry = HistoryStore(tmp_path).save("o", "job", 0, asked, replace(res, prompt="p, rewritten"))
    assert (entry.prompt, entry.original_prompt, entry.seed, entry.steps, entry.num_images) == (
        "p, rewritten", "p", 5, 2, 1)
    assert (entry.true_cfg_scale, entry.width, entry.speed, entry.lora, entry.lora_scale) == (None, 64, None, None, 0.5)
    kept_as_ran = {p.name for p in parameters() if p.kept_as_ran}
    assert kept_as_ran == {"prompt", "seed", "num_inference_steps", "num_images"}
    with_column = {p.name for p in parameters() if p.history and {p.name, p.worker_name} & set(COLUMNS)}
    assert len(with_column) == 11 and entry.kept().keys() >= with_column


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


def test_over_the_size_cap_the_heaviest_owner_loses_its_oldest_first(tmp_path, result):
    """One client's edits must not push out everyone else's: the light owner's older result stays."""
    req, res = result
    store = HistoryStore(tmp_path)
    light = store.save("light", "job-l", 0, req, res)
    heavy = [store.save("heavy", "job-h", i, req, res) for i in range(3)]
    capped = HistoryStore(tmp_path, max_bytes=int(light.bytes * 3.5))  # opening prunes
    assert [e.id for e in capped.list("light")] == [light.id]
    assert sorted(e.id for e in capped.list("heavy")) == sorted(e.id for e in heavy[1:])
    store.close()
    capped.close()


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


OLD_SCHEMA = """
CREATE TABLE results (
    id TEXT PRIMARY KEY, job_id TEXT NOT NULL, item INTEGER NOT NULL, owner TEXT NOT NULL, created REAL NOT NULL,
    source TEXT NOT NULL, name TEXT NOT NULL, prompt TEXT NOT NULL, negative_prompt TEXT NOT NULL,
    seed INTEGER NOT NULL, steps INTEGER NOT NULL, true_cfg_scale REAL, num_images INTEGER NOT NULL, width INTEGER,
    height INTEGER, out_width INTEGER NOT NULL, out_height INTEGER NOT NULL, outputs INTEGER NOT NULL,
    inputs INTEGER NOT NULL, folder TEXT NOT NULL, bytes INTEGER NOT NULL
);
CREATE INDEX results_owner ON results (owner, created);
CREATE INDEX results_job ON results (job_id, item);
CREATE INDEX results_created ON results (created);
"""


def test_a_database_of_the_previous_version_opens_lists_and_takes_lora_rows(tmp_path, result):
    """The table as the version before speed/LoRA columns wrote it: the columns are added at start-up,
    its rows read back as quality without a LoRA, new rows keep their speed and LoRA."""
    import sqlite3
    from dataclasses import replace

    req, res = result
    folder = tmp_path / "2026-11-01" / "0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / "out-0.png").write_bytes(png())
    old = sqlite3.connect(tmp_path / "history.sqlite3")
    old.executescript(OLD_SCHEMA)
    old.execute("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                ("0123456789abcdef", "job-old", 0, "browser:x", time.time() - 60, "ui", "item 1", "old prompt", "",
                 9, 2, 4.0, 1, 64, 64, 64, 64, 1, 0, "2026-11-01/0123456789abcdef", 100))
    old.commit()
    old.close()
    store = HistoryStore(tmp_path)
    [entry] = store.list("browser:x")
    assert (entry.prompt, entry.seed, entry.folder, entry.speed, entry.lora, entry.lora_scale) == (
        "old prompt", 9, folder, None, None, None)
    made = store.save("browser:x", "job-new", 0, replace(req, speed="fastest", lora="style", lora_scale=0.5), res)
    store.close()
    again = HistoryStore(tmp_path)  # opening twice adds nothing twice
    assert [(e.job_id, e.speed, e.lora, e.lora_scale) for e in again.list("browser:x")] == [
        ("job-new", "fastest", "style", 0.5), ("job-old", None, None, None)]
    assert again.get("browser:x", made.id) == made
    columns = [row[1] for row in again._db.execute("PRAGMA table_info(results)")]
    assert columns[-6:] == ["speed", "lora", "lora_scale", "original_prompt", "weights", "options"]
    assert len(columns) == 27
    old = again.get("browser:x", "0123456789abcdef")
    # an old row: no rewrite, the model's own weights, no parameters beyond the columns
    assert old.original_prompt is None and old.weights is None and old.options == {}


@pytest.fixture(scope="module")
def lora_server(plus_ckpt, tmp_path_factory):
    from imgedit.model.lora_random import random_lora
    from imgedit.model.loras import transformer_linears

    folder = tmp_path_factory.mktemp("loras")
    linears = transformer_linears(plus_ckpt)
    random_lora(folder / "Tiny-Edit-Lightning-4steps-V1.0-bf16.safetensors", linears, rank=4, std=0.2, seed=1)
    random_lora(folder / "style.safetensors", linears, rank=4, std=0.2, seed=3, style="diffusers")
    manager = make_manager(plus_ckpt, LORA_DIR=str(folder))
    with start_server(manager) as server:
        server.manager = manager
        yield server


def test_rerun_repeats_the_speed_and_lora_and_a_retired_lora_is_a_clear_error(lora_server, image_file):
    """The History tab's Re-run (the page's own two events, as the browser sends them) of an edit made
    with speed=fastest and a LoRA gives the same pixels, as does the Batch tab with those settings; once
    that LoRA is no longer configured a re-run gives the usual "unknown LoRA" message and runs nothing."""
    from raw_gradio import RawGradio

    server = lora_server
    browser = Client(server.url, verbose=False)
    gallery, seed = browser.predict(*edit_args([image_file], seed=12), "fastest", "style", 0.5, api_name="/edit")
    original = np.asarray(Image.open(gallery[0]["image"]).convert("RGB"))
    assert original.std() > 5  # a real picture, not a black (NaN) one: equal pixels below mean something
    [listed] = browser.predict(api_name="/history")
    assert (listed["speed"], listed["lora"], listed["lora_scale"], listed["num_inference_steps"]) == (
        "fastest", "style", 0.5, 4)
    raw = RawGradio(server.url, httpx.Client(timeout=60, cookies={COOKIE: browser.cookies[COOKIE]}))
    fill = raw.fn_index(trigger=("history-rerun", "click"))
    rerun = next(d["id"] for d in raw.config["dependencies"] if d.get("trigger_after") == fill)
    filled = raw.predict(fill, [listed["id"]])
    assert filled.status_code == 200, filled.text
    values = filled.json()["data"]  # a value for each of the page's edit controls, in `/edit`'s order
    form = dict(zip(edit_fields(), values, strict=True))
    # ... and the Step cache the result's PNG records (none: made without one); no mask, no rewrite
    assert [form[name] for name in edit_fields()[1:13]] == ["make it blue", "", 12, False, 4, 4.0, 1, 64, 64,
                                                           "fastest", "style", 0.5]
    assert (form["cache"], form["mask"], form["enhance_prompt"]) == ("none", None, False)
    # made without words to select by or padding: those boxes are emptied, not left as the form has them
    assert (form["mask_prompt"], form["expand"]) == ("", "")
    # the mask's grow, feather and strength stay as the form has them (the page sends its values; here none)
    values = [None if isinstance(v, dict) and v.get("__type__") == "update" else v for v in values]
    assert raw.join(rerun, values).status_code == 200
    done = [m for m in raw.messages() if m.get("msg") == "process_completed"][0]
    assert done["success"], done
    rerun_path = done["output"]["data"][0][0]["image"]["path"]
    assert np.array_equal(np.asarray(Image.open(rerun_path).convert("RGB")), original)
    assert "Seed used: 12" in done["output"]["data"][1] and "4 steps" in done["output"]["data"][1]
    # An edit selected by words (mask_prompt) keeps its words: /history lists them, the re-run outlines them
    # again and gives the same pixels (without them it would edit the whole picture).
    masked, _ = browser.predict(*edit_args([image_file], seed=13), "quality", "none", 1.0, mask_prompt=SCRIPTED,
                                api_name="/edit")
    masked = np.asarray(Image.open(masked[0]["image"]).convert("RGB"))
    newest = browser.predict(api_name="/history")[0]
    assert (newest["seed"], newest["mask_prompt"]) == (13, SCRIPTED), newest
    filled = dict(zip(edit_fields(), raw.predict(fill, [newest["id"]]).json()["data"], strict=True))
    assert (filled["mask_prompt"], filled["mask"], filled["seed"]) == (SCRIPTED, None, 13), filled
    sent = [None if isinstance(v, dict) and v.get("__type__") == "update" else v for v in filled.values()]
    assert raw.join(rerun, sent).status_code == 200
    done = [m for m in raw.messages() if m.get("msg") == "process_completed"][0]
    assert done["success"], done
    again = np.asarray(Image.open(done["output"]["data"][0][0]["image"]["path"]).convert("RGB"))
    assert np.array_equal(again, masked) and not np.array_equal(masked, original)
    # The page's Batch tab takes the page's Speed / LoRA / strength too: the same edit as one item.
    batch, report, _ = browser.predict(*edit_args([image_file], seed=12), "fastest", "style", 0.5, api_name="/batch")
    item = Image.open(batch[0]["image"])
    assert "1 of 1 done" in report and np.array_equal(np.asarray(item.convert("RGB")), original)
    assert (item.text["speed"], item.text["lora"], item.text["lora_scale"], item.text["num_inference_steps"]) == (
        "fastest", "Tiny-Edit-Lightning-4steps-V1.0-bf16,style", "1,0.5", "4")

    history = server.server.config.app.state.history
    history._db.execute("UPDATE results SET lora = 'retired' WHERE id = ?", (listed["id"],))
    jobs_done = server.manager.status().workers[0].jobs_done
    refused = raw.predict(fill, [listed["id"]])
    assert refused.json()["error"].startswith("unknown LoRA &#x27;retired&#x27;; configured LoRAs: "), refused.text
    assert server.manager.status().workers[0].jobs_done == jobs_done
    # Open in the editor still fills the form, with quality and no LoRA, and says why.
    assert raw.join(raw.fn_index(trigger=("history-open", "click")), [listed["id"]]).status_code == 200
    messages = raw.messages()
    done = [m for m in messages if m.get("msg") == "process_completed"][0]
    opened = dict(zip(edit_fields(), done["output"]["data"], strict=True)) if done["success"] else done
    assert [opened[name] for name in edit_fields()[1:13]] == [
        "make it blue", "", 12, False, 4, 4.0, 1, 64, 64, "quality", "none", 1.0] and opened["cache"] == "none", done
    notices = [m["log"] for m in messages if m.get("msg") == "log" and m.get("level") == "warning"]
    assert notices and "unknown LoRA" in notices[0] and "quality and no LoRA instead" in notices[0], messages
    assert server.manager.status().workers[0].jobs_done == jobs_done
    raw.close()



def test_delete_removes_ones_own_entry_and_its_files_and_never_anothers(lora_server, image_file):
    """#46 item 6: History's Delete (the page's event, as the browser sends it) removes the chosen entry and its
    folder; another browser naming the same entry id deletes nothing."""
    from raw_gradio import RawGradio

    owner = Client(lora_server.url, verbose=False)
    owner.predict(*edit_args([image_file], seed=3), "quality", "none", 1.0, api_name="/edit")
    listed = owner.predict(api_name="/history")
    entry = listed[0]
    folder = lora_server.manager.settings.output_dir
    thumbs = {str(p) for p in Path(folder).rglob("thumb.png")}
    other = Client(lora_server.url, verbose=False)  # another browser: a cookie of its own
    stranger = RawGradio(lora_server.url, httpx.Client(timeout=60, cookies={COOKIE: other.cookies[COOKIE]}))
    delete = stranger.fn_index(trigger=("history-delete-confirm", "click"))
    refused = stranger.predict(delete, [entry["id"]])
    assert refused.json()["error"] == "choose an entry in the history first", refused.text
    assert {str(p) for p in Path(folder).rglob("thumb.png")} == thumbs  # nothing of the owner's went
    mine = RawGradio(lora_server.url, httpx.Client(timeout=60, cookies={COOKIE: owner.cookies[COOKIE]}))
    done = mine.predict(delete, [entry["id"]])
    assert done.status_code == 200, done.text
    assert done.json()["data"][1].startswith("Deleted:")
    assert [e["id"] for e in owner.predict(api_name="/history")] == [e["id"] for e in listed[1:]]
    assert len({str(p) for p in Path(folder).rglob("thumb.png")}) == len(thumbs) - 1


def test_history_exports_are_swept_not_left_one_folder_a_click(tmp_path):
    """#27 item 5: "pick" and "Open in the editor" hand Gradio a copy; 25 clicks once left 25 folders."""
    import os

    from imgedit.web.page import exports

    source = tmp_path / "out-0.png"
    picture().save(source)
    made = [Path(exports.export_copy([source], f"imgedit-{n}")) for n in range(25)]
    assert all(p.exists() for p in made)  # fresh copies stay: Gradio is still copying them into its cache
    old = time.time() - exports.EXPORT_KEEP_S - 1
    for p in made:
        os.utime(p.parent, (old, old))
    latest = Path(exports.export_copy([source, source], "imgedit-zip"))
    assert latest.exists() and latest.suffix == ".zip"
    assert not any(p.parent.exists() for p in made)  # (other tests' recent exports may be there too)
