"""Page-locked ("pinned") CPU memory at its exact size: one buffer locked with cudaHostRegister and sliced
into tensors, for the weights a capped plan streams (imgedit.runtime.offload) and 2.1's prefix cache in CPU
memory (imgedit.runtime.prefix_cache).

Why not `Tensor.pin_memory()`, which diffusers' group offloading calls once per weight: torch's pinned
allocator rounds each block up to a power of two (a 1.2 GiB embedding takes 2 GiB of locked memory) and
keeps freed blocks locked, and it locks one tensor at a time: setting up the streaming (the copies to CPU
memory and their pinning) took 13.0 s for 2.1's 7.8 GiB of streamed blocks and 26.4 s for its 16.3 GiB text
encoder at the 16 GB plan's start (2× H200 host, 2026-11-29). One registration of
the whole (CUDA's own call, through torch.cuda.cudart()) locks 12.8 GiB in 5.4 s on the same host, and locks
exactly what is asked. The copies' tensors report `is_pinned()` (CUDA sees registered memory as host memory),
so copies from them to a GPU run asynchronously like any pinned tensor's.

Written here, not taken from a library: neither torch nor diffusers offers a registered buffer to slice
(torch.distributed registers its checkpoint staging buffers the same way, and SGLang its host caches).
Measured by benchmarks/probe_pinning.py on 2.1's text encoder (16.33 GiB, 750 tensors; 2× H200,
2026-11-29): `pin_memory()` per tensor 16.7 s and 5.9 GiB of host memory beyond the weights, this buffer
11.2 s and 0.2 GiB.
Since 2026-11-30 the copies come before the lock (the pages present, locked in one call) and weights on a GPU
reach the buffer by DMA (copy_into_one): 2509's 27 GiB of streamed blocks in 3.7 s from the GPU, against
29.9 s through pageable memory first, the way diffusers' group offloading copies a GPU weight (1× H200 host).
torch's allocator options are the alternative where the installed torch has them (2.11 lacks
`pinned_max_round_threshold_mb`, without which each block is still rounded up).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

ALIGN = 512  # bytes: each tensor's start in a buffer
# the weights' buffers: locked for the process's life (views of them are the weights)
_KEPT: list[torch.Tensor] = []


PORTABLE = 1  # cudaHostRegisterPortable: pinned for every GPU's context (a balanced worker streams to two)


def lock(buffer: torch.Tensor) -> bool:
    """Page-lock a contiguous CPU tensor's memory, as torch.distributed's checkpoint staging does
    (torch.cuda._pin_memory_utils). False: no CUDA, or CUDA refused (the caller says what it does instead)."""
    if not torch.cuda.is_available():
        return False
    size = buffer.numel() * buffer.element_size()
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, PORTABLE))
    if error:
        _clear_cuda_error()
        log.warning("could not lock %.1f GiB of CPU memory in one piece (cudaError %d)", size / 1024**3,
                    error)
    return error == 0


def _clear_cuda_error() -> None:
    """A failed CUDA runtime call stays the thread's last error, which torch's next kernel-launch check
    (cudaGetLastError) would report as that kernel's failure; torch's binding of cudaHostRegister leaves it
    set (C10_CUDA_ERROR_HANDLED is the bare call). Read and so clear it through the runtime library torch
    loaded (found by its soname)."""
    import ctypes  # only on this failure path

    name = f"libcudart.so.{(torch.version.cuda or '').split('.')[0]}"
    try:
        ctypes.CDLL(name).cudaGetLastError()
    except (OSError, AttributeError) as exc:
        log.warning("could not clear CUDA's last error through %s (%s): the next kernel may report the "
                    "failed lock", name, exc)


def unlock(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's start in one buffer (ALIGN-aligned) and the buffer's size, bytes."""
    starts, end = [], 0
    for tensor in tensors:
        start = -(-end // ALIGN) * ALIGN
        starts.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return starts, end


def copy_into_one(tensors: list[torch.Tensor], place) -> None:
    """Copy `tensors` (on the CPU or a GPU; same shapes, dtypes and values) into one page-locked CPU buffer,
    kept for the process's life, calling `place(i, copy)` after each copy and dropping `tensors[i]` (the
    caller lets go of its own there: the CPU never holds much more than one copy of the whole). Without CUDA
    nothing is copied.

    The order is the fast one measured (benchmarks/probe_pinning.py, 27 GiB of 2509's transformer on an H200
    host, 2026-11-30): the CPU tensors are copied first and the GPU tensors' places filled with zeros, both on
    the worker's copy threads (`set_copy_threads`), so every page is present when CUDA locks the buffer in one
    call; then the GPU tensors are copied in by DMA. Locking first made CUDA fault each page in on one thread:
    10.6 s against 3.8 s.

    Where CUDA refuses the lock, each copy is pinned on its own instead (`pin_memory()`, as diffusers does):
    `place(i, ...)` is then called a second time for a CPU tensor, with its pinned copy, and the CPU holds the
    buffer and the pinned copies together until the last one is made (about twice the weights)."""
    if not tensors or not torch.cuda.is_available():
        return
    starts, size = offsets(tensors)
    buffer = torch.empty(size, dtype=torch.uint8)
    copies = [buffer[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
              for t, start in zip(tensors, starts, strict=True)]
    on_gpu = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    _fill(tensors, copies, place)
    if lock(buffer):
        _KEPT.append(buffer)
    else:
        log.warning("could not lock the buffer: pinning %d tensors one by one instead", len(tensors))
        del buffer  # freed with the last of its slices, in _pinned_one_by_one
        copies = _pinned_one_by_one(tensors, copies, place)
    for i in on_gpu:
        _put(tensors, i, copies[i], place)


def _fill(tensors: list[torch.Tensor], copies: list[torch.Tensor], place) -> None:
    """Before the lock, on the copy threads: each CPU tensor copied into its place and placed, each GPU
    tensor's place filled with zeros (its pages made present)."""
    with copy_threads():
        for i, copy in enumerate(copies):
            if tensors[i].device.type != "cpu":
                copy.zero_()
            else:
                _put(tensors, i, copy, place)


def _pinned_one_by_one(tensors: list[torch.Tensor | None], copies: list, place) -> list:
    """The refused lock's fallback: each CPU tensor's copy (a slice of the unlocked buffer, placed already)
    placed again, pinned on its own, and every slice let go; then a pinned place of its own for each GPU
    tensor (None for the others)."""
    for i in range(len(copies)):
        if tensors[i] is None:  # a CPU tensor, copied and placed by _fill
            place(i, copies[i].pin_memory())
        copies[i] = None
    return [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t is not None else None
            for t in tensors]


def _put(tensors: list[torch.Tensor], i: int, copy: torch.Tensor, place) -> None:
    copy.copy_(tensors[i])
    tensors[i] = None
    place(i, copy)


_copy_threads = 0  # set_copy_threads


def set_copy_threads(threads: int) -> None:
    """torch's CPU threads while copy_into_one fills GiBs of fresh pages (the worker's share of the machine's
    CPUs, planning.modes.copy_threads; 0: its threads as they are). A GPU worker keeps a few threads for its
    jobs (WORKER_THREADS)."""
    global _copy_threads
    _copy_threads = threads


@contextmanager
def copy_threads():
    """torch's threads raised to `set_copy_threads`'s count for the copies, and back after them."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, _copy_threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)
