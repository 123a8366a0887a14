""".env.example stays in step with imgedit.config.settings.REGISTRY: same names, same order, same defaults.

Uncommented `NAME=value` lines are the registry block; docker-only extras (GPU_COUNT, HF_HOME, ...) must
stay commented out so they can be told apart.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dotenv import dotenv_values

from imgedit.config.settings import REGISTRY, load_settings

ROOT = Path(__file__).resolve().parents[1]
ENV_EXAMPLE = ROOT / ".env.example"
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
COMMENTED_ASSIGNMENT = re.compile(r"^#\s*([A-Z_][A-Z0-9_]*)=(.*)$")
# Commented out in the example, with their defaults: setting QWEN_MODEL (even to its default) is choosing a
# model, which turns off the demo fallback on a machine without a GPU (`cp .env.example .env` must keep it).
CHOSEN_BY_THE_USER = ("QWEN_MODEL", "QWEN_MODEL_DIR")


def parse_env_example(text: str) -> list[tuple[int, str, str]]:
    """(line index, name, value) for every uncommented assignment, in file order."""
    entries = []
    for index, raw in enumerate(text.splitlines()):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = ASSIGNMENT.match(line)
        assert match, f".env.example line {index + 1} is neither a comment nor NAME=value: {raw!r}"
        entries.append((index, match.group(1), match.group(2)))
    return entries


@pytest.fixture(scope="module")
def text() -> str:
    assert ENV_EXAMPLE.is_file(), ".env.example is missing from the project root"
    return ENV_EXAMPLE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def entries(text) -> list[tuple[int, str, str]]:
    return parse_env_example(text)


def test_every_registry_var_once_in_registry_order(entries):
    names = [name for _, name, _ in entries]
    registry = [var.name for var in REGISTRY if var.name not in CHOSEN_BY_THE_USER]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, f"listed more than once in .env.example: {duplicates}"
    missing = [name for name in registry if name not in names]
    assert not missing, f"registry variables missing from .env.example: {missing}"
    unknown = [name for name in names if name not in registry]
    assert not unknown, f"uncommented variables that are not in the registry (comment them out): {unknown}"
    assert names == registry, "order differs from imgedit.config.settings.REGISTRY"


def test_defaults_match_registry(entries):
    values = {name: value for _, name, value in entries}
    wrong = {var.name: (values.get(var.name), var.default) for var in REGISTRY
             if var.name not in CHOSEN_BY_THE_USER and values.get(var.name) != var.default}
    assert not wrong, f"(.env.example value, registry default) differ: {wrong}"


def test_each_var_has_its_help_as_the_comment_line_above(text, entries):
    lines = text.splitlines()
    helps = {var.name: var.help for var in REGISTRY}
    for index, name, _ in entries:
        above = lines[index - 1].strip() if index else ""
        assert above == f"# {helps[name]}", f"{name}: expected '# {helps[name]}' on the line above, got {above!r}"


def test_docker_extras_are_commented_and_not_registry_vars(text):
    registry = {var.name for var in REGISTRY}
    commented = [m.group(1) for line in text.splitlines() if (m := COMMENTED_ASSIGNMENT.match(line.strip()))]
    for extra in ("GPU_COUNT", "CUDA_VISIBLE_DEVICES", "HF_HOME", "MODEL_CACHE_DIR"):
        assert extra in commented, f"document the docker-only variable {extra} as a commented line"
    clashes = sorted(registry & set(commented) - set(CHOSEN_BY_THE_USER))
    assert not clashes, f"registry variables also appear commented out (ambiguous): {clashes}"


def test_the_model_lines_are_commented_with_their_defaults_and_help(text):
    """`cp .env.example .env` keeps the demo fallback: no model is chosen until a model line is uncommented."""
    lines = text.splitlines()
    helps = {var.name: var for var in REGISTRY}
    for name in CHOSEN_BY_THE_USER:
        index = next(i for i, line in enumerate(lines) if (m := COMMENTED_ASSIGNMENT.match(line)) and m[1] == name)
        assert COMMENTED_ASSIGNMENT.match(lines[index])[2] == helps[name].default
        assert lines[index - 1] == f"# {helps[name].help}"
    assert not {"QWEN_MODEL", "QWEN_MODEL_DIR"} & set(dotenv_values(ENV_EXAMPLE))


def test_the_apps_dotenv_reader_sees_the_same_values(entries):
    """python-dotenv (what app.py uses) must read exactly the registry block: no quoting surprises."""
    ours = {name: value for _, name, value in entries}
    assert dict(dotenv_values(ENV_EXAMPLE)) == ours


def test_defaults_parse(entries):
    settings = load_settings({name: value for _, name, value in entries})
    assert settings == load_settings({}), "the .env.example values must give the same settings as the defaults"
