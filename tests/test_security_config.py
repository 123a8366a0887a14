"""Issue 63 items 5 and 6: configuration that once failed open or ended in a raw traceback stops start-up at
once (app.py's `main`, before the port is taken or any worker starts), naming the line or the variable."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def main():
    spec = importlib.util.spec_from_file_location("imgedit_app_main", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def start(main, capsys, tmp_path, env_file: str = "") -> str:
    """main()'s exit status must be 2; what it wrote to stderr."""
    (tmp_path / "settings.env").write_bytes(env_file.encode())
    assert main(["--demo", "--env-file", str(tmp_path / "settings.env")]) == 2
    return capsys.readouterr().err


def test_a_bad_env_file_stops_start_up_naming_each_bad_line(main, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUTPUT_DIR", str(tmp_path / "out"))
    said = start(main, capsys, tmp_path, 'QUEUE_MAX_SIZ=4\nHF_TOKEN=x\nLOG_LEVEL=IN\0FO\n'
                 'GRADIO_AUTH="admin:secret-pw\nLOG_LEVEL=INFO\n')
    # an unclosed quote on GRADIO_AUTH's line: python-dotenv logged a warning and the page started with no login
    assert "settings.env line 4 (GRADIO_AUTH=...) cannot be parsed" in said, said
    assert "line 1: QUEUE_MAX_SIZ is not a setting; did you mean QUEUE_MAX_SIZE?" in said, said
    assert "line 3 (LOG_LEVEL=...) holds a NUL byte" in said, said  # was ValueError's traceback
    assert "secret-pw" not in said and "HF_TOKEN" not in said


def test_folders_that_are_files_and_a_broken_history_are_named(main, capsys, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("OUTPUT_DIR", str(tmp_path / "out"))
    for name in ("GRADIO_TEMP_DIR", "COMPILE_CACHE_DIR"):  # a raw traceback; a server at 503 naming nothing
        with monkeypatch.context() as env:
            env.setenv(name, str(tmp_path / "a-file"))
            said = start(main, capsys, tmp_path)
        assert f"{name}='{tmp_path / 'a-file'}' cannot be used as a folder: it is a file" in said, said
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "history.sqlite3").write_bytes(b"not a database" * 100)
    said = start(main, capsys, tmp_path)  # was sqlite3's traceback, once the workers had started
    assert "history.sqlite3 (in OUTPUT_DIR) cannot be opened: file is not a database" in said, said


def test_values_that_refused_everything_or_passed_unnoticed_are_named():
    from PIL import Image

    from imgedit.config.settings import load_settings
    from imgedit.engine.validation import output_size, resolve
    from imgedit.errors import InvalidInput, SettingsError
    from imgedit.protocol import EditRequest

    for env, said in (({"MAX_STEPS": "1"}, "MAX_STEPS='1' is not valid"),  # a server that refused every edit
                      ({"MAX_FILE_SIZE": "0"}, "MAX_FILE_SIZE='0' is not valid: expected at least 1KB")):
        with pytest.raises(SettingsError, match=said):
            load_settings(env)
    settings = load_settings({})
    with pytest.raises(InvalidInput, match="2064x2048 is 4,227,072 pixels"):  # rounded to 2048x2048, accepted
        output_size(2064, 2048, None, settings, "21")
    assert output_size(2048, 2048, None, settings, "21") == (2048, 2048)
    req = EditRequest(images=(Image.new("RGB", (64, 64)),), prompt="x", negative_prompt="n" * 4001)
    with pytest.raises(InvalidInput, match="the negative prompt is longer than 4000") as refused:
        resolve(req, settings, "plus", (64, 64), 1)  # was "the prompt is longer", naming the prompt
    assert refused.value.field == "negative_prompt"


def test_repeated_log_lines_are_written_a_few_times_then_summed_up():
    """web.logs.Repeats on a real handler: 800 refusals in a window write BURST lines; the first one after the
    window says how many were left out (a flood once wrote one warning per refused connection)."""
    import logging

    from imgedit.web.logs import BURST, WINDOW_S, Repeats

    written: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: written.append(record.getMessage())
    handler.addFilter(Repeats())
    logger = logging.getLogger("imgedit.test_repeats")

    def refusal(at: float) -> None:
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1,
                                   "refused a connection from %s: %s", ("127.0.0.2", "cap"), None)
        record.created = at
        handler.handle(record)

    for k in range(800):
        refusal(1000.0 + k / 1000)
    assert len(written) == BURST
    refusal(1000.0 + WINDOW_S + 0.1)
    assert written[-1] == (f"refused a connection from 127.0.0.2: cap [{800 - BURST:,} more like this were not "
                           "written in the last 5 s]"), written[-1]
