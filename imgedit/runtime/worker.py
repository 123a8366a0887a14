"""A worker process (one rank): load the pipeline onto its GPUs, warm it up, then serve jobs.

Started by imgedit.engine.pool with the spawn method and CUDA_VISIBLE_DEVICES holding only this rank's
GPUs. A reader thread takes messages off the inbox (jobs to a local queue, cancels to flags) so a
cancel reaches a running job at its next step. The process exits on Stop, on a fatal error (the
pool restarts it) and when its parent, the server, is gone (no orphans even after a SIGKILL).

torch, and every module of ours that imports it, is imported inside the functions below, not at the top:
this module is the first the child process imports, and main() sets CUDA_VISIBLE_DEVICES and the compile
cache and quiets the libraries' known import-time noise (imgedit.model.KNOWN_NOISE) before any of them loads.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import asdict

from imgedit.errors import Cancelled, ImgEditError
from imgedit.model import quiet_known_noise
from imgedit.planning.placement import allocator_budget
from imgedit.runtime.decode_room import DecodeRoom
from imgedit.runtime.messages import (
    Cancel,
    Channel,
    Done,
    Failed,
    Job,
    LoadFailed,
    Loading,
    Ready,
    StartupReport,
    Step,
    Stop,
    WorkerSpec,
)
from imgedit.runtime.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


def main(spec: WorkerSpec, inbox, outbox, visible_devices: str | None, cache_dir: str | None,
         log_level: str = "INFO") -> None:
    prepare_process(visible_devices, cache_dir, capped=bool(spec.memory_caps))
    inbox, outbox = Channel(inbox), Channel(outbox)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s {spec.name}.{spec.rank}: %(message)s")
    if log_level != "DEBUG":
        quiet_known_noise()  # imgedit.model.KNOWN_NOISE
        from transformers.utils import logging as transformers_logging  # quieted first (docstring)

        transformers_logging.disable_progress_bar()  # "Loading weights: 100%" bars in the server's log
    _watch_parent(os.getppid())
    started = time.perf_counter()

    def say(doing: str) -> None:  # what /health and the page show while this rank loads
        outbox.put(Loading(spec.rank, doing, round(time.perf_counter() - started, 1)))

    try:
        runner, report, seconds = _load(spec, say)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        log.error("loading failed:\n%s", traceback.format_exc())
        # Only our own words leave the process (the panel and /health show them): details are in the log
        # above.
        message = (exc.message if isinstance(exc, ImgEditError)
                   else f"{type(exc).__name__} (see the server log)")
        outbox.put(LoadFailed(spec.rank, message))
        return
    outbox.put(Ready(spec.rank, os.getpid(), seconds, report))
    _serve(spec, runner, inbox, outbox)
    if spec.world > 1:  # a clean stop: every rank got Stop and left its last collective
        from imgedit.runtime.group import close_group  # imports torch: after main() (docstring)

        close_group()


def prepare_process(visible_devices: str | None, cache_dir: str | None, capped: bool = False) -> None:
    """The environment torch reads when it is imported (after this). Dynamo's automatic-dynamic profile
    (local PGO, kept beside inductor's cache) is off: our blocks compile dynamic from the first size
    already, and with the profile a restart compiled other variants than the first start (14 vs 10) and
    missed inductor's cache: the fp8 pair's restart took 163 s, and 89.3 s with it off (2x H200,
    docs/BENCHMARKS.md).

    `capped` (MAX_MEMORY): the allocator grows its segments in place (expandable_segments) instead of
    keeping fixed-size ones, so memory freed in one size serves another under the cap. Under a 16 GB cap,
    2.1's 10-reference edit failed with 1.97 GiB reserved but unused (fixed segments); with expandable ones,
    0.28 GiB (2x H200; that edit still needs more than the cap). An allocator setting made for the server
    (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF, which torch reads first) is kept, as the profile's is."""
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    if cache_dir:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser(cache_dir))
    os.environ.setdefault("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO", "0")
    if capped and not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def _watch_parent(parent: int) -> None:
    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _load(spec: WorkerSpec, say=lambda doing: None):
    # torch and the modules that import it: after main()'s set-up of the process (module docstring)
    import torch

    from imgedit.model.encoding import prepare_text_encoder  # imports torch: after main() (docstring)
    from imgedit.runtime import loader  # diffusers, torchao: after main() (docstring)
    from imgedit.runtime.runner import Runner  # diffusers: after main() (docstring)

    started = time.perf_counter()
    torch.set_grad_enabled(False)
    plan = spec.plan
    cuda = plan.execution_device.startswith("cuda")
    if cuda and spec.cpu_threads:  # WORKER_THREADS: a GPU worker's CPU prepares, it does not compute
        torch.set_num_threads(spec.cpu_threads)
    group = None
    if spec.world > 1:
        from imgedit.runtime.group import init_group  # imports torch: after main() (docstring)

        group = init_group(spec.rank, spec.world, spec.master_port, cuda)
    from imgedit.runtime import offload  # torchao, diffusers: after main() (docstring)

    offload.check_device(plan.memory, plan.execution_device, spec.fast_quantize)
    # A random-weight benchmark checkpoint is built in bf16 on the GPU before it is quantized or
    # offloaded: cap the allocator once loading is done (the cap still holds for every job).
    late_cap = plan.memory is not None and spec.checkpoint.random_weights
    if cuda and spec.memory_caps and not late_cap:
        _cap_memory(spec.memory_caps)
    dtype = loader.DTYPES[spec.dtype]
    if not cuda and dtype != torch.float32:
        log.info("runs on the CPU: using float32 instead of %s", spec.dtype)  # bf16 convs are emulated, slow
        dtype = torch.float32
    say("loading the weights")
    pipe = loader.load_pipeline(spec.checkpoint, plan, dtype)
    prepare_text_encoder(pipe.text_encoder)  # token types, no logits, the vision tower's windows in one call
    from imgedit.runtime import encode_cache, pixels, warmup  # import torch: after main() (docstring)
    from imgedit.runtime.adapters import Adapters  # peft, diffusers: after main() (docstring)

    encode_cache.install(pipe, spec.encode_cache)  # a repeated input is not encoded again (exact)
    # pictures cross to and from the VAE's GPU as bytes, the arithmetic there (exact)
    on_gpu = pixels.install(pipe)

    # every rank loads the same LoRAs, all disabled; FUSE_LORA copies the weights they adapt (counted as
    # weights)
    # FUSE_LORA: the ranks of a group fuse all or none (a vote over the CPU group: any "no" wins)
    agree = None
    if spec.world > 1:
        from imgedit.runtime.group import agree_to_stop  # imports torch: after main() (docstring)

        def agree(ok: bool) -> bool:
            return not agree_to_stop(not ok, group)
    # FAST_QUANTIZE's copies where fast jobs run: every rank of a pair that splits them, else rank 0 alone
    fast_mode = spec.fast_quantize if spec.rank == 0 or spec.pair_ulysses else "none"
    if spec.loras or fast_mode != "none":
        say(f"loading {len(spec.loras)} LoRA(s)" + (f", building the {fast_mode} fast-mode copies"
                                                   if fast_mode != "none" else ""))
    # streamed components: their hooks off while the LoRAs load, then on again (offload.lifted)
    devices = {name: placement.device for name, placement in plan.components.items()}
    with offload.lifted(pipe, plan.memory if spec.loras else None, devices):
        adapters = Adapters(pipe, spec.loras, spec.fuse_lora, spec.activation_reserve,
                            spec.memory_caps if cuda else (), agree,
                            fast_mode, spec.fast_steps, fast_agree=agree if spec.pair_ulysses else None)
    fast = adapters.copies  # FAST_QUANTIZE's copies of the transformer
    weights = _weights_per_gpu() if cuda else {}  # the LoRAs' weights included
    runner = Runner(pipe, spec.name, spec.devices or plan.devices, spec.rank, spec.world, spec.parallel,
                    group, spec.auto_cleanup, spec.ulysses, cuda, adapters,
                    batch_cfg=plan.memory is not None and plan.memory.batch_cfg,
                    pair_ulysses=spec.pair_ulysses)
    if cuda and spec.memory_caps and late_cap:
        torch.cuda.empty_cache()
        _cap_memory(spec.memory_caps)
    under_cap = []  # what a job may take under MAX_MEMORY, decided per job
    if cuda and spec.memory_caps:
        from imgedit.runtime.fusion import gpu_room  # imports torch: after main() (docstring)

        caps, vae = spec.memory_caps, torch.device(plan.components["vae"].device)  # where the decode runs
        if vae.type == "cuda":
            runner.decode_room = DecodeRoom(pipe.vae, lambda: gpu_room(vae.index or 0, caps))
            under_cap.append("VAE decode in tiles for a job whose whole decode would not fit")
        if "use_kv_cache" in inspect.signature(pipe.__call__).parameters:
            index, reserve = torch.device(runner.devices[0]).index or 0, spec.activation_reserve
            runner.prefix_cache = PrefixCache(pipe.transformer, lambda: gpu_room(index, caps) - reserve)
            under_cap.append("prefix cache off for a job it would not fit")
    pair_split = runner.group is not None and runner.group.splits_cfg_off
    report = StartupReport(
        batch_cfg=runner.cfg_batch is not None, pair_ulysses=pair_split,
        load_seconds=round(time.perf_counter() - started, 2), loras=[f.name for f in spec.loras],
        components=offload.describe(pipe, plan.memory),
        fuse_lora=adapters.fusion.describe() if adapters.fusion is not None else "off",
        fast_weights=adapters.fast.describe() if adapters.fast is not None else "none",
        weights_mib=weights, encode_cache=spec.encode_cache, cpu_threads=torch.get_num_threads(),
        pixels=str(on_gpu.device) if on_gpu is not None else "cpu", fallbacks=list(adapters.fallbacks),
        under_cap=under_cap)
    if spec.hook:
        module, _, function = spec.hook.partition(":")
        getattr(importlib.import_module(module), function)(pipe, spec)
    if spec.attention != "native":
        for transformer in (pipe.transformer, *fast):
            offload.use_attention(transformer, spec.attention)
    report.attention = offload.attention_in_use(pipe.transformer)  # as the processors have it
    if spec.compile:
        warmup.compile_and_warm_up(spec, runner, (pipe.transformer, *fast), report, agree, say)
    # rewrites refused (planning.modes)
    streamed = plan.memory is not None and plan.memory.offload_text_encoder
    if cuda and spec.rank == 0 and not streamed:  # the rank that writes a group's rewrites
        say("warming up prompt rewriting")
        report.rewrite_warmup_seconds = warmup.warm_up_rewrite(pipe, report.fallbacks, spec.compile)
    # What loading, the LoRAs and the warm-ups left in reference cycles goes now, not at the first job's OOM:
    # on 2x H200 the first edit of a capped worker (the 31 GiB split, 2.1 at 14.5 GiB) came back 507 and the
    # same request succeeded once the OOM's cleanup (this one) had run.
    runner.cleanup(force=True)
    if cuda:
        report.memory_allocated_gib = round(torch.cuda.memory_allocated() / 1024**3, 2)
        report.memory_reserved_gib = round(torch.cuda.memory_reserved() / 1024**3, 2)
    log.info("loaded on %s in %.1fs (%s)",
             ",".join(plan.devices), time.perf_counter() - started, asdict(report))
    return runner, report, time.perf_counter() - started


def _weights_per_gpu() -> dict[str, float]:
    """MiB torch holds on each of this rank's GPUs right after loading, before any job or warm-up: the
    weights (the GPU panel's "our weights"; keyed cuda:0.. as this process numbers its GPUs)."""
    import torch  # after main()'s set-up (docstring)

    return {f"cuda:{i}": round(torch.cuda.memory_allocated(i) / 1024**2, 1)
            for i in range(torch.cuda.device_count())}


def _cap_memory(caps: tuple[int, ...]) -> None:
    """MAX_MEMORY is a promise about what nvidia-smi shows: let torch's allocator use at most the cap
    minus the CUDA context and the kernels loaded as jobs run (it frees its cache and retries before it
    gives up with out-of-memory)."""
    import torch  # after main()'s set-up (docstring)

    # what torch's allocator was started with (prepare_process); torch reads PYTORCH_ALLOC_CONF first
    settings = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
    for index, cap in enumerate(caps):
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, max(0.01, allocator_budget(cap) / total))
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        log.info("cuda:%d: allocator capped at %.1f GiB (MAX_MEMORY; allocator settings: %s)", index,
                 fraction * total / 1024**3, settings)


def _serve(spec: WorkerSpec, runner, inbox, outbox) -> None:
    from imgedit.runtime.runner import FatalError  # imports torch: after main() (docstring)

    jobs: queue.Queue = queue.Queue()
    cancelled: set[str] = set()
    current: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def read():
        while True:
            try:
                message = inbox.get()
            except (EOFError, OSError):
                message = Stop()
            if isinstance(message, Cancel):
                with lock:
                    if len(cancelled) > 1000:  # cancels of jobs this rank skipped
                        cancelled.clear()
                    cancelled.add(message.request_id)
                    if message.request_id in current:
                        current[message.request_id].set()
                continue
            jobs.put(message)
            if isinstance(message, Stop):
                return

    threading.Thread(target=read, name="inbox", daemon=True).start()
    while True:
        message = jobs.get()
        if isinstance(message, Stop):
            log.info("stopping")
            return
        if not isinstance(message, Job):
            continue
        job: Job = message
        if not runner.takes_part(job):
            with lock:
                cancelled.discard(job.request_id)
            continue
        cancel = threading.Event()
        with lock:
            current[job.request_id] = cancel
            if job.request_id in cancelled:
                cancel.set()

        def on_step(step: int, total: int, request_id: str = job.request_id) -> None:
            if spec.rank == 0:
                outbox.put(Step(request_id, step, total))

        try:
            result = runner.run(job, cancel, on_step)
            if spec.rank == 0:
                outbox.put(Done(job.request_id, result))
        except FatalError as exc:
            outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank, fatal=True))
            os._exit(1)
        except Cancelled as exc:
            if spec.rank == 0:
                outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank))
        except ImgEditError as exc:
            if spec.rank == 0:
                outbox.put(Failed(job.request_id, exc.kind, exc.message, spec.rank))
        except BaseException:  # noqa: BLE001 - a bug of ours: report it, and start afresh
            log.exception("%s: unexpected failure", job.request_id)
            outbox.put(Failed(job.request_id, "internal",
                              f"the edit failed with an internal error (request {job.request_id})",
                              spec.rank, fatal=True))
            os._exit(1)
        finally:
            with lock:
                current.pop(job.request_id, None)
                cancelled.discard(job.request_id)
        runner.cleanup()
