"""A worker's parallel group as one rank sees it: which jobs it takes part in, which ranks it must
agree with on cancel, and the transformer wrapped for its role.

- cfg, Ulysses 1 (a CFG pair): rank r runs CFG branch r (runtime.cfg_parallel.CfgPair).
- cfg, Ulysses u > 1 (a group of 2u): the halves run the two branches; inside a half the u ranks
  split every forward's sequence (runtime.ulysses) and then exchange with the other half's rank at
  the same place. With CFG off only the first half runs the job.
- ulysses (a group of u): every rank takes part in every job, both CFG forwards split u ways.

All process groups are made here, on every rank in the same order (torch.distributed.new_group is
collective), right after loading.
"""

from __future__ import annotations

import torch.distributed as dist

from imgedit.errors import ImgEditError
from imgedit.runtime.cfg_parallel import CfgPair
from imgedit.runtime.ulysses import Layout, enable_ulysses


class ParallelGroup:
    def __init__(self, transformer, parallel: str, rank: int, world: int, ulysses: int, cuda: bool, cpu_group):
        cfg = 2 if parallel == "cfg" else 1
        if cfg * ulysses != world:
            raise ValueError(f"a {parallel} group of {world} ranks cannot split {cfg} x Ulysses-{ulysses}")
        self.layout = Layout(cfg, ulysses, rank)
        self.cpu_group = cpu_group  # all ranks: cancel agreement when everyone runs the job
        self.first_half_cpu = None  # the first half's ranks: cancel agreement when only they run it
        self.cfg_pair = None
        if ulysses > 1:
            heads = transformer.config.num_attention_heads
            if heads % ulysses:
                raise ImgEditError(f"Ulysses-{ulysses} splits the attention heads over {ulysses} GPUs, but this "
                                   f"transformer has {heads} heads; use a group whose halves divide {heads}")
            gloo = "gloo" if cuda else None
            halves = {c: dist.new_group(self.layout.half(c), backend=gloo) for c in range(cfg)}
            self.first_half_cpu = halves[0]
            enable_ulysses(transformer, self.layout, "cuda" if cuda else "cpu")
        if cfg == 2:
            peers = {u: dist.new_group(self.layout.exchange_peers(u)) for u in range(ulysses)} if ulysses > 1 else {}
            self.cfg_pair = CfgPair(transformer, self.layout.cfg_index, peers.get(self.layout.ulysses_index))

    def takes_part(self, cfg_on: bool) -> bool:
        """With CFG off a cfg group's second half has nothing to do."""
        return self.cfg_pair is None or cfg_on or self.layout.cfg_index == 0

    def begin(self, cfg_on: bool):
        """Before a job: arm the CFG exchange. Returns the CPU group whose ranks run this job
        together (they must agree on cancel at every step), or None when this rank runs it alone."""
        split_cfg = self.cfg_pair is not None and cfg_on
        if self.cfg_pair is not None:
            self.cfg_pair.begin(split_cfg)
        if split_cfg or (self.cfg_pair is None and self.layout.ulysses > 1):
            return self.cpu_group if self.cpu_group is not None else dist.group.WORLD
        if self.layout.ulysses > 1:  # CFG off in a cfg group: the first half runs it
            return self.first_half_cpu
        return None

    def end(self) -> None:
        if self.cfg_pair is not None:
            self.cfg_pair.begin(False)
