"""DEVICE_MAP as a JSON object: the user's own map of components (and block ranges) to devices,
checked against the visible GPUs, the components' names and block counts, and each GPU's budget.

    {"transformer": {"0-29": "cuda:0", "30-59": "cuda:1"}, "text_encoder": "cuda:1", "vae": "cuda:0"}
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from imgedit.config.parsers import GIB
from imgedit.errors import PlacementError
from imgedit.planning.plan import (
    ANCHOR,
    FOLLOWER,
    ComponentSpec,
    Placement,
    Plan,
    WorkerPlan,
    bytes_per_device,
)

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_device(text: str, budget: Mapping[int, int], what: str) -> str:
    value = text.strip().lower()
    if value == "cpu":
        return "cpu"
    match = re.fullmatch(r"(?:cuda:)?(\d+)", value)
    if not match:
        raise PlacementError(f"DEVICE_MAP: {what} -> {text!r} is not a device (use cuda:N or cpu)")
    index = int(match.group(1))
    if index not in budget:
        raise PlacementError(f"DEVICE_MAP: {what} -> {text!r} but visible GPUs are {sorted(budget)}")
    return f"cuda:{index}"


def manual_plan(components: Sequence[ComponentSpec], budget: Mapping[int, int], manual: Mapping,
            activation_reserve: int) -> Plan:
    by_name = {c.name: c for c in components}
    unknown = sorted(set(manual) - set(by_name))
    if unknown:
        raise PlacementError(f"DEVICE_MAP names unknown components {unknown}; known: {sorted(by_name)}")
    placed: dict[str, Placement] = {}
    for c in components:
        where = manual.get(c.name)
        if where is None:
            if c.name == FOLLOWER:
                continue  # filled in below
            raise PlacementError(f"DEVICE_MAP does not place {c.name}; every component needs a device")
        if isinstance(where, str):
            placed[c.name] = Placement(parse_device(where, budget, c.name))
            continue
        if not c.blocks:
            raise PlacementError(f"DEVICE_MAP: {c.name} has no blocks to split; give it one device")
        devices: list[str | None] = [None] * len(c.blocks)
        for key, dev in where.items():
            match = _RANGE.match(str(key).strip())
            if not match:
                raise PlacementError(f"DEVICE_MAP: {c.name} block range {key!r} is not N or N-M")
            lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
            if lo > hi or hi >= len(c.blocks):
                raise PlacementError(f"DEVICE_MAP: {c.name} block range {key!r} "
                                     f"is outside 0-{len(c.blocks) - 1}")
            for i in range(lo, hi + 1):
                if devices[i] is not None:
                    raise PlacementError(f"DEVICE_MAP: {c.name} block {i} is placed twice")
                devices[i] = parse_device(dev, budget, f"{c.name} blocks {key}")
        missing = [i for i, d in enumerate(devices) if d is None]
        if missing:
            raise PlacementError(f"DEVICE_MAP: {c.name} blocks {missing[0]}..{missing[-1]} have no device")
        placed[c.name] = Placement(devices[0], tuple(devices))  # type: ignore[arg-type]
    anchor_device = placed[ANCHOR].device
    if FOLLOWER in by_name:
        vae = placed.get(FOLLOWER)
        if vae is not None and vae.device != anchor_device:
            raise PlacementError(
                f"DEVICE_MAP: vae must be on the transformer's first device ({anchor_device}): "
                "the pipeline encodes and decodes latents there")
        placed[FOLLOWER] = Placement(anchor_device)
    ordered = {c.name: placed[c.name] for c in components}
    per_device = bytes_per_device(components, ordered)
    for device, nbytes in per_device.items():
        nbytes += activation_reserve if device == anchor_device else 0
        if device.startswith("cuda:") and nbytes > budget[int(device[5:])]:
            raise PlacementError(
                f"DEVICE_MAP puts {nbytes / GIB:.1f} GiB on {device}, which can take "
                f"{budget[int(device[5:])] / GIB:.1f} GiB")
    return Plan("manual", (WorkerPlan("worker-0", ordered),), "manual map from DEVICE_MAP", per_device)
