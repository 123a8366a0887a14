"""The libraries' private members we touch: each is still where imgedit.model.internals was written
against, and no other worker-side module of ours reaches into one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
from accelerate.hooks import ModelHook as AccelerateHook
from accelerate.hooks import add_hook_to_module
from diffusers.hooks import HookRegistry
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from transformers import PretrainedConfig

from imgedit.model import internals

ROOT = Path(__file__).resolve().parent.parent


def _hooked_by_diffusers():
    module = torch.nn.Linear(2, 2)
    HookRegistry.check_if_exists_or_initialize(module)
    return module


def _hooked_by_accelerate():
    module = torch.nn.Linear(2, 2)
    add_hook_to_module(module, AccelerateHook())
    return module


def _compiled():
    module = torch.nn.Linear(2, 2)
    module.compile()
    return module


# what makes an instance for the members that live on instances (MEMBERS' owners ending in "()")
INSTANCES = {
    "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageCausalConv3d()":
        lambda: QwenImageCausalConv3d(2, 2, 3, padding=1),
    "diffusers.hooks.HookRegistry.check_if_exists_or_initialize()": _hooked_by_diffusers,
    "diffusers.hooks.HookRegistry()": lambda: HookRegistry(torch.nn.Linear(2, 2)),
    "accelerate.hooks.add_hook_to_module()": _hooked_by_accelerate,
    "transformers.PretrainedConfig()": PretrainedConfig,
    "torch.nn.Module()": lambda: torch.nn.Linear(2, 2),
    "torch.nn.Module.compile()": _compiled,
}


def resolve(path: str):
    """A module, or an attribute path inside the longest importable module prefix."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)


@pytest.mark.parametrize("member", internals.MEMBERS, ids=lambda m: f"{m.owner}:{m.name}")
def test_each_private_member_is_where_it_was_written_against(member):
    owner = INSTANCES[member.owner]() if member.owner.endswith("()") else resolve(member.owner)
    assert hasattr(owner, member.name), (
        f"{member.library} moved {member.owner}.{member.name} (imgedit.model.internals was written against "
        f"{member.version}): {member.why}")


def test_every_instance_maker_serves_a_member():
    assert set(INSTANCES) == {m.owner for m in internals.MEMBERS if m.owner.endswith("()")}


def private_names(node: ast.AST) -> list[tuple[int, str]]:
    """`x._name` reads and writes and get/has/setattr(x, "_name") in a module: every reach into an object's
    private member. Dunders and `self`/`cls` are not counted."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr.startswith("_") and not sub.attr.startswith("__"):
            if not (isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")):
                found.append((sub.lineno, sub.attr))
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)
              and sub.func.id in ("getattr", "hasattr", "setattr") and len(sub.args) >= 2
              and isinstance(sub.args[1], ast.Constant) and isinstance(sub.args[1].value, str)
              and sub.args[1].value.startswith("_") and not sub.args[1].value.startswith("__")):
            found.append((sub.lineno, sub.args[1].value))
    return found


def own_private_names(trees: list[ast.AST]) -> set[str]:
    """The private names our own code defines: functions, classes, module names, attributes set on self/cls,
    and instance attributes of ours (prefixed _imgedit)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
    return {n for n in names if n.startswith("_")}


def test_no_other_module_reaches_into_a_librarys_private_member():
    # the worker side: the server's modules never import these libraries
    paths = sorted(path for folder in ("runtime", "model") for path in (ROOT / "imgedit" / folder).rglob("*.py"))
    trees = {path: ast.parse(path.read_text()) for path in paths}
    ours = own_private_names(list(trees.values())) - {m.name for m in internals.MEMBERS}
    allowed = {"_exit"}  # os._exit; our own marks on library objects start with _imgedit
    reaches = [f"{path.relative_to(ROOT)}:{line} {name}"
               for path, tree in trees.items() if path.name != "internals.py"
               for line, name in private_names(tree) if name not in ours | allowed and not name.startswith("_imgedit")]
    assert reaches == [], "library private members outside imgedit/model/internals.py:\n  " + "\n  ".join(reaches)


def test_the_scan_sees_a_reach_into_a_private_member():
    tree = ast.parse("def f(pipe):\n    x = pipe._execution_device\n    return hasattr(pipe, '_hf_hook')\n")
    assert [name for _, name in private_names(tree)] == ["_execution_device", "_hf_hook"]


def test_the_gather_compiles_into_one_graph_on_any_dim(monkeypatch):
    # the 2-GPU split's compiled blocks gather keys and values on dim 1: the library's own concatenation for a
    # dim other than 0 (torch._utils._maybe_view_chunk_cat) is skipped by torch 2.11's dynamo, and the blocks
    # fell back to eager on the GPU machine. 2.13 traces it: the skip is put back here as 2.11 has it.
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    monkeypatch.setattr(funcol, "_maybe_view_chunk_cat", torch._dynamo.disable(funcol._maybe_view_chunk_cat))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        gather = torch.compile(lambda t: internals.all_gather(t, 1, group, 1) * 2, fullgraph=True, backend="eager")
        tensor = torch.arange(24.0).reshape(2, 3, 4)
        assert torch.equal(gather(tensor), tensor * 2)
        assert torch.equal(internals.all_gather(tensor, 2, group, 1), tensor)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_gathered_tensor_is_the_ranks_tensors_concatenated_in_rank_order(dim, batch):
    # what all_gather_start hands back: the ranks' tensors stacked on dim 0 (3 ranks here)
    ranks = [torch.randn(batch, 5, 4) + 10 * r for r in range(3)]
    whole = internals.all_gather_finish(torch.cat(ranks, 0), dim, 3)
    assert torch.equal(whole, torch.cat(ranks, dim))
    if dim == 1 and batch == 1:  # the split's keys and values at batch 1: a view, nothing copied
        assert whole._base is not None


class _Rotary(torch.nn.Module):
    """A module holding a buffer alone, as a rotary table's inv_freq."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.full((4,), 0.5))

    def forward(self):
        return self.inv_freq


class _Encoder(torch.nn.Module):
    """A text encoder's shape for diffusers' lazy prefetching: a vision layer run only for a prompt with a
    picture, then a module of buffers alone, then a layer."""

    def __init__(self):
        super().__init__()
        self.vision, self.rotary, self.layer = torch.nn.Linear(4, 4), _Rotary(), torch.nn.Linear(4, 4)

    def forward(self, x, picture: bool = False):
        if picture:
            x = self.vision(x)
        return self.layer(x * self.rotary())


@pytest.mark.parametrize("fixed", [False, True])
def test_after_the_streamed_order_is_traced_a_group_of_buffers_alone_loads_itself(fixed):
    """diffusers 0.42.1's lazy prefetching (group offloading on a stream, as offload.stream streams a text
    encoder) traces the groups' order in the first forward; each traced group then waits to be loaded by the
    one before it, and one whose forerunner did not run is loaded anyway only if it has parameters. offload's
    hook, once the trace is made, has each group of buffers alone load itself (waiting for its copy) and leaves
    the others prefetched. Here on the CPU, the lazy hook registered as diffusers does with a stream; on a GPU,
    tests/test_gpu.py encodes with the real stream."""
    from diffusers.hooks import apply_group_offloading
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING,
        _LAZY_PREFETCH_GROUP_OFFLOADING,
        GroupOffloadingHook,
        LazyPrefetchGroupOffloadingHook,
        ModuleGroup,
    )

    from imgedit.runtime import offload

    model = _Encoder()
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="leaf_level")
    # what diffusers adds on the model itself with a stream: an empty group that prefetches the first traced one,
    # and the lazy prefetching hook
    config, cpu = model.layer._diffusers_hook.get_hook(_GROUP_OFFLOADING).config, torch.device("cpu")
    registry = HookRegistry.check_if_exists_or_initialize(model)
    top = ModuleGroup(modules=[], offload_device=cpu, onload_device=cpu, offload_leader=model, onload_leader=model)
    registry.register_hook(GroupOffloadingHook(top, config=config), _GROUP_OFFLOADING)
    registry.register_hook(LazyPrefetchGroupOffloadingHook(), _LAZY_PREFETCH_GROUP_OFFLOADING)
    if fixed:
        offload._buffers_load_themselves_after_the_trace(model)

    def group(module):
        return module._diffusers_hook.get_hook(_GROUP_OFFLOADING).group

    out = model(torch.ones(1, 4), picture=True)  # the trace, through the vision layer
    assert registry.get_hook(_LAZY_PREFETCH_GROUP_OFFLOADING) is None  # the trace is made
    assert not group(model.rotary).parameters and group(model.rotary).buffers  # a group of buffers alone
    # the premise: diffusers has the traced groups wait for their forerunner
    assert group(model.vision).onload_self is False and group(model.layer).onload_self is False
    assert group(model.rotary).onload_self is fixed and group(model.rotary).non_blocking is not fixed
    assert not model._forward_hooks  # the hook ran once, after the trace, and went
    assert torch.equal(model(torch.ones(1, 4)), model.layer(torch.full((1, 4), 0.5)))  # text alone runs
    assert torch.isfinite(out).all()
