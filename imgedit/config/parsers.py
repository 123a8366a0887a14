"""Parsers of setting values: each takes the raw string and returns a value or raises
ValueError(what is allowed). Pure; `imgedit.config.settings` names the variables that use them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3
DEVICE_MAP_MODES = ("balanced", "auto", "replicas", "cfg-parallel", "ulysses", "cuda", "cpu")
GROUP_SIZES = (2, 4, 8)  # GPUs in one parallel group: cfg-parallel[:N], ulysses[:N]
DTYPES = ("bfloat16", "float16", "float32")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _str(raw: str) -> str:
    return raw.strip()


def _optional_str(raw: str) -> str | None:
    return raw.strip() or None


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("one of true/false, 1/0, yes/no, on/off")


def _auto_or_int(low: int, high: int) -> Callable[[str], int]:
    """'auto' as 0, else a whole number from low to high."""
    numbers = _int_range(low, high)

    def parse(raw: str) -> int:
        if raw.strip().lower() == "auto":
            return 0
        try:
            return numbers(raw)
        except ValueError:
            raise ValueError(f"auto or a whole number from {low} to {high}") from None

    return parse


def _int_range(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"a whole number from {low} to {high}") from None
        if not low <= value <= high:
            raise ValueError(f"a whole number from {low} to {high}")
        return value

    return parse


def _float_range(low: float, high: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"a number from {low} to {high}") from None
        if not low <= value <= high:
            raise ValueError(f"a number from {low} to {high}")
        return value

    return parse


def _choice(*allowed: str, upper: bool = False) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().upper() if upper else raw.strip().lower()
        aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
        value = aliases.get(value, value)
        if value not in allowed:
            raise ValueError("one of " + ", ".join(allowed))
        return value

    return parse


def parse_size(raw: str) -> int:
    """'75GiB', '30GB', '512MiB', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", raw)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError("a size such as 75GiB, 30GB or 512MiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def human_size(n: int) -> str:
    """Bytes as the settings write them: 25000000 -> "25 MB", 26214400 -> "25 MiB", 1234 -> "1,234 bytes"."""
    for unit in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB"):
        size = _SIZE_UNITS[unit.upper()]
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


def _size(raw: str) -> int:
    return parse_size(raw)


def _max_memory(raw: str) -> tuple[int, ...]:
    if not raw.strip():
        return ()
    try:
        return tuple(parse_size(part) for part in raw.split(","))
    except ValueError:
        raise ValueError("comma-separated sizes, one per visible GPU or one for all, "
                         "e.g. 75GiB,75GiB") from None


@dataclass(frozen=True)
class DeviceMap:
    """DEVICE_MAP parsed: a mode, a single GPU (`cuda:N`) or a manual map."""

    mode: str  # balanced | auto | replicas | cfg-parallel | ulysses | cuda | cpu | manual
    gpu: int | None = None  # for cuda / cuda:N
    manual: Mapping[str, Any] = field(default_factory=dict)
    group: int = 2  # GPUs per parallel group (cfg-parallel:N, ulysses:N)


def parse_device_map(raw: str) -> DeviceMap:
    text = raw.strip()
    allowed = ("balanced, auto, replicas, cfg-parallel, cfg-parallel:4, cfg-parallel:8, "
               "ulysses:2, ulysses:4, ulysses:8, cuda, cuda:N, cpu, or a JSON object such as "
               '{"transformer": {"0-29": "cuda:0", "30-59": "cuda:1"}, '
               '"text_encoder": "cuda:1", "vae": "cuda:0"}')
    if text.startswith("{"):
        try:
            manual = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"valid JSON ({exc.msg} at position {exc.pos}); allowed: {allowed}") from None
        if not isinstance(manual, dict):
            raise ValueError(f"a JSON object; allowed: {allowed}")
        for name, where in manual.items():
            if not isinstance(where, (str, dict)):
                raise ValueError(f"a device string or a block-range object for {name!r}; allowed: {allowed}")
            if isinstance(where, dict) and not all(isinstance(d, str) for d in where.values()):
                raise ValueError(f"device strings such as \"cuda:0\" for the block ranges of {name!r}")
        return DeviceMap("manual", manual=manual)
    value = text.lower()
    if value in DEVICE_MAP_MODES:
        return DeviceMap(value, gpu=0 if value == "cuda" else None)
    if match := re.fullmatch(r"cuda:(\d+)", value):
        return DeviceMap("cuda", gpu=int(match.group(1)))
    if match := re.fullmatch(r"(cfg-parallel|ulysses):(\d+)", value):
        if int(match.group(2)) not in GROUP_SIZES:
            raise ValueError(f"a group of 2, 4 or 8 GPUs after {match.group(1)}:; allowed: {allowed}")
        return DeviceMap(match.group(1), group=int(match.group(2)))
    raise ValueError(allowed)


# ---- QUANTIZE / QUANTIZE_SKIP / OFFLOAD ----

MODES = ("none", "fp8", "int8", "nf4")
QUANTIZABLE = ("transformer", "text_encoder")  # the VAE is convolutions: nothing for weight quantization
OFFLOADS = ("none", "text_encoder", "blocks")


def parse_quantize(raw: str) -> tuple[tuple[str, str], ...] | None:
    """QUANTIZE: `auto` (None: the planner decides), `none`, a mode for the transformer (`fp8`), or
    `component=mode,...`. Returns ((component, mode), ...) with the components that are quantized."""
    text = raw.strip().lower()
    allowed = ("auto, none, fp8, int8, nf4 (the transformer), or component=mode pairs such as "
               "transformer=fp8,text_encoder=int8 (components: transformer, text_encoder)")
    if text in ("", "auto"):
        return None
    if text in MODES:
        return () if text == "none" else (("transformer", text),)
    pairs: dict[str, str] = {}
    for part in text.split(","):
        name, sep, mode = (s.strip() for s in part.partition("="))
        if not sep or name not in QUANTIZABLE or mode not in MODES or name in pairs:
            raise ValueError(allowed)
        pairs[name] = mode
    return tuple((n, m) for n, m in pairs.items() if m != "none")


def parse_offload(raw: str) -> tuple[str, ...] | None:
    """OFFLOAD: `auto` (None), `none` (()), or `text_encoder`, `blocks` or both, comma-separated."""
    text = raw.strip().lower()
    if text in ("", "auto"):
        return None
    parts = [p.strip() for p in text.split(",")]
    if parts == ["none"]:
        return ()
    if not parts or any(p not in OFFLOADS[1:] for p in parts) or len(set(parts)) != len(parts):
        raise ValueError("auto, none, text_encoder, blocks, or text_encoder,blocks")
    return tuple(p for p in OFFLOADS if p in parts)


def parse_skip(raw: str) -> tuple[str, ...] | None:
    """QUANTIZE_SKIP: names of submodules whose Linear layers keep the model dtype (`img_mlp`); None for
    `auto` (the model family's, imgedit.planning.families)."""
    if raw.strip().lower() == "auto":
        return None
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not all(n.replace("_", "").replace(".", "").isalnum() for n in names):
        raise ValueError("comma-separated module names such as img_mlp, or empty to quantize every Linear")
    return names


def parse_speeds(raw: str) -> tuple[str, ...]:
    """FAST_QUANTIZE_SPEEDS: the speed presets that get a copy, `fastest,fast` | `fastest` | `fast`."""
    speeds = tuple(dict.fromkeys(p.strip().lower() for p in raw.split(",") if p.strip()))
    if not speeds or any(s not in ("fast", "fastest") for s in speeds):
        raise ValueError("fastest, fast, or both comma-separated")
    return speeds


def is_skipped(fqn: str, skip: tuple[str, ...] | list[str]) -> bool:
    """QUANTIZE_SKIP names match whole dotted segments (`img_mlp` matches blocks.3.img_mlp.net.0)."""
    return any(f".{s}." in f".{fqn}." for s in skip)


_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def _credentials(what: str, min_secret: int) -> Callable[[str], tuple[tuple[str, str], ...]]:
    """`name:secret` pairs separated by commas or newlines, or `@/path/to/file` holding them one per
    line (for secrets with commas, or a mounted secret). Names and secrets must be unique."""

    def parse(raw: str) -> tuple[tuple[str, str], ...]:
        text = raw.strip()
        if text.startswith("@"):
            try:
                with open(Path(text[1:]).expanduser(), encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise ValueError(f"a readable file of {what} (one per line): {exc.strerror}") from None
            parts = [line.strip() for line in text.splitlines()]
        else:
            parts = [part.strip() for part in re.split(r"[,\n]", text)]
        pairs: list[tuple[str, str]] = []
        for part in parts:
            if not part or part.startswith("#"):
                continue
            name, sep, secret = part.partition(":")
            if not sep or not _NAME.fullmatch(name.strip()) or len(secret.strip()) < min_secret:
                raise ValueError(f"{what} as name:secret (name: letters, digits, _.@-; secret: at least "
                                 f"{min_secret} characters), separated by commas, or @file with one per line")
            pairs.append((name.strip(), secret.strip()))
        names, secrets = [n for n, _ in pairs], [s for _, s in pairs]
        if len(set(names)) < len(names) or len(set(secrets)) < len(secrets):
            raise ValueError(f"{what} with unique names and unique secrets")
        return tuple(pairs)

    return parse


parse_api_keys = _credentials("API keys", 8)
parse_logins = _credentials("logins", 1)
