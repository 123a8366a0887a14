"""A resident text encoder's decoding steps (prompt rewrites, mask_prompt outlines) replayed as CUDA graphs of
the eager step, with no compile.

Why: eager, one decoding step of the 8B encoders is ~6 ms of GPU work under ~30 ms of kernel launches (~960
kernels a token). transformers' answer is to compile the step (inductor, reduce-overhead): 10-12 ms a token on
an H200, after a 50-60 s compile in every first start (2x H200, 2026-11-29: 59.7 s for Qwen3-VL, 50.0 s for
Qwen2.5-VL). Capturing the eager step's kernels once and replaying them removes the launches without the
compile: what vLLM and SGLang do for their decode.

Why it can: transformers 5.17's StaticCache keeps its write position on the GPU (`cumulative_length`, advanced
in place, zeroed in place by `reset`), and a step's mask comes in at the cache's full length, so every step of
every rewrite has the same shapes and no CPU sync. generate() runs its decoding steps through the model's
`get_compiled_call` when the cache is static (`internals.replace_compiled_call` installs this there instead).

Per layout (which arguments, their shapes; the cache object), the first step runs eagerly on a side stream
(the kernels and cuBLAS's workspace load), the second is captured on that stream and replayed, later ones copy
their tensors into the captured ones and replay. Tensors inside a dict argument (Qwen2.5-VL's mask comes as
`{"full_attention": mask}`) are copied too, by path. Arguments the step does not read once `position_ids` come
in (UNREAD: the token types and picture grids that only make positions) are neither copied nor part of the
layout, so a rewrite with pictures and one without (2.1's text to image) share one graph. A step without
`position_ids` would make them from the model's own state (a tensor replaced at each prefill): it runs
eagerly. A capture that fails leaves its layout eager, said once in the log. At most MAX_GRAPHS layouts are
captured.

One StaticCache is kept per encoder (`cache`), reset before and after each call: the graphs hold its tensors,
so a new cache would capture again; reset after, so nothing of a user's prompt stays on the GPU between calls.
On the CPU (tests) the "capture" keeps the copied inputs and a replay runs the step eagerly on them: the
copying and the layouts are what it checks there."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch
from transformers import StaticCache
from transformers.cache_utils import Cache

from imgedit.model import internals

log = logging.getLogger(__name__)

UNREAD = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw")
MAX_GRAPHS = 8
_SCALARS = (type(None), bool, int, float, str)


class _Uncapturable(Exception):
    """An argument this module does not know how to keep (neither a tensor, a dict of them, a cache nor a
    scalar): its step runs eagerly."""


def _layout(kwargs: dict) -> tuple[tuple, dict[tuple[str, ...], torch.Tensor]]:
    """(the layout's key, the tensors to copy by path) of one step's arguments. Raises _Uncapturable."""
    key, tensors = [], {}

    def visit(path: tuple[str, ...], value) -> None:
        if torch.is_tensor(value):
            key.append((path, tuple(value.shape), value.dtype, value.device))
            tensors[path] = value
        elif isinstance(value, dict):
            key.append((path, "dict", tuple(sorted(value))))
            for name in sorted(value):
                visit((*path, name), value[name])
        elif isinstance(value, Cache):  # the kept cache: the graphs hold its tensors
            key.append((path, "cache", id(value)))
        elif isinstance(value, _SCALARS):
            key.append((path, value))
        else:
            raise _Uncapturable(f"{'.'.join(path)}: {type(value).__name__}")

    for name in sorted(kwargs):
        if name not in UNREAD:
            visit((name,), kwargs[name])
    return tuple(key), tensors


def _with(kwargs: dict, tensors: dict[tuple[str, ...], torch.Tensor]) -> dict:
    """`kwargs` with the tensors at these paths put in their place (dicts rebuilt, the caller's untouched)."""
    out = dict(kwargs)
    for path, tensor in tensors.items():
        holder = out
        for name in path[:-1]:
            holder[name] = dict(holder[name])
            holder = holder[name]
        holder[path[-1]] = tensor
    return out


@dataclass
class _Step:
    """One captured layout: its own input tensors, the graph (None on the CPU) and what the step returned."""

    inputs: dict[tuple[str, ...], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None
    output: object
    model: torch.nn.Module
    kwargs: dict = field(default_factory=dict)  # the CPU's: the arguments a replay runs the step with
    device: torch.device | None = None

    def replay(self, tensors: dict[tuple[str, ...], torch.Tensor]):
        for path, tensor in tensors.items():
            self.inputs[path].copy_(tensor)
        if self.graph is None:  # the CPU: the step eagerly, on the kept inputs
            return self.model(**_with(self.kwargs, self.inputs))
        with torch.cuda.device(self.device):  # on the encoder's GPU's stream (balanced: not the current GPU)
            self.graph.replay()
        return self.output


class DecodeGraphs:
    """generate()'s decoding step for one encoder, as CUDA graphs (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.steps: dict[tuple, _Step] = {}
        self.seen: set[tuple] = set()  # layouts whose first (eager) step ran
        self.eager: set[tuple] = set()  # layouts whose capture failed
        self.failure = ""  # why the last capture failed (the worker's fallbacks say it)
        self.captures = 0
        self.kept: StaticCache | None = None
        self.stream: torch.cuda.Stream | None = None
        self.lock = threading.Lock()

    def cache(self, length: int) -> StaticCache:
        """The encoder's one static cache, of at least `length` tokens, reset. A longer one replaces it (and
        the graphs that hold its tensors)."""
        if self.kept is None or self.kept.max_cache_len < length:
            self.drop()
            self.kept = StaticCache(config=self.model.config, max_cache_len=length)
        self.kept.reset()
        return self.kept

    def drop(self) -> None:
        """Every graph and the kept cache let go (their GPU memory with them)."""
        self.steps.clear()
        self.seen.clear()
        self.eager.clear()
        self.kept = None

    def __call__(self, **kwargs):
        if kwargs.get("position_ids") is None:
            return self.model(**kwargs)
        try:
            key, tensors = _layout(kwargs)
        except _Uncapturable as exc:
            log.debug("a decoding step runs eagerly: %s", exc)
            return self.model(**kwargs)
        with self.lock:
            step = self.steps.get(key)
            if step is not None:
                return step.replay(tensors)
            if key in self.eager or len(self.steps) >= MAX_GRAPHS:
                return self.model(**kwargs)
            if key not in self.seen:
                self.seen.add(key)
                return self._on_side_stream(kwargs)
            try:
                step = self._capture(kwargs, tensors)
            except Exception as exc:  # noqa: BLE001 - an optimisation: the step runs eagerly instead
                self.eager.add(key)
                self.failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("capturing a decoding step as a CUDA graph failed → that layout decodes eagerly: "
                            "%s", self.failure)
                return self.model(**kwargs)
            self.steps[key] = step
            self.captures += 1
            return step.replay(tensors)

    def _on_side_stream(self, kwargs: dict):
        """The step eagerly, on the stream the capture will use (cuBLAS keeps a workspace per stream)."""
        device = kwargs["input_ids"].device if torch.is_tensor(kwargs.get("input_ids")) else None
        if device is None or device.type != "cuda":
            return self.model(**kwargs)
        stream, current = self._side_stream(device), torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            output = self.model(**kwargs)
        current.wait_stream(stream)
        return output

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The one stream the first steps run and the captures are made on, after the work queued so far."""
        self.stream = self.stream or torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        return self.stream

    def _capture(self, kwargs: dict, tensors: dict[tuple[str, ...], torch.Tensor]) -> _Step:
        """This layout's step captured (nothing runs: the caller replays it), with its own copies of the
        inputs."""
        inputs = {path: tensor.clone() for path, tensor in tensors.items()}
        static = _with(kwargs, inputs)
        cuda = any(t.device.type == "cuda" for t in inputs.values())
        if not cuda:
            return _Step(inputs, None, None, self.model, static)
        device = next(t.device for t in inputs.values() if t.device.type == "cuda")
        stream = self._side_stream(device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call during the capture (the server's previews, a second
        # worker's # thread) is not this capture's error
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            output = self.model(**static)
        return _Step(inputs, graph, output, self.model, device=device)


def install(encoder: torch.nn.Module) -> DecodeGraphs:
    """The encoder's decoding steps through DecodeGraphs from now on (the one it has, or a new one)."""
    graphs = getattr(encoder, "_imgedit_decode_graphs", None)
    if graphs is None:
        graphs = DecodeGraphs(encoder)
        encoder._imgedit_decode_graphs = graphs
    internals.replace_compiled_call(encoder, graphs)
    return graphs


def installed(encoder: torch.nn.Module) -> DecodeGraphs | None:
    return getattr(encoder, "_imgedit_decode_graphs", None)


def uninstall(encoder: torch.nn.Module) -> None:
    """Back to generate()'s own decoding (eager with a dynamic cache, where enhance asks for none); the graphs
    and the kept cache let go."""
    graphs = encoder.__dict__.pop("_imgedit_decode_graphs", None)
    if graphs is not None:
        graphs.drop()
    internals.restore_compiled_call(encoder)
