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
    monkeypatch.setattr(pinned, "lock", lambda buffer: locked.append(buffer) or False)
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
    starts, size = pinned.offsets(expected)
    assert buffer.numel() == size and all(start % pinned.ALIGN == 0 for start in starts)
    for (_, copy), want, start in zip(placed, expected, starts, strict=True):
        assert copy.dtype == want.dtype and copy.shape == want.shape and torch.equal(copy, want)
        assert copy.data_ptr() == buffer.data_ptr() + start  # a slice of the one buffer
