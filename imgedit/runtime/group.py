"""A worker's parallel group as one rank sees it: which jobs it takes part in, which ranks it must
agree with on cancel, and the transformer wrapped for its role.

- cfg, Ulysses 1 (a CFG pair): rank r runs CFG branch r (runtime.cfg_parallel.CfgPair). With CFG off
  rank 0 runs the job alone, or, with PAIR_ULYSSES, both ranks run it, each forward's sequence split
  in two (runtime.ulysses.UlyssesSwitch), unless a step cache would decide per rank what to skip.
- cfg, Ulysses u > 1 (a group of 2u): the halves run the two branches; inside a half the u ranks
  split every forward's sequence (runtime.ulysses) and then exchange with the other half's rank at
  the same place. With CFG off only the first half runs the job.
- ulysses (a group of u): every rank takes part in every job, both CFG forwards split u ways (Qwen-Image-2.1:
  its target image's tokens split u ways, imgedit.runtime.split21, installed by features.SplitTarget).

All process groups are made here, on every rank in the same order (torch.distributed.new_group is
collective), right after loading. FAST_QUANTIZE's copies (imgedit.runtime.fast_weights) run CFG-off jobs only
(speed presets): on a pair each gets its own Ulysses switch, set as the quality transformer's.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from imgedit.errors import ImgEditError
from imgedit.runtime.cfg_parallel import CfgPair
from imgedit.runtime.ulysses import Layout, UlyssesSwitch, enable_ulysses

log = logging.getLogger(__name__)


class ParallelGroup:
    def __init__(self, transformer, parallel: str, rank: int, world: int, ulysses: int, cuda: bool, cpu_group,
                 pair_ulysses: bool = False, copies: tuple = (), split: str = "ulysses"):
        cfg = 2 if parallel == "cfg" else 1
        if cfg * ulysses != world:
            raise ValueError(f"a {parallel} group of {world} ranks cannot split {cfg} x Ulysses-{ulysses}")
        self.layout = Layout(cfg, ulysses, rank)
        self.cpu_group = cpu_group  # all ranks: cancel agreement when everyone runs the job
        self.first_half_cpu = None  # the first half's ranks: cancel agreement when only they run it
        self.cfg_pair = None
        self.switch = None  # a CFG pair's Ulysses-2 for CFG-off jobs (PAIR_ULYSSES)
        self._copies: list = []  # the UlyssesSwitch of each FAST_QUANTIZE copy, set as the above
        degree = split_degree(cfg, ulysses, pair_ulysses)
        if split == "ulysses":  # "target": the family splits its own forwards (features.SplitTarget)
            check_heads(transformer.config.num_attention_heads, degree, ulysses)
        device_type = "cuda" if cuda else "cpu"
        # the process groups are made in this order on every rank (torch.distributed.new_group is collective)
        if degree == 2 and ulysses == 1:  # before the pair's override: that stays the outermost forward
            self.switch = UlyssesSwitch(transformer, rank, device_type)
        if ulysses > 1:
            self.first_half_cpu = self._halves(cfg, cuda)
            if split == "ulysses":
                enable_ulysses(transformer, self.layout, device_type)
        if cfg == 2:
            self.cfg_pair = self._cfg_pair(transformer, ulysses)
        if copies and (cfg != 2 or ulysses != 1):  # planning.modes.fast_refusal refuses these first
            raise ImgEditError("FAST_QUANTIZE's copies run on workers of one GPU or on CFG pairs")
        if self.switch is not None:
            # the quality transformer's mesh: the same NCCL communicators (one job runs at a time)
            self._copies = [UlyssesSwitch(copy, rank, device_type, self.switch.mesh) for copy in copies]

    def _halves(self, cfg: int, cuda: bool):
        """A CPU group for each half of a group with Ulysses inside its halves (made on every rank); returns
        the first half's, whose ranks agree on cancel when only they run a job."""
        gloo = "gloo" if cuda else None
        halves = {c: dist.new_group(self.layout.half(c), backend=gloo) for c in range(cfg)}
        return halves[0]

    def _cfg_pair(self, transformer, ulysses: int) -> CfgPair:
        """This rank's CFG branch; with Ulysses inside each half, the exchange with the other half's rank at
        the same place."""
        peers = {}
        if ulysses > 1:
            peers = {u: dist.new_group(self.layout.exchange_peers(u)) for u in range(ulysses)}
        return CfgPair(transformer, self.layout.cfg_index, peers.get(self.layout.ulysses_index))

    @property
    def splits_cfg_off(self) -> bool:
        """A CFG pair that runs CFG-off jobs on both ranks (PAIR_ULYSSES)."""
        return self.switch is not None

    def text_multiple(self, cfg_on: bool) -> int:
        """What a job's text is padded to (with a mask) on this group: the Ulysses degree where the job's
        sequence is split, else 1. Under torch.compile padded and unpadded forwards are separate variants."""
        if self.layout.ulysses > 1:
            return self.layout.ulysses
        return 2 if self.switch is not None and not cfg_on else 1

    def takes_part(self, cfg_on: bool, may_split: bool = True) -> bool:
        """With CFG off a cfg group's second half has nothing to do, unless a pair splits the sequence
        (`may_split`: the job has no step cache)."""
        return (self.cfg_pair is None or cfg_on or self.layout.cfg_index == 0
                or (self.switch is not None and may_split))

    def begin(self, cfg_on: bool, may_split: bool = True):
        """Before a job: arm the CFG exchange (or a pair's Ulysses). Returns the CPU group whose ranks run
        this job together (they must agree on cancel at every step), or None when this rank runs it alone."""
        split_cfg = self.cfg_pair is not None and cfg_on
        if self.cfg_pair is not None:
            self.cfg_pair.begin(split_cfg)
        for switch in (self.switch, *self._copies):
            if switch is not None:
                switch.set(not cfg_on and may_split)
        pair_split = self.switch is not None and self.switch.on
        if split_cfg or pair_split or (self.cfg_pair is None and self.layout.ulysses > 1):
            return self.cpu_group if self.cpu_group is not None else dist.group.WORLD
        if self.layout.ulysses > 1:  # CFG off in a cfg group: the first half runs it
            return self.first_half_cpu
        return None

    @contextmanager
    def job(self, call):
        """A job's part (imgedit.runtime.runner.Call): armed for it, disarmed however it ends."""
        call.together = self.begin(call.cfg_on, call.may_split)
        try:
            yield
        finally:
            self.end()

    def end(self) -> None:
        if self.cfg_pair is not None:
            self.cfg_pair.begin(False)
        for switch in (self.switch, *self._copies):
            if switch is not None:
                switch.set(False)


def split_degree(cfg: int, ulysses: int, pair_ulysses: bool) -> int:
    """The ranks that split each forward's sequence: a Ulysses group's (or half's), or a CFG pair's two for
    CFG-off jobs (PAIR_ULYSSES); 1 where nothing is split."""
    if ulysses > 1:
        return ulysses
    return 2 if cfg == 2 and pair_ulysses else 1


def check_heads(heads: int, degree: int, ulysses: int) -> None:
    """Ulysses splits the attention heads: a degree that does not divide them is refused with the setting."""
    if heads % degree == 0:
        return
    if ulysses == 1:
        raise ImgEditError("PAIR_ULYSSES=on splits CFG-off jobs' attention heads over the pair's 2 GPUs, but "
                           f"this transformer has {heads} heads; set PAIR_ULYSSES=auto (off for it) or off")
    raise ImgEditError(f"Ulysses-{degree} splits the attention heads over {degree} GPUs, "
                       f"but this transformer has {heads} heads; use a group whose halves divide {heads}")


# ---- the process groups every parallel group uses (a worker's, made once per process) ----
def init_group(rank: int, world: int, port: int, cuda: bool):
    """One small torch.distributed world per worker (its own port): gloo for control on the CPU,
    NCCL for tensors on GPUs. Returns the CPU group used to agree on cancel."""
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    kwargs = {}
    if cuda:
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            **kwargs)
    return dist.new_group(backend="gloo") if cuda else None


def close_group(timeout: float = 10.0) -> bool:
    """At a clean stop: destroy this rank's process groups, so NCCL frees its communicators and does not warn
    "destroy_process_group() was not called before program exit" (it did at every pair's exit). Bounded: a
    peer that is already gone must not keep this process alive. Returns whether it finished in time."""
    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the process is ending either way
            log.warning("destroying the process group failed: %r", exc)
        finally:
            done.set()

    threading.Thread(target=destroy, name="destroy-group", daemon=True).start()
    if not done.wait(timeout):
        log.warning("destroying the process group did not finish in %.0fs; the process ends anyway", timeout)
        return False
    return True


def agree_to_stop(local: bool, group=None) -> bool:
    """Every rank of the group must stop at the same step, or one would wait forever in a collective."""
    flag = torch.tensor([1 if local else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
