"""Faults and probes injected into a real worker process (PipelineManager(worker_hook="faults:install")).

The hook runs in the worker after its pipeline is loaded. It remembers each call's prompt and, at the
lowest seam (the transformer's forward), acts on markers in it:
  [oom]         raise torch.OutOfMemoryError, as a CUDA allocation would
  [cuda-fault]  raise the RuntimeError a sticky CUDA fault gives
  [bug]         raise an unexpected exception whose text must not reach the user
  [slow]        sleep 0.3 s per forward (time to cancel or kill mid-job)
  [hold:PATH]   each forward waits while the file PATH exists (at most 120 s): the test decides when jobs run
  [rank1-oom]   raise OutOfMemoryError on rank 1 only (one rank of a pair fails)
  [encode-bug]  raise an unexpected exception in the text encoder's forward (prompt encoding fails)
Prompt rewrites (imgedit.runtime.enhance) read markers in the instruction they rewrite, at the text encoder's
output: [rewrite:TEXT] makes the model answer TEXT and end its answer; [rewrite-empty] makes it end at once;
[rewrite-slow] sleeps 0.2 s per generated token; [rewrite-bug] and [rewrite-oom] fail the rewrite's first
forward. Outlines (imgedit.runtime.grounding) read [answer:TEXT:answer] in mask_prompt the same way: the model
answers TEXT (JSON boxes, brackets and all). Without a marker the random model writes nonsense until
the token limit.
IMGEDIT_TEST_GPU_HEADROOM_GIB caps the worker's GPU memory at its weights plus that many GiB.
Every forward of the main modules (text encoder, transformer, FAST_QUANTIZE's copies, TURBO_MODEL_DIR's
transformer, VAE encoder/decoder) appends "<pid> enter|leave <module>" to the file named by IMGEDIT_TEST_PROBE, if
set (conftest.ConcurrencyProbe reads it).
"""

from __future__ import annotations

import gc
import os
import re
import time
import weakref

import torch


def install(pipe, spec) -> None:
    headroom = os.environ.get("IMGEDIT_TEST_GPU_HEADROOM_GIB")
    if headroom and torch.cuda.is_available():  # cap this worker's GPU memory a little above its weights
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, (torch.cuda.memory_allocated(0) + float(headroom) * 1024**3) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    current = {"prompt": ""}
    encode = pipe.encode_prompt

    def encode_prompt(*args, **kwargs):
        prompt = kwargs.get("prompt", args[1] if len(args) > 1 else "")
        if isinstance(prompt, str) and prompt.strip():  # the negative prompt is encoded after the prompt
            current["prompt"] = prompt if not current.get("locked") else current["prompt"]
            current["locked"] = True
        return encode(*args, **kwargs)

    pipe.encode_prompt = encode_prompt
    call = type(pipe).__call__

    def before_forward(module, args):
        prompt = current["prompt"]
        if "[slow]" in prompt:
            time.sleep(0.3)
        if held := re.search(r"\[hold:([^\]]+)\]", prompt):
            deadline = time.monotonic() + 120
            while os.path.exists(held.group(1)) and time.monotonic() < deadline:
                time.sleep(0.02)
        if "[oom]" in prompt or ("[rank1-oom]" in prompt and spec.rank == 1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if "[cuda-fault]" in prompt:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if "[bug]" in prompt:
            raise KeyError("secret internal detail")

    def before_text_encoder(module, args):
        if "[encode-bug]" in current["prompt"]:
            raise KeyError("secret internal detail")

    pipe.text_encoder.register_forward_pre_hook(before_text_encoder)
    copies = getattr(pipe, "imgedit_fast_copies", ())  # FAST_QUANTIZE: fast jobs run on these
    turbo = getattr(pipe, "imgedit_turbo_transformer", None)  # TURBO_MODEL_DIR: speed=fast/fastest runs on it
    for transformer in (pipe.transformer, *copies, *(() if turbo is None else (turbo,))):
        transformer.register_forward_pre_hook(before_forward)
    script_rewrites(pipe)
    probe = os.environ.get("IMGEDIT_TEST_PROBE")
    if probe:
        def mark(what, name):
            def hook(*_):
                with open(probe, "a") as f:
                    f.write(f"{os.getpid()} {what} {name}\n")
            return hook

        # The transformer's first block, not the transformer: a CFG-parallel rank answers one of the
        # two transformer calls per step without computing it. (A compiled block takes no file-writing
        # hook: then the transformer itself.)
        block = pipe.transformer if spec.compile else pipe.transformer.transformer_blocks[0]
        modules = {"text_encoder": pipe.text_encoder, "transformer": block,
                   "vae_encoder": pipe.vae.encoder, "vae_decoder": pipe.vae.decoder}
        for i, copy in enumerate(copies):  # "fast_transformer", "fast_transformer1", ...
            modules["fast_transformer" + (str(i) if i else "")] = copy if spec.compile else copy.transformer_blocks[0]
        if turbo is not None:
            modules["turbo_transformer"] = turbo if spec.compile else turbo.transformer_blocks[0]
        for name, module in modules.items():
            module.register_forward_pre_hook(mark("enter", name))
            module.register_forward_hook(mark("leave", name))

    class Tracked(type(pipe)):
        def __call__(self, *args, **kwargs):
            current["locked"] = False
            return call(self, *args, **kwargs)

    pipe.__class__ = Tracked


def script_rewrites(pipe) -> None:
    """The [rewrite:...] markers: the text encoder's next-token logits, one-hot on the scripted answer."""
    from imgedit.model.boxes import question
    from imgedit.runtime.enhance import GENERATION, INSTRUCTION

    tokenizer = pipe.processor.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = {"ids": None, "at": 0, "slow": False}

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape[1] == 1:  # one generated token: the script goes on
            return None
        text = tokenizer.decode(ids[0])
        script.update(ids=None, at=0, slow=False)
        if INSTRUCTION[:40] in text or GENERATION[:40] in text:  # an edit's rewrite, or a text to image's
            if "[rewrite-bug]" in text:
                raise KeyError("secret internal detail of the rewrite")
            if "[rewrite-oom]" in text:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            found = re.search(r"\[rewrite:([^\]]*)\]", text)
            if found:
                script["ids"] = tokenizer.encode(found.group(1), add_special_tokens=False) + [end]
            elif "[rewrite-empty]" in text:
                script["ids"] = [end]
            script["slow"] = "[rewrite-slow]" in text
        elif all(part in text for part in question("\0").split("\0")):  # an outline's question
            if found := re.search(r"\[answer:(.*?):answer\]", text, re.S):
                script["ids"] = tokenizer.encode(found.group(1), add_special_tokens=False) + [end]
        return None

    def after(module, args, kwargs, output):
        if script["slow"]:
            time.sleep(0.2)
        if script["ids"] is None or getattr(output, "logits", None) is None:
            return None
        token = script["ids"][min(script["at"], len(script["ids"]) - 1)]
        output.logits[:, -1, :] = -1e4
        output.logits[:, -1, token] = 1e4
        script["at"] += 1
        return output

    pipe.text_encoder.register_forward_pre_hook(before, with_kwargs=True)
    pipe.text_encoder.register_forward_hook(after, with_kwargs=True)


def break_compile(pipe, spec) -> None:
    """install(), and the failure seen on 2x H200 (the default balanced placement with a LoRA): an accelerate
    device hook inside a transformer block, whose pre_forward torch.compile refuses under fullgraph=True
    (`Skip calling torch.compiler.disable()'d function AlignDevicesHook.pre_forward`). Eager, the hook is
    harmless: it moves inputs to the device they are already on."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    install(pipe, spec)
    add_hook_to_module(pipe.transformer.transformer_blocks[0].attn.to_q,
                       AlignDevicesHook(execution_device=spec.plan.execution_device))


def break_encode(pipe, spec) -> None:
    """install(), and every prompt encode failing as the default balanced placement's did on 2x H200 (the text
    encoder's last hidden state left on its own GPU): a fault outside compile, so the compile warm-up fails on
    it and so does every job, compiled or not."""
    install(pipe, spec)

    def mismatch(module, args, kwargs):
        raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cuda:1)")

    pipe.text_encoder.register_forward_pre_hook(mismatch, with_kwargs=True)


def oom_at_warm_up(pipe, spec) -> None:
    """install(), and every warm-up job (its prompt: runtime.warmup.WARMUP_PROMPT) out of GPU memory, as on a
    capped card whose warm-up size does not fit: compiled or not, while smaller user jobs run."""
    from imgedit.runtime.warmup import WARMUP_PROMPT

    install(pipe, spec)
    encode = pipe.encode_prompt

    def encode_prompt(*args, **kwargs):
        if kwargs.get("prompt") == WARMUP_PROMPT:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return encode(*args, **kwargs)

    pipe.encode_prompt = encode_prompt


def leave_garbage(pipe, spec) -> None:
    """install(), and a tensor in a reference cycle old enough that only a full collection frees it, as loading
    can leave one; IMGEDIT_TEST_GARBAGE gets "freed <pid>" when it goes."""
    install(pipe, spec)
    cycle: dict = {"tensor": torch.zeros(1024)}
    cycle["self"] = cycle
    weakref.finalize(cycle["tensor"], _write, os.environ["IMGEDIT_TEST_GARBAGE"], f"freed {os.getpid()}\n")
    gc.collect()  # it survives this one (still referenced) into the oldest generation
    del cycle


def _write(path: str, text: str) -> None:
    with open(path, "a") as out:
        out.write(text)


def hook_blocks(pipe, spec) -> None:
    """install(), and the device hooks a transformer split over GPUs has once loaded: dispatch_model's (one on
    every block and one on every submodule with weights inside it), then the loader's keep_block_hooks (the
    inner ones dropped: the 2x 31 GiB split's compile warm-up failed on them on 2x H200). One device here, so
    force_hooks (dispatch_model would add none)."""
    from accelerate import dispatch_model

    from imgedit.model.components import block_container
    from imgedit.planning.plan import Placement
    from imgedit.runtime.weights import keep_block_hooks, module_device_map

    install(pipe, spec)
    transformer, device = pipe.transformer, spec.plan.execution_device
    blocks = len(transformer.get_submodule(block_container(transformer)))
    device_map = module_device_map(transformer, Placement(device, (device,) * blocks))
    dispatch_model(transformer, device_map=device_map, force_hooks=True)
    assert hasattr(transformer.transformer_blocks[0].img_mod, "_hf_hook")  # as on the GPUs
    keep_block_hooks(transformer)  # as runtime.loader does for a split


def count_compiles(pipe, spec) -> None:
    """install(), and torch.compile on the CPU with aot_eager, which writes one line to the file named by
    IMGEDIT_TEST_COMPILES per graph it compiles (tests/test_warmup.py: nothing compiles after the warm-up).
    inductor's CPU code generation fails on the Ulysses-split block (an `InductorError` in its vectorizer,
    nothing of ours); dynamo decides what compiles and when, whatever the backend."""
    from torch._dynamo.backends.registry import lookup_backend

    install(pipe, spec)
    path = os.environ["IMGEDIT_TEST_COMPILES"]
    aot_eager = lookup_backend("aot_eager")

    def counting(graph, example_inputs):
        with open(path, "a") as out:
            out.write(f"{os.getpid()} {len(graph.graph.nodes)}\n")
        return aot_eager(graph, example_inputs)

    original = torch.nn.Module.compile

    def compile(module, *args, **kwargs):
        kwargs.pop("mode", None)
        kwargs.pop("options", None)  # inductor's
        return original(module, *args, **{**kwargs, "backend": counting})

    torch.nn.Module.compile = compile
    compile_function = torch.compile  # Qwen-Image-2.1's steps compile the block's function (runtime.compile21)

    def compile_any(model=None, *args, **kwargs):
        kwargs.pop("mode", None)
        kwargs.pop("options", None)
        return compile_function(model, *args, **{**kwargs, "backend": counting})

    torch.compile = compile_any
