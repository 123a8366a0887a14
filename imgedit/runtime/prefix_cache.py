"""Qwen-Image-2.1's prefix KV cache (QwenImage21Pipeline's `use_kv_cache`) on a GPU with little room.

With `causal_condition`, the text and the condition images (the prefix) are step-independent, so the pipeline
keeps their keys and values of every block after the first step and later steps run the target image alone.
That cache lives on the GPU for the whole job: per prefix token, 2 (keys, values) x inner dim x 2 bytes in
each of the 32 blocks, 512 KiB a token. A condition image at the output's area (1024²) is 4,096 latent tokens
plus its 1,024 vision tokens in the text, so 3 references hold ~7.7 GiB and 10 ~25 GiB, twice that with true
CFG or two images. On the GPU machine's 16 GB plan (14.5 GiB cap: 6.1 GiB of resident weights) every edit with
a reference came back out of memory; an H200 alone ran them all.

A worker whose GPU has a cap (MAX_MEMORY) asks, per job, where the cache fits:

- **on the GPU** (the pipeline's default) where the cap leaves room for it after the weights and
  ACTIVATION_RESERVE;
- **in pinned CPU memory** (`host`) where it does not but the cap holds IN_FLIGHT blocks' worth and the CPU
  has room (less HOST_RESERVE): the first step writes each block's keys and values to the CPU, and in a later
  step each block's come back to the GPU one block ahead on a copy stream, beside the compute and the streamed
  weights. On the 16 GB plan a five-reference edit ran its later steps at 1.3 s each without the cache
  (every step ran the ~25,600 prefix tokens through the streamed blocks again; 2026-11-29, 2× H200 host):
  the CPU cache moves their ~12.5 GiB a step over PCIe instead, beside ~8 GiB of streamed weights: 0.358 s a
  later step through the app (23.55 s a request against 55.37 s; ten references 0.553 s, at `66d409a`);
- **nowhere** otherwise: every step runs the prefix again (slower, the same result up to rounding, as the
  pipeline's docstring says).

The worker logs its choice for each job that does not keep the default. Uncapped workers keep the pipeline's
default. The CPU cache is written here (diffusers 0.42.1 keeps its prefix cache on the device it computed
it on, and has no offloaded cache for this pipeline): a diffusers ModelHook on the transformer hands each
forward, in place of the pipeline's QwenImage21KVCache, one with the same `get_layer(i).store/get` that the
attention processors call (diffusers' and imgedit.model.attention21's alike). Compiled workers keep the
choice of GPU or nowhere: a compiled block would trace the copies. The CPU memory is a plain allocation
page-locked with cudaHostRegister (torch.cuda.cudart()), exactly its size and unlocked when it is replaced:
torch's pinned allocator rounds each block up to a power of two and keeps freed blocks locked.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch
from diffusers.hooks import HookRegistry, ModelHook

from imgedit.planning.memory import HOST_RESERVE, available_host_memory
from imgedit.runtime import pinned
from imgedit.runtime.pinned import ALIGN

log = logging.getLogger(__name__)

VAE_FACTOR = 16  # Qwen-Image-2.1's VAE: 16x, patch size 1
VISION_FACTOR = 32  # Qwen3-VL: 16-pixel patches, 2x2 merged
TEXT_TOKENS = 512  # the prompt and the chat template, an upper estimate
HOOK = "imgedit_prefix_on_host"
# blocks' keys and values on the GPU at once in a later step: in use, the previous (freed once the compute
# stream passes it), fetched ahead, joined with the target's
IN_FLIGHT = 4


def prefix_tokens(images: int, side: int) -> int:
    """Estimated prefix tokens: every condition image at side x side (the pipeline's output_resolution),
    in the latent sequence and in the text encoder's, and the prompt."""
    per_image = (side // VAE_FACTOR) ** 2 + (side // VISION_FACTOR) ** 2
    return images * per_image + TEXT_TOKENS


def cache_bytes(config, tokens: int, item: int = 2) -> int:
    """What the cache of `tokens` prefix tokens holds: keys and values of every block."""
    inner = config.num_attention_heads * config.attention_head_dim
    return config.num_layers * 2 * inner * tokens * item


class PrefixCache:
    """Decides where a job's prefix cache lives. `room()` gives the bytes a job may still take on the GPU
    (None: uncapped, the pipeline's default); the worker passes its cap minus its weights and
    ACTIVATION_RESERVE. `transformers`: those to hook for the CPU cache (none: it is never chosen);
    `compiled()`: whether they run compiled now (then it is not chosen); `host_room()`: the CPU memory
    available (default: MemAvailable)."""

    def __init__(self, transformer, room, transformers=(), compiled=lambda: False,
                 host_room=available_host_memory):
        self.config = transformer.config
        self.room, self.host_room, self.compiled = room, host_room, compiled
        self.pool = PinnedPool()
        self.streams: dict = {}  # one copy stream per GPU, kept: its memory blocks are reused job after job
        self.hooks = [_install(t) for t in transformers]
        self.need = 0  # the last job's estimate, bytes
        self.misses = 0  # blocks read before their copy was started ahead (one a job: the first)

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): the cache on the GPU, in CPU memory, or off."""
        copies = call.job.params.num_images * (2 if call.cfg_on else 1)
        where, kwargs = self.place(len(call.job.request.images), call.kwargs["output_resolution"], copies)
        call.kwargs.update(kwargs)
        if where != "host":
            yield
            return
        self.pool.reserve(self.need)
        # a resumed job's steps: those left (imgedit.runtime.pause)
        prefix = HostPrefix(self.pool, self.streams, call.job.params.steps - call.offset)
        for hook in self.hooks:
            hook.prefix = prefix
        try:
            yield
        finally:
            for hook in self.hooks:
                hook.prefix = None
            prefix.close()
            self.misses += prefix.misses

    def place(self, images: int, side: int, copies: int = 1) -> tuple[str, dict]:
        """("gpu" | "host" | "off", the pipeline arguments) for a job of `images` condition images at
        side x side whose prefix runs `copies` times a forward (true CFG's two branches, each output
        image)."""
        room = self.room()
        if room is None:
            return "gpu", {}
        need = self.need = copies * cache_bytes(self.config, prefix_tokens(images, side))
        if need <= room:
            return "gpu", {}
        what = f"{images} condition image(s) at {side}x{side} need ~{need / 1024**3:.1f} GiB"
        left = f"{max(room, 0) / 1024**3:.1f} GiB left under the cap"
        why_not = self._why_not_host(need, room)
        if why_not is None:
            log.info("prefix KV cache in CPU memory for this job: %s, %s; each block's comes back to the GPU "
                     "one block ahead", what, left)
            return "host", {}
        log.info("prefix KV cache off for this job: %s, %s; not in CPU memory: %s", what, left, why_not)
        return "off", {"use_kv_cache": False}

    def _why_not_host(self, need: int, room: int) -> str | None:
        """Why a job's cache of `need` bytes cannot live in CPU memory (None: it can)."""
        if not self.hooks:
            return "not set up on this worker"
        if self.compiled():
            return "a compiled worker keeps no cache in CPU memory"
        in_flight = IN_FLIGHT * need // self.config.num_layers
        if in_flight > room:
            return f"its {IN_FLIGHT} blocks in flight need {in_flight / 1024**3:.1f} GiB on the GPU"
        if need <= self.pool.size:  # the buffer held from an earlier job fits it: no more CPU memory needed
            return None
        host = self.host_room()
        # the pool's buffer is unlocked and freed before a larger one is made
        if host is None or need > host + self.pool.size - HOST_RESERVE:
            free = "unknown" if host is None else f"{host / 1024**3:.1f} GiB"
            return (f"CPU memory available {free}, of which {HOST_RESERVE / 1024**3:.0f} GiB is kept for the "
                    f"processes (set aside now: {self.pool.size / 1024**3:.1f} GiB)")
        return None


class PinnedPool:
    """One page-locked CPU buffer that jobs' caches take slices of, kept for the worker's life (locking GiBs
    takes seconds) and grown to the largest job's need."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.locked = False
        self.used = 0
        self.wanted = 0

    @property
    def size(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised CPU tensor of `like`'s shape and dtype: from the buffer while it lasts, then one
        of its own in pageable memory (its copies wait for the CPU; the next `reserve` grows the buffer)."""
        size = like.numel() * like.element_size()
        start = -(-self.used // ALIGN) * ALIGN
        self.used = start + size
        self.wanted = max(self.wanted, self.used)
        if self.buffer is None or self.used > self.size:
            return torch.empty(like.shape, dtype=like.dtype)
        return self.buffer[start:start + size].view(like.dtype).view(like.shape)

    def reserve(self, size: int) -> None:
        """Before a job: a buffer of at least `size` bytes (and of the largest need seen), every slice
        free."""
        size = max(size, self.wanted)
        self.used = 0
        if size <= self.size:
            return
        self.release()
        started = time.perf_counter()
        self.buffer = torch.empty(size, dtype=torch.uint8)
        self.locked = pinned.lock(self.buffer)
        if torch.cuda.is_available() and not self.locked:
            log.warning("the prefix cache's copies wait for the CPU (its memory is not page-locked)")
        log.info("prefix cache: %.1f GiB of CPU memory %s in %.1fs (kept for the next jobs)", size / 1024**3,
                 "locked" if self.locked else "taken", time.perf_counter() - started)

    def release(self) -> None:
        if self.locked:
            pinned.unlock(self.buffer)
        self.buffer, self.locked = None, False


class HostPrefix:
    """One job's prefix keys and values in CPU memory: every block's, of every cache the pipeline passes (true
    CFG's second branch has its own), in the order the first step wrote them, which is the order later steps
    read them in. Reading one starts the copy of the next to the GPU."""

    def __init__(self, pool: PinnedPool, streams: dict, steps: int):
        self.pool, self.streams = pool, streams
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []  # on the CPU, in the order written
        self.position: dict[tuple[int, int], int] = {}  # (the pipeline's cache, block) -> index in layers
        self.ahead: dict[int, tuple] = {}  # index -> (keys, values, event): on their way to the GPU
        self.device: torch.device | None = None
        self.stream = None
        self.cached_steps = steps - 1  # the steps that read the cache (the first writes it)
        self.misses = 0

    def cache(self, kv_cache) -> _HostCache:
        return _HostCache(self, id(kv_cache))

    def store(self, key: tuple[int, int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.device = k.device
        host_k, host_v = self.pool.take(k), self.pool.take(v)
        if k.device.type == "cuda":
            stream = self._stream()
            stream.wait_stream(torch.cuda.current_stream(k.device))  # k and v are written
            with torch.cuda.stream(stream):
                host_k.copy_(k, non_blocking=True)
                host_v.copy_(v, non_blocking=True)
            k.record_stream(stream)  # their memory is not reused before the copies are done
            v.record_stream(stream)
        else:
            host_k.copy_(k)
            host_v.copy_(v)
        self.position[key] = len(self.layers)
        self.layers.append((host_k, host_v))

    def get(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.position[key]
        if index not in self.ahead:
            self.misses += 1
        k, v, event = self.ahead.pop(index, None) or self._fetch(index)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            k.record_stream(current)  # used here: not reused by the copy stream before this stream is done
            v.record_stream(current)
        following = (index + 1) % len(self.layers)
        if following == 0:  # a step's last block: the next step's first, unless this was the last step
            self.cached_steps -= 1
            if self.cached_steps <= 0:
                return k, v
        if following != index and following not in self.ahead:
            self.ahead[following] = self._fetch(following)
        return k, v

    def _fetch(self, index: int) -> tuple:
        host_k, host_v = self.layers[index]
        if self.device is None or self.device.type != "cuda":
            return host_k, host_v, None
        with torch.cuda.stream(self._stream()):
            k = host_k.to(self.device, non_blocking=True)
            v = host_v.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return k, v, event

    def _stream(self):
        """The worker's copy stream on this GPU: of high priority, a pool apart from the default-priority
        streams diffusers' group offloading takes its own from."""
        if self.stream is None:
            if self.device not in self.streams:
                self.streams[self.device] = torch.cuda.Stream(self.device, priority=-1)
            self.stream = self.streams[self.device]
        return self.stream

    def close(self) -> None:
        """The job is over: its tensors go, the pool's slices are free for the next job."""
        if self.stream is not None:
            self.stream.synchronize()  # no copy still reads or writes the pool (the next job reuses it)
        self.layers.clear()
        self.ahead.clear()


class _HostCache:
    """What the transformer gets in place of the pipeline's QwenImage21KVCache: `get_layer(i)`."""

    def __init__(self, prefix: HostPrefix, owner: int):
        self.prefix, self.owner = prefix, owner

    def get_layer(self, index: int) -> _HostLayer:
        return _HostLayer(self.prefix, (self.owner, index))


class _HostLayer:
    """A block's cache, as the attention processors call it (QwenImage21KVLayerCache's store/get)."""

    def __init__(self, prefix: HostPrefix, key: tuple[int, int]):
        self.prefix, self.key = prefix, key

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.prefix.store(self.key, k, v)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prefix.get(self.key)


class _OnHost(ModelHook):
    """On the transformer: while a job keeps its prefix in CPU memory, each forward's `kv_cache` is that
    job's (the pipeline makes one cache per branch, so each maps to its own)."""

    def __init__(self):
        super().__init__()
        self.prefix: HostPrefix | None = None

    def pre_forward(self, module, *args, **kwargs):
        if self.prefix is not None and kwargs.get("kv_cache") is not None:
            kwargs["kv_cache"] = self.prefix.cache(kwargs["kv_cache"])
        return args, kwargs


def _install(transformer: torch.nn.Module) -> _OnHost:
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    hook = registry.get_hook(HOOK)
    if hook is None:
        hook = _OnHost()
        registry.register_hook(hook, HOOK)
    return hook
