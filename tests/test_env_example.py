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
COMMENTED_ASSIGNMENT = re.compile(r"^#\s*([A-Z_][A-Z0-9_]*)=")


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
    registry = [var.name for var in REGISTRY]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, f"listed more than once in .env.example: {duplicates}"
    missing = [name for name in registry if name not in names]
    assert not missing, f"registry variables missing from .env.example: {missing}"
    unknown = [name for name in names if name not in registry]
    assert not unknown, f"uncommented variables that are not in the registry (comment them out): {unknown}"
    assert names == registry, "order differs from imgedit.config.settings.REGISTRY"


def test_defaults_match_registry(entries):
    values = {name: value for _, name, value in entries}
    wrong = {var.name: (values.get(var.name), var.default) for var in REGISTRY if values.get(var.name) != var.default}
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
    clashes = sorted(registry & set(commented))
    assert not clashes, f"registry variables also appear commented out (ambiguous): {clashes}"


def test_the_apps_dotenv_reader_sees_the_same_values(entries):
    """python-dotenv (what app.py uses) must read exactly the registry block: no quoting surprises."""
    ours = {name: value for _, name, value in entries}
    assert dict(dotenv_values(ENV_EXAMPLE)) == ours


def test_defaults_parse(entries):
    settings = load_settings({name: value for _, name, value in entries})
    assert settings == load_settings({}), "the .env.example values must give the same settings as the defaults"
