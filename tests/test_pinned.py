"""Page-locked CPU memory at its exact size (imgedit.runtime.pinned): the streamed weights' copies in one buffer.
On a GPU, tests/test_gpu.py checks the streamed blocks' copies are pinned, neighbours, and compute as before."""

from __future__ import annotations


def test_pinned_copies_are_the_tensors_values_in_one_aligned_buffer_and_the_originals_are_let_go(monkeypatch):
    """imgedit.runtime.pinned.copy_into_one, its CUDA registration replaced by a record (no GPU here): each
    copy has its tensor's values, shape and dtype at an aligned offset of one buffer; the caller gets each as
    soon as it is made, and the list lets go of each original then; the whole buffer is locked once."""
    import torch

    from imgedit.runtime import pinned

    locked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "lock", lambda buffer: locked.append(buffer) or True)
    monkeypatch.setattr(pinned, "_KEPT", [])
    tensors = [torch.arange(6, dtype=torch.bfloat16).view(2, 3), torch.tensor([True, False]),
               torch.full((5,), 7.0), torch.tensor(3, dtype=torch.int64)]
    expected = [t.clone() for t in tensors]
    placed = []

    def place(i, copy):
        assert tensors[i] is None  # the list's reference to the original is gone before the caller's
        placed.append((i, copy))

    pinned.copy_into_one(tensors, place)
    assert [i for i, _ in placed] == [0, 1, 2, 3] and len(locked) == 1
    buffer = locked[0]
    assert pinned._KEPT == [buffer]  # kept locked for the process's life: its slices are the weights
    starts, size = pinned.offsets(expected)
    assert buffer.numel() == size and all(start % pinned.ALIGN == 0 for start in starts)
    for (_, copy), want, start in zip(placed, expected, starts, strict=True):
        assert copy.dtype == want.dtype and copy.shape == want.shape and torch.equal(copy, want)
        assert copy.data_ptr() == buffer.data_ptr() + start  # a slice of the one buffer


def test_streamed_groups_plain_weights_move_into_the_buffer_and_quantized_ones_stay(monkeypatch):
    """offload._pin_once over diffusers' groups (one group here, as group offloading leaves it: each weight
    offloaded to its CPU tensor in `cpu_param_dict`): the plain weights' CPU tensors become slices of one
    buffer, and the weights point at them; a torchao-quantized weight (which diffusers pins itself) and a group
    kept on the GPU are left as they are. The registration is recorded (no GPU here)."""
    from types import SimpleNamespace

    import torch

    from imgedit.runtime import offload, pinned
    from imgedit.runtime.offload import quantize_module

    locked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "lock", lambda buffer: locked.append(buffer) or True)
    monkeypatch.setattr(pinned, "_KEPT", [])
    plain = torch.nn.Linear(64, 64).to(torch.bfloat16)
    quantized = torch.nn.Linear(64, 64).to(torch.bfloat16)
    quantize_module(quantized, "int8", ())
    tensors = [plain.weight, plain.bias, quantized.weight]
    values = [t.detach().clone() for t in tensors[:2]]
    group = SimpleNamespace(offload_device=torch.device("cpu"), cpu_param_dict={t: t.data for t in tensors})
    on_gpu = SimpleNamespace(offload_device=torch.device("cuda"), cpu_param_dict={plain.weight: torch.ones(1)})
    monkeypatch.setattr(offload, "_offload_groups", lambda model: [group, on_gpu])
    int8 = group.cpu_param_dict[quantized.weight]

    offload._pin_once(torch.nn.Module())

    assert len(locked) == 1
    buffer = locked[0]
    for weight, value in zip(tensors[:2], values, strict=True):
        copy = group.cpu_param_dict[weight]
        assert buffer.data_ptr() <= copy.data_ptr() < buffer.data_ptr() + buffer.numel()  # in the buffer
        assert weight.data_ptr() == copy.data_ptr() and torch.equal(weight.data, value)  # the weight uses it
    assert group.cpu_param_dict[quantized.weight] is int8  # diffusers' own, untouched
    assert torch.equal(on_gpu.cpu_param_dict[plain.weight], torch.ones(1))  # a resident group: not pinned


def test_the_cpu_tensors_are_copied_before_the_one_lock(monkeypatch):
    """The lock comes after the copies (CUDA then locks pages that are present instead of faulting each in on
    one thread: 3.8 s against 10.6 s for 27 GiB on an H200 host): when the buffer is locked, every CPU tensor
    has been copied into it and handed to the caller, and the caller's copies are slices of that buffer."""
    import torch

    from imgedit.runtime import pinned

    tensors = [torch.full((300,), float(i), dtype=torch.bfloat16) for i in range(4)]
    expected = [t.clone() for t in tensors]
    placed = {}
    at_lock = []

    def lock(buffer):
        at_lock.append({i: torch.equal(copy, expected[i]) for i, copy in placed.items()})
        return True

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "lock", lock)
    monkeypatch.setattr(pinned, "_KEPT", [])
    pinned.copy_into_one(tensors, lambda i, copy: placed.__setitem__(i, copy))
    assert at_lock == [{0: True, 1: True, 2: True, 3: True}]
    buffer = pinned._KEPT[0]
    assert all(buffer.data_ptr() <= c.data_ptr() < buffer.data_ptr() + buffer.numel() for c in placed.values())


def test_weights_about_to_stream_move_into_one_buffer_with_their_values(monkeypatch):
    """offload._into_pinned_memory, before diffusers' group offloading sees a model: each plain weight and
    buffer of the given modules becomes a slice of one locked buffer with its values (diffusers' CPU copy of a
    CPU weight is that weight), the module computes what it did, a torchao-quantized weight is left to
    diffusers, and a module not given is not touched; where diffusers makes its own copies (low_cpu_mem_usage
    off), nothing moves. The registration is recorded (no GPU here)."""
    import torch

    from imgedit.runtime import offload, pinned
    from imgedit.runtime.offload import quantize_module

    locked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "lock", lambda buffer: locked.append(buffer) or True)
    monkeypatch.setattr(pinned, "_KEPT", [])
    streamed = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).to(torch.bfloat16)
    streamed.register_buffer("table", torch.arange(4.0))
    quantized = torch.nn.Linear(64, 64).to(torch.bfloat16)
    quantize_module(quantized, "int8", ())
    kept = torch.nn.Linear(16, 16).to(torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    before = streamed(x)
    values = {name: t.detach().clone() for name, t in streamed.state_dict().items()}
    int8, kept_at = quantized.weight, kept.weight.data_ptr()

    offload._into_pinned_memory([kept], {"low_cpu_mem_usage": False})  # diffusers copies these itself
    assert kept.weight.data_ptr() == kept_at and locked == []
    offload._into_pinned_memory([streamed, quantized], {"low_cpu_mem_usage": True})

    assert len(locked) == 1
    buffer = locked[0]
    for name, tensor in streamed.state_dict().items():
        assert buffer.data_ptr() <= tensor.data_ptr() < buffer.data_ptr() + buffer.numel(), name
        assert torch.equal(tensor, values[name]), name
    assert torch.equal(streamed(x), before)
    assert quantized.weight is int8 and not (buffer.data_ptr() <= int8.data_ptr() < buffer.data_ptr() +
                                               buffer.numel())
    assert kept.weight.data_ptr() == kept_at


def test_the_copies_run_on_the_workers_copy_threads_and_give_them_back(monkeypatch):
    """A GPU worker keeps a few threads for its jobs and takes its share of the machine's CPUs for the copies
    (pinned.set_copy_threads): raised while they run, back after them, also when placing a copy fails."""
    import pytest
    import torch

    from imgedit.runtime import pinned

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "lock", lambda buffer: True)
    monkeypatch.setattr(pinned, "_KEPT", [])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    pinned.set_copy_threads(2)
    try:
        seen = []
        pinned.copy_into_one([torch.ones(8), torch.zeros(8)], lambda i, copy: seen.append(torch.get_num_threads()))
        assert seen == [2, 2] and torch.get_num_threads() == 1

        def fails(i, copy):
            raise RuntimeError("placing failed")

        with pytest.raises(RuntimeError, match="placing failed"):
            pinned.copy_into_one([torch.ones(8)], fails)
        assert torch.get_num_threads() == 1
    finally:
        pinned.set_copy_threads(0)
        torch.set_num_threads(before)


def test_where_the_lock_is_refused_each_streamed_weight_ends_on_a_pinned_copy_of_its_own(monkeypatch):
    """offload._pin_once through copy_into_one's fallback (CUDA refuses the one lock): every CPU weight, placed
    first as a slice of the unlocked buffer, is placed again on a pinned copy of its own with its values, and
    no weight is left on the buffer. No GPU here: the lock's refusal is recorded and `pin_memory()` stands in
    as a copy marked pinned."""
    from types import SimpleNamespace

    import torch

    from imgedit.runtime import offload, pinned

    buffers, pinned_copies, calls = [], [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "lock", lambda buffer: buffers.append(buffer) or False)
    monkeypatch.setattr(pinned, "_KEPT", [])
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned_copies.append(self.clone()) or
                        pinned_copies[-1])
    layers = [torch.nn.Linear(16, 16).to(torch.bfloat16), torch.nn.LayerNorm(16)]
    tensors = [t for layer in layers for t in layer.parameters()]
    values = [t.detach().clone() for t in tensors]
    group = SimpleNamespace(offload_device=torch.device("cpu"), cpu_param_dict={t: t.data for t in tensors})
    monkeypatch.setattr(offload, "_offload_groups", lambda model: [group])
    real_copy_into_one = pinned.copy_into_one

    def recorded(sources, place):
        real_copy_into_one(sources, lambda i, copy: calls.append(i) or place(i, copy))

    monkeypatch.setattr(pinned, "copy_into_one", recorded)

    offload._pin_once(torch.nn.Module())

    assert len(buffers) == 1 and pinned._KEPT == []
    n = len(tensors)
    assert calls == [*range(n), *range(n)]  # each placed on the buffer, then again on its pinned copy
    buffer = buffers[0]
    for weight, value in zip(tensors, values, strict=True):
        copy = group.cpu_param_dict[weight]
        assert any(copy is p for p in pinned_copies) and weight.data_ptr() == copy.data_ptr()
        assert not (buffer.data_ptr() <= copy.data_ptr() < buffer.data_ptr() + buffer.numel())
        assert torch.equal(weight.data, value)
