"""Every setting imgedit reads, listed once: name, default, parser and meaning.

`load_settings()` parses the environment (after `load_dotenv()`) into a frozen `Settings`; a bad
value stops start-up with a message naming the variable, the value and what is allowed.
`.env.example` mirrors `REGISTRY` line for line (a test keeps them in step).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dotenv import load_dotenv
from dotenv.parser import parse_stream

from imgedit.config.loras import entries, parse_loras
from imgedit.config.parsers import (
    DTYPES,
    LOG_LEVELS,
    DeviceMap,
    _auto_or_int,
    _bool,
    _choice,
    _float_range,
    _int_range,
    _max_memory,
    _optional_str,
    _size,
    _str,
    parse_api_keys,
    parse_device_map,
    parse_logins,
    parse_offload,
    parse_quantize,
    parse_skip,
    parse_speeds,
)
from imgedit.errors import SettingsError


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    parse: Callable[[str], Any]
    help: str
    attr: str = ""


REGISTRY: tuple[Var, ...] = (
    Var("QWEN_MODEL", "Qwen/Qwen-Image-Edit-2509", _str,
        "Hub id or local path of the checkpoint (Qwen-Image-Edit, -2509, -2511 or Qwen-Image-2.1)"),
    Var("QWEN_MODEL_DIR", "", _optional_str,
        "Local checkpoint folder; when set it wins over QWEN_MODEL (the docker guides' name)"),
    Var("DEMO", "false", _bool,
        "Serve the tiny random-weight demo checkpoint (built locally, no download); outputs are noise"),
    Var("DEMO_DIR", "~/.cache/imgedit/demo", _str, "Where the demo checkpoint is built and cached"),
    Var("DEMO_KIND", "plus", _choice("plus", "edit", "21"),
        "The demo model's family: plus (Qwen-Image-Edit-2509/2511) | "
        "edit (Qwen-Image-Edit) | 21 (Qwen-Image-2.1)"),
    Var("DEVICE_MAP", "balanced", parse_device_map,
        "balanced | auto | replicas | cfg-parallel | cfg-parallel:4|8 | "
        "ulysses[:2|4|8] | cuda | cuda:N | cpu | JSON map (see docs/gpus.md)"),
    Var("MAX_MEMORY", "", _max_memory,
        "Per-GPU memory caps, e.g. 75GiB,75GiB (one per visible GPU, or one for all); empty = free memory"),
    Var("GPU_MEMORY_RESERVE", "1.5GiB", _size,
        "Memory kept free on every GPU when planning placement (CUDA context, fragmentation)"),
    Var("ACTIVATION_RESERVE", "4GiB", _size,
        "Extra memory kept free on each worker's first GPU for latents, attention and VAE activations"),
    Var("TORCH_DTYPE", "bfloat16", _choice(*DTYPES),
        "bfloat16 (recommended) | float16 (black images with this model) | float32"),
    Var("QUEUE_MAX_SIZE", "16", _int_range(1, 10_000),
        "Jobs allowed to wait in line; more get 'busy, try later'"),
    Var("DEFAULT_STEPS", "0", _int_range(0, 1000),
        "Default denoising steps; 0 = per model (Edit 50, Plus 40, Qwen-Image-2.1 40)"),
    Var("MAX_STEPS", "100", _int_range(2, 1000),  # one step makes a blank image: every request was refused
        "Most denoising steps a request may ask for"),
    Var("DEFAULT_TRUE_CFG", "4.0", _float_range(1.0, 20.0),
        "Default true CFG scale (1 turns CFG off) for the edit models; Qwen-Image-2.1 runs at 1 (no CFG) "
        "unless a request asks"),
    Var("MAX_INPUT_PIXELS", "16777216", _int_range(1, 178_000_000),  # Pillow refuses more anyway
        "Inputs over this many pixels are downscaled to it for the model; one over 4x it is refused "
        "(checked before decoding)"),
    Var("MAX_OUTPUT_PIXELS", "4194304", _int_range(1, 100_000_000),
        "Largest output width*height when a size is asked for (auto is about 1 MP)"),
    Var("MAX_FILE_SIZE", "25MB", _size, "Largest upload accepted by the UI and REST"),
    Var("BODY_READ_TIMEOUT", "30", _int_range(1, 3600),
        "Seconds a request body may stall (no bytes at all) before the server answers 408 and hangs up"),
    Var("BODY_MIN_RATE", "1024", _int_range(0, 1_000_000_000),
        "Bytes per second a request body must average once BODY_READ_TIMEOUT seconds have passed (0 = no "
        "floor); a slower one is answered 408, and is the first to go when the server is full"),
    Var("HEADER_READ_TIMEOUT", "10", _int_range(1, 3600),
        "Seconds a connection may take to send a request's "
        "headers before the server answers 408 and hangs up"),
    Var("MAX_CONNECTIONS", "512", _int_range(0, 100_000),
        "Most connections open at once; more are answered 503 and closed (0 = no cap)"),
    Var("MAX_CONNECTIONS_PER_CLIENT", "256", _int_range(0, 100_000),
        "Most connections open at once from one address (raise "
        "it behind a proxy, which is one address; 0 = no cap)"),
    Var("MAX_IMAGES_PER_PROMPT", "4", _int_range(1, 16), "Largest number of images one request may ask for"),
    Var("LORA_DIR", "", _optional_str,
        "Folder whose *.safetensors LoRAs are offered, each named by its file name without .safetensors"),
    Var("LORAS", "", parse_loras,
        "More LoRAs as name=path pairs, comma-separated; a "
        "path may be a hub file owner/repo/file.safetensors"),
    Var("FAST_LORA_4STEP", "", _optional_str,
        "Name of the Lightning 4-step LoRA for speed=fastest; "
        "empty = the LoRA whose file name says Lightning-4steps"),
    Var("FAST_LORA_8STEP", "", _optional_str,
        "Name of the Lightning 8-step LoRA for speed=fast; "
        "empty = the LoRA whose file name says Lightning-8steps"),
    Var("TURBO_MODEL_DIR", "", _optional_str,
        "Qwen-Image-2.1 only: a local Qwen-Image-2.1-Turbo folder (the 8-step distilled checkpoint, Qwen "
        "Research License); speed=fast and fastest then run its transformer and schedule (8 steps, CFG off), "
        "a second transformer of the model's size on the same GPU(s), quantized as the model's with "
        "QUANTIZE; not with MAX_MEMORY or OFFLOAD"),
    Var("FUSE_LORA", "auto", _choice("auto", "off"),
        "auto: a job with exactly one LoRA (e.g. speed=fastest) runs it fused into the weights, no per-step "
        "cost instead of +9 %, when an exact copy of the weights it adapts (25 GiB for a Lightning LoRA) "
        "fits on the GPU with ACTIVATION_RESERVE left; else, and with off, LoRAs run unfused"),
    Var("FAST_QUANTIZE", "none", _choice("none", "fp8", "int8"),
        "fp8: speed=fast/fastest run on a copy of the transformer per Lightning LoRA, the "
        "LoRA fused in and every Linear layer in fp8 (lossy; one H100: fastest 1.36 s "
        "instead of 1.80 s, +19 GiB and ~5 min of compiling per copy; workers of one GPU or "
        "CFG pairs, compute capability 8.9+) | int8 (weight-only: the CPU and GPUs without "
        "fp8; not measured faster) | none: fast jobs run on the quality weights (FUSE_LORA)"),
    Var("FAST_QUANTIZE_SPEEDS", "fastest,fast", parse_speeds,
        "The speed presets whose Lightning LoRA gets a FAST_QUANTIZE copy: fastest,fast | fastest | fast "
        "(one copy fits beside the bf16 model on an 80 GB card, two do not)"),
    Var("QUANTIZE", "auto", parse_quantize,
        "auto (lossless first: bf16, offloaded if need be; quantized only when nothing lossless fits) | "
        "none | fp8 | int8 | nf4 (the transformer) | component=mode pairs, e.g. "
        "transformer=fp8,text_encoder=int8; fp8 needs compute capability 8.9+"),
    Var("QUANTIZE_SKIP", "auto", parse_skip,
        "Transformer submodules whose Linear layers stay bf16 when it is "
        "quantized (comma-separated; empty = none; auto = per model: img_mlp for "
        "the edit models, none for Qwen-Image-2.1, whose img_mlp is most of it)"),
    Var("OFFLOAD", "auto", parse_offload,
        "auto (only when nothing fits otherwise) | none | text_encoder (on the CPU, streamed per prompt) | "
        "blocks (transformer blocks that do not fit streamed from the CPU) | text_encoder,blocks"),
    Var("BATCH_CFG", "auto", _choice("auto", "on", "off"),
        "Run both true-CFG branches in one transformer forward of batch 2; auto = on when transformer blocks "
        "are streamed from the CPU (each streamed block then crosses to the GPU once per step, not twice)"),
    Var("PAIR_ULYSSES", "auto", _choice("auto", "on", "off"),
        "A cfg-parallel pair runs CFG-off jobs (speed=fast/fastest) on both "
        "GPUs, each forward's sequence split in two (Ulysses-2) instead of "
        "on one GPU; auto = on for GPU pairs with ATTENTION native or cudnn"),
    Var("COMPILE", "auto", _choice("auto", "on", "off"),
        "Compile the transformer's repeated blocks (torch.compile; Qwen-Image-2.1: its steps after the "
        "first), warmed up at start-up; auto = on for GPUs (2.1: not under MAX_MEMORY)"),
    Var("COMPILE_MODE", "default", _choice("default", "max-autotune-no-cudagraphs"),
        "torch.compile's mode for the compiled blocks: default | max-autotune-no-cudagraphs "
        "(tries kernel variants at start-up; on an H100 no faster: 0.626 vs 0.623 s/step, "
        "4.7x the start-up); needs compiled workers. CUDA graphs (max-autotune) fail on the "
        "per-block compile: each block's replay overwrites the last one's output"),
    Var("ATTENTION", "native", _choice("native", "flash", "cudnn", "efficient"),
        "The transformer's attention kernel (diffusers' set_attention_backend): "
        "native (PyTorch picks: cuDNN's on an H100/H200, the fastest there) | flash | cudnn | "
        "efficient (PyTorch's own kernels, nothing downloaded); cudnn and efficient need CUDA GPUs"),
    Var("ENCODE_CACHE", "8", _int_range(0, 256),
        "Input encodings each worker keeps: the same image edited again is not VAE-encoded again, the same "
        "prompt with the same images not text-encoded again (exact: the stored results); 0 = off"),
    Var("WORKER_THREADS", "auto", _auto_or_int(1, 256),
        "PyTorch CPU threads in each GPU worker process (prompts and pictures are prepared on its CPU): auto "
        "= the machine's CPUs shared out over its GPU processes, at most 4 for a one-GPU worker, or "
        "OMP_NUM_THREADS where set (WORKERS=ray: Ray's). PyTorch's default, every CPU in every process, made "
        "the steps before the loop slower; CPU workers keep it"),
    Var("CACHE", "none", _choice("none", "first-block", "taylorseer"),
        "Step cache for quality edits (diffusers' cache hooks): none | first-block (skip the other blocks "
        "when the first block's residual barely changed) | taylorseer (forecast blocks between full steps); "
        "lossy, opt-in; a request's `cache` field overrides it"),
    Var("CACHE_THRESHOLD", "0.08", _float_range(0.0, 10.0),
        "first-block: how little the first block's residual "
        "may change (relative) for a step to reuse the rest"),
    Var("ENHANCE_MAX_TOKENS", "160", _int_range(16, 1024),
        "Most new tokens a prompt rewrite (Enhance, enhance_prompt) may write; a rewrite cut at this limit "
        "is not used (the user's prompt is, with a notice)"),
    Var("COMPILE_CACHE_DIR", "~/.cache/imgedit/compile", _str,
        "Where the compiler keeps its cache, so a restart does not compile again (a volume in compose/k8s)"),
    Var("WORKER_RESTARTS", "3", _int_range(0, 100),
        "How many times a worker process that dies is restarted before it is reported failed"),
    Var("WORKER_START", "spawn", _choice("spawn", "forkserver"),
        "How local worker processes start: spawn (a fresh interpreter each; app.py starts them before it "
        "inspects the checkpoint, so that they import torch meanwhile, and gives each a rank once the plan "
        "is known) | forkserver (torch imported once, workers and the checkpoint's inspection forked from "
        "it; CPU only for now: on the GPU machine a forked worker could not use CUDA)"),
    Var("WORKERS", "local", _choice("local", "ray"),
        "local = worker processes on this machine | ray = Ray actors anywhere in the cluster at RAY_ADDRESS"),
    Var("RAY_ADDRESS", "", _optional_str,
        "With WORKERS=ray: the cluster to join (auto, host:6379 "
        "or ray://host:10001); empty = start a local one"),
    Var("RAY_CONNECT_TIMEOUT", "30", _int_range(1, 3600),
        "Seconds to reach the Ray cluster at start-up; then the server runs without workers and says why"),
    Var("AUTO_CLEANUP", "true", _bool, "Free cached GPU memory after each job"),
    Var("LOG_LEVEL", "INFO", _choice(*LOG_LEVELS, upper=True), "DEBUG | INFO | WARNING | ERROR"),
    Var("GRADIO_SERVER_NAME", "127.0.0.1", _str,
        "Address the server listens on: 127.0.0.1 = this machine only; 0.0.0.0 = every network "
        "(the Docker image and deploy files set it)"),
    Var("GRADIO_SERVER_PORT", "7860", _int_range(1, 65535), "Port the server listens on (UI, API, REST)"),
    Var("API_KEY", "", _optional_str,
        "When set, /metrics and /v1/* need 'Authorization: "
        "Bearer <key>'; every holder shares one set of jobs"),
    Var("API_KEYS", "", parse_api_keys,
        "Keys with owners, name:key,name2:key2 or @file (one per line): each key sees only its own jobs; "
        "a key named as a GRADIO_AUTH user shares that user's History"),
    Var("GRADIO_AUTH", "", parse_logins,
        "Logins for the page, user:password,user2:password2 "
        "or @file (one per line); each user has a History"),
    Var("CLIENT_SHARE", "0.5", _float_range(0.05, 1.0),
        "The most of QUEUE_MAX_SIZE and of JOBS_MAX_PENDING one client (key, login or browser) may hold"),
    Var("INTERACTIVE_RESERVE_S", "120", _float_range(0.0, 86_400.0),
        "For this many seconds after the last edit someone waits on (the page, the gradio API, REST), "
        "items of jobs (/v1/jobs, the Batch tab) leave one worker free for the next one (2+ workers); "
        "0 = never. Waiting edits always start before waiting items"),
    Var("PREEMPT_ITEMS", "on", _choice("on", "off"),
        "on: an edit someone waits on that finds every worker busy pauses a running item of a job at its "
        "next step; the item goes on later from that step, with the image it makes unpaused (masked, "
        "step-cached, rewritten and Turbo items and those on a worker of several processes (a parallel "
        "group) run on). off: edits wait for a free worker"),
    Var("OUTPUT_DIR", "~/.cache/imgedit/outputs", _str,
        "Where finished edits (PNGs, inputs for re-runs) and the history index (SQLite) are kept"),
    Var("OUTPUT_RETENTION_HOURS", "168", _float_range(0.0, 1_000_000.0),
        "Delete stored results older than this many hours; 0 = keep until OUTPUT_MAX_GB"),
    Var("OUTPUT_MAX_GB", "20", _float_range(0.0, 1_000_000.0),
        "Most disk space stored results may take (GB); the "
        "oldest of whoever holds most go first; 0 = no limit"),
    Var("BATCH_MAX_ITEMS", "32", _int_range(1, 1000), "Most input sets (images) in one batch job"),
    Var("JOBS_MAX_PENDING", "128", _int_range(1, 100_000),
        "Most batch and async-job items held unfinished at once; more get 'busy, try later'"),
    Var("SHUTDOWN_GRACE_S", "60", _int_range(0, 3600),
        "On SIGTERM: seconds running jobs get to finish (keep compose/k8s grace periods above it)"),
)


SECRET = ("API_KEY", "API_KEYS", "GRADIO_AUTH")  # never printed


def _attr(var: Var) -> str:
    return var.attr or var.name.lower()


@dataclass(frozen=True)
class Settings:
    """Every setting, parsed: built by load_settings from REGISTRY, whose entries hold the defaults."""

    qwen_model: str
    qwen_model_dir: str | None
    demo: bool
    demo_dir: str
    demo_kind: str
    device_map: DeviceMap
    max_memory: tuple[int, ...]
    gpu_memory_reserve: int
    activation_reserve: int
    torch_dtype: str
    queue_max_size: int
    default_steps: int
    max_steps: int
    default_true_cfg: float
    max_input_pixels: int
    max_output_pixels: int
    max_file_size: int
    body_read_timeout: int
    body_min_rate: int
    header_read_timeout: int
    max_connections: int
    max_connections_per_client: int
    max_images_per_prompt: int
    lora_dir: str | None
    loras: tuple[tuple[str, str], ...]
    fast_lora_4step: str | None
    fast_lora_8step: str | None
    turbo_model_dir: str | None
    fuse_lora: str
    fast_quantize: str
    fast_quantize_speeds: tuple[str, ...]
    lora_entries: tuple  # imgedit.config.loras.LoraEntry for each configured LoRA (built from the four above)
    quantize: tuple[tuple[str, str], ...] | None  # None = auto
    quantize_skip: tuple[str, ...] | None  # None: auto, the model family's (planning.families)
    offload: tuple[str, ...] | None  # None = auto
    batch_cfg: str
    pair_ulysses: str
    compile: str
    compile_mode: str
    attention: str
    encode_cache: int
    worker_threads: int  # 0 = auto
    enhance_max_tokens: int
    cache: str
    cache_threshold: float
    compile_cache_dir: str
    worker_restarts: int
    worker_start: str
    workers: str
    ray_address: str | None
    ray_connect_timeout: int
    auto_cleanup: bool
    log_level: str
    gradio_server_name: str
    gradio_server_port: int
    api_key: str | None
    api_keys: tuple[tuple[str, str], ...]
    gradio_auth: tuple[tuple[str, str], ...]
    client_share: float
    interactive_reserve_s: float
    preempt_items: str
    output_dir: str
    output_retention_hours: float
    output_max_gb: float
    batch_max_items: int
    jobs_max_pending: int
    shutdown_grace_s: int
    cuda_visible_devices: str | None

    @property
    def model_source(self) -> str:
        """The folder or hub id to load: demo dir, then QWEN_MODEL_DIR, then QWEN_MODEL."""
        if self.demo:  # one folder per family: a demo of another family never loads this one's checkpoint
            folder = Path(self.demo_dir).expanduser()
            if self.demo_kind == "plus":
                return str(folder)
            return str(folder.with_name(f"{folder.name}-{self.demo_kind}"))
        return self.qwen_model_dir or self.qwen_model

    @property
    def model_name(self) -> str:
        """The model as anyone may see it (PNG settings, open views): never a path of this machine."""
        return "imgedit-demo" if self.demo else public_model_name(self.model_source)

    @property
    def auth(self) -> list[tuple[str, str]] | None:
        """Gradio's `auth`: the logins, or None for an open page."""
        return list(self.gradio_auth) or None

    @property
    def keys_required(self) -> bool:
        return bool(self.api_key or self.api_keys)


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Parse every registered variable; collect all problems and raise one SettingsError."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    problems = []
    for var in REGISTRY:
        raw = env.get(var.name, var.default)
        try:
            values[_attr(var)] = var.parse(raw)
        except ValueError as exc:
            shown = "(hidden)" if var.name in SECRET else repr(raw)  # a typo must not print the keys
            problems.append(f"{var.name}={shown} is not valid: expected {exc}")
    if values.get("max_file_size") is not None and values["max_file_size"] < 1024:  # 0 refused every upload
        problems.append(f"MAX_FILE_SIZE={env.get('MAX_FILE_SIZE')!r} is not valid: expected at least 1KB "
                        "(smaller refuses every upload)")
    steps, most = values.get("default_steps"), values.get("max_steps")
    if steps is not None and most is not None and steps > most:
        problems.append(f"DEFAULT_STEPS={steps} is above MAX_STEPS={most}")
    device_map = values.get("device_map")
    splits_jobs = device_map is not None and device_map.mode in ("cfg-parallel", "ulysses")
    if values.get("batch_cfg") == "on" and splits_jobs:
        problems.append(f"BATCH_CFG=on runs both CFG branches in one forward on one GPU, but DEVICE_MAP="
                        f"{env.get('DEVICE_MAP')} splits each job over a group of GPUs; "
                        "use BATCH_CFG=auto or off")
    if values.get("api_key") and any(values["api_key"] == key for _, key in values.get("api_keys") or ()):
        problems.append("API_KEY is also one of API_KEYS: "
                        "give the shared key and the owned keys different values")
    if not problems:
        try:
            values["lora_entries"] = entries(values["lora_dir"], values["loras"], values["fast_lora_4step"],
                                             values["fast_lora_8step"])
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise SettingsError("Bad configuration:\n  " + "\n  ".join(problems))
    # The GPUs this process sees: discovery (NVML) reads the process's own CUDA_VISIBLE_DEVICES, so the
    # workers' numbering must too, whatever mapping the other settings came from (a script passing a dict once
    # put a worker on GPU 0 of the host while the server had been given GPU 1).
    values["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    values.update(overrides)
    return Settings(**values)


# Read by the deployment files or the libraries, not by a setting of ours: a .env may name them
OTHER_NAMES = ("GPU_COUNT", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
               "MODEL_CACHE_DIR", "HF_HOME", "HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE",
               "HF_HUB_ENABLE_HF_TRANSFER", "GRADIO_TEMP_DIR", "GRADIO_ROOT_PATH")


def load_env_file(path: str | os.PathLike) -> None:
    """`.env` into the environment (what the environment sets wins), by python-dotenv, strictly: a line it
    cannot parse (an unclosed quote on GRADIO_AUTH's line started a server with no login: python-dotenv only
    logs it), a NUL byte, or a name one typo away from a setting's (QUEUE_MAX_SIZ=4) stops start-up with a
    SettingsError naming the line. Values are never shown: the line may hold a key."""
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as stream:
            bindings = list(parse_stream(stream))
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"Bad configuration:\n  {path} cannot be read: {exc}") from None
    known = [var.name for var in REGISTRY] + list(OTHER_NAMES)
    problems, line = [], 1
    for binding in bindings:
        start, line = line, line + binding.original.string.count("\n")
        name = binding.key or binding.original.string.split("=", 1)[0].strip()[:40]
        if binding.error:
            problems.append(f"{path} line {start} ({name}=...) cannot be parsed (an unclosed quote?)")
        elif binding.key is not None and "\0" in binding.original.string:
            problems.append(f"{path} line {start} ({name}=...) holds a NUL byte")
        elif binding.key is not None and binding.key not in known:
            close = difflib.get_close_matches(binding.key, known, n=1, cutoff=0.85)
            if close:
                problems.append(f"{path} line {start}: {binding.key} is not a setting; "
                                f"did you mean {close[0]}?")
    if problems:
        raise SettingsError("Bad configuration:\n  " + "\n  ".join(problems))
    load_dotenv(path)


def public_model_name(model: str) -> str:
    """A hub id as it is; a local checkpoint by its folder's name, not its path."""
    return os.path.basename(model.rstrip("/")) if model.startswith(("/", "~", ".")) else model


def writable_folder(name: str, path: str) -> Path:
    """The folder a setting names, created if need be; a SettingsError naming the variable when it cannot be
    created or written (checked at start-up, not found by the first job after the workers loaded)."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".imgedit-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SettingsError(f"Bad configuration:\n  {name}={path!r} cannot be used as a folder: "
                            f"{'it is a file' if folder.is_file() else exc.strerror or type(exc).__name__}; "
                            "choose a folder this user can write") from exc
    return folder
