"""Workers as Ray actors (WORKERS=ray): a transport of engine.pool's supervisor, ranks anywhere in a cluster.

Each rank is one `RankActor`. The actor runs the worker process's own code (runtime.worker.main) in a
thread of the actor's process, over a pipe pair inside that process; `RayTransport` relays the server's
messages to it (`put`) and long-polls its outbox (`poll`), so progress, cancel within a step, results
(through Ray's object store) and typed errors are those of a local worker. A worker's ranks share one
placement group (STRICT_PACK: one node; pinned to the node the planner chose). An actor or a node that
dies fails only the job it was running; the supervisor starts the group again (WORKER_RESTARTS), and the
new actors wait for the cluster to have room (a worker whose node left is placed anew). `ray` is imported
only when WORKERS=ray.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from imgedit.config.settings import Settings
from imgedit.engine.workers.gpus import discover_gpus
from imgedit.engine.workers.pool import Died, SendFailed, TransportLost, localize
from imgedit.errors import WorkerFailed
from imgedit.planning.placement import plan_placement
from imgedit.planning.plan import ComponentSpec, Placement, Plan, WorkerPlan
from imgedit.runtime.messages import Channel, Ready

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 30.0  # ray.init retries an unreachable address for minutes; the server must not hang
POLL_S = 0.5
_STAY = threading.Event()  # never set: see connect()
NODE_LEFT = "its node left the cluster"
# An actor whose node stops answering is first "unavailable"; the node is declared dead once the health
# checks fail (Ray's default 5 x 3 s): a restart waits that long for the verdict, not to land on it.
NODE_VERDICT_S, UNAVAILABLE = 30.0, "ActorUnavailableError"


def _ray():
    # No auto-init: a ray call after ray.shutdown() must fail, not start a new local cluster.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    import ray  # optional: WORKERS=ray only, and after the variable above is set

    return ray


def _joined():
    """ray, once connected. Any ray call made after ray.shutdown() would quietly start a new local
    cluster (ray's auto-init): a handle stopped late, or twice, must fail instead."""
    ray = _ray()
    if not ray.is_initialized():
        raise ConnectionError("not connected to the Ray cluster")
    return ray


def connect(address: str | None, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Join the cluster at `address` (None: start a local one), or raise WorkerFailed within `timeout`."""
    ray = _ray()
    if ray.is_initialized():
        return
    outcome: list[BaseException | None] = []
    answered = threading.Event()

    def join() -> None:
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, configure_logging=False)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - ray raises ConnectionError, RuntimeError, ... here
            outcome.append(exc)
            return
        finally:
            answered.set()
        # Without an address ray.init starts a local cluster whose GCS and raylet are tied to the
        # *thread* that started them (Linux PR_SET_PDEATHSIG, Ray's kernel fate-sharing): had this
        # thread ended, they would be killed at once and every later Ray call would hang for 60 s,
        # then kill the server. So the thread lives as long as the process.
        _STAY.wait()

    # A daemon thread: one still retrying an unreachable address must not keep the process alive.
    thread = threading.Thread(target=join, name="ray-connect", daemon=True)
    thread.start()
    answered.wait(timeout)  # not thread.join: after a successful init the thread stays (above)
    where = address or "a new local cluster"
    if not outcome:
        raise WorkerFailed(f"cannot reach the Ray cluster at {where} within {timeout:.0f}s (RAY_ADDRESS)")
    if outcome[0] is not None:
        exc = outcome[0]
        raise WorkerFailed(f"cannot reach the Ray cluster at {where}: {type(exc).__name__}: {str(exc)[:300]} "
                           "(RAY_ADDRESS)")


# ---- planning: per node, from what Ray reports ----

@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    cpus: float
    gpus: int


def alive_nodes() -> list[Node]:
    nodes = [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), n["Resources"].get("CPU", 0.0),
                  int(n["Resources"].get("GPU", 0))) for n in _ray().nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: n.node_id)


def _node_gpus(node: Node) -> list:
    """The GPUs of one node as that node's NVML sees them (Ray reports a count, not memory)."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # WORKERS=ray only

    task = ray.remote(num_cpus=0, num_gpus=0)(_discover_here).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
    return ray.get(task.remote(node.gpus), timeout=60)


def _discover_here(count: int) -> list:
    """Runs on the node: NVML's view of its GPUs, the first `count` (as many as Ray offers there). A
    task given no GPU may find CUDA_VISIBLE_DEVICES emptied by Ray, which would hide them all."""
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    return discover_gpus()[:count]


def plan_cluster(components: Sequence[ComponentSpec], settings: Settings, nodes: Sequence[Node],
                 family: str = "plus") -> tuple[Plan, dict]:
    """One plan for the cluster: each node planned on its own GPUs with the usual planner (so a
    group's GPUs are always on one node). Without any GPU in the cluster, or with DEVICE_MAP=cpu, one
    CPU worker per node; otherwise nodes without GPUs (the server's own, say) get none.
    Returns the plan and each worker's node id."""
    workers: list[WorkerPlan] = []
    where: dict[str, str] = {}
    reasons = []
    on_cpu = settings.device_map.mode == "cpu" or not any(n.gpus for n in nodes)
    for number, node in enumerate(nodes):
        if not on_cpu and node.gpus == 0:
            reasons.append(f"node{number} ({node.address}, {node.node_id[:8]}): no GPU, no worker")
            continue
        if on_cpu:
            plan = Plan("cpu", (WorkerPlan("worker-0", {c.name: Placement("cpu") for c in components}),),
                        "one CPU worker")
        else:
            plan = plan_placement(components, _node_gpus(node), settings.device_map, settings.max_memory,
                                  settings.gpu_memory_reserve, settings.activation_reserve, family)
        reasons.append(f"node{number} ({node.address}, {node.node_id[:8]}): {plan.reason}")
        for worker in plan.workers:
            named = replace(worker, name=f"node{number}-{worker.name}")
            workers.append(named)
            where[named.name] = node.node_id
    mode = settings.device_map.mode
    return Plan(mode, tuple(workers), f"Ray cluster of {len(nodes)} node(s): " + "; ".join(reasons)), where


# ---- the actor (runs in a Ray worker process, anywhere) ----

class RankActor:
    """One rank: runtime.worker.main in a thread of this actor's process, fed through a pipe pair."""

    def __init__(self):
        # Made here, not in start(): the actor's methods run in several threads, a poll may come first.
        self._inbox_read, inbox_write = multiprocessing.Pipe(duplex=False)
        self._outbox, self._outbox_write = multiprocessing.Pipe(duplex=False)
        self._inbox = Channel(inbox_write)

    def start(self, spec, cache_dir: str | None, log_level: str) -> dict:
        from imgedit.runtime.worker import main  # in the actor's process, never the server's

        # visible_devices=None: Ray has set CUDA_VISIBLE_DEVICES to the GPUs it gave this actor.
        threading.Thread(target=main, name="imgedit-worker", daemon=True,
                         args=(spec, self._inbox_read, self._outbox_write, None, cache_dir,
                               log_level)).start()
        ray = _ray()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def put(self, message) -> None:
        self._inbox.put(message)

    def poll(self, timeout: float) -> list:
        """The messages the worker sent, waiting up to `timeout` for the first one."""
        messages = []
        if self._outbox.poll(timeout):
            while self._outbox.poll(0):
                try:
                    messages.append(self._outbox.recv())
                except EOFError:  # the worker loop ended (Stop or a load failure)
                    break
        return messages


class _ActorInbox:
    """What WorkerHandle puts jobs, cancels and stops into: one actor's `put`, in order (each put
    waits for the actor to take it; a threaded actor does not keep the order of calls in flight)."""

    def __init__(self, actor):
        self.actor = actor

    def put(self, message) -> None:
        _joined().get(self.actor.put.remote(message), timeout=10)


class RayTransport:
    """A worker's ranks as Ray actors in one placement group (see the module docstring)."""

    what = "the Ray actor"
    retries_loading_deaths = True  # a restart that dies while loading (its node going away) restarts again
    respawn_note = "; waiting for room in the cluster"

    def __init__(self, name: str, cache_dir: str | None, log_level: str = "INFO", node_id: str | None = None):
        self.name, self.cache_dir, self.log_level = name, cache_dir, log_level
        self.node_id = node_id  # where the planner put it; None: anywhere with room
        self.node: str | None = None  # where its actors run now
        self.closing = False
        self.pids: tuple[int, ...] = ()
        self._group = None
        self._actors: list = []
        self._starts: list = []
        self._inboxes: list[_ActorInbox] = []
        self._generation = 0
        self._polled_generation = 0
        self._polled: list = []  # the actors the pending polls were sent to
        self._pending: dict = {}

    def spawn(self, specs: list) -> None:
        ray = _joined()
        from ray.util.placement_group import placement_group  # WORKERS=ray only
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # WORKERS=ray only

        bundles = [_bundle(spec.plan) for spec in specs]
        if self._group is None:
            selector = [{"ray.io/node-id": self.node_id}] * len(bundles) if self.node_id else None
            self._group = placement_group(bundles, strategy="STRICT_PACK", name=f"imgedit-{self.name}",
                                          bundle_label_selector=selector)
        actor_class = ray.remote(RankActor)
        # A group's ranks are on one node (STRICT_PACK); its gloo/NCCL rendezvous is on that node's
        # loopback, at a port free here (a clash there fails the load, and the restart picks another).
        self._actors, self._starts, self._inboxes = [], [], []
        for spec, bundle in zip(specs, bundles, strict=True):
            local, _ = localize(spec.plan, None)
            actor = actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_restarts=0, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group,
                                                                     placement_group_bundle_index=spec.rank),
            ).remote()
            self._actors.append(actor)
            self._starts.append(actor.start.remote(replace(spec, plan=local), self.cache_dir, self.log_level))
            self._inboxes.append(_ActorInbox(actor))
        self.pids, self.node = (), None
        self._generation += 1

    def describe(self) -> str:
        return f"{len(self._actors)} Ray actor(s) (placement group {self._group.id.hex()[:8]})"

    def send(self, message, ignore_errors: bool = False) -> None:
        """To every rank, in rank order."""
        for inbox in self._inboxes:
            try:
                inbox.put(message)
            except Exception as exc:  # noqa: BLE001 - the actor is gone or unreachable
                if not ignore_errors:
                    raise SendFailed(f"Ray actor could not take the job ({_death_reason(exc)})") from exc

    def saw_ready(self, message: Ready) -> None:
        self.pids = tuple(sorted({*self.pids, message.pid}))

    # ---- long polls on every rank; an actor error is a death ----
    def poll(self, timeout: float) -> list:
        ray = _ray()
        if not ray.is_initialized():
            raise TransportLost("disconnected from the Ray cluster")
        if self._polled_generation != self._generation:
            self._polled_generation, self._polled = self._generation, list(self._actors)
            self._pending = {ref: ("start", rank) for rank, ref in enumerate(self._starts)}
            self._pending.update({a.poll.remote(POLL_S): ("poll", rank)
                                  for rank, a in enumerate(self._polled)})
        if not self._pending:
            threading.Event().wait(POLL_S)
            return []
        try:
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(timeout, POLL_S * 2))
        except BaseException:  # noqa: BLE001 - ray shut down under us (it raises SystemExit then)
            if not ray.is_initialized():
                raise TransportLost("disconnected from the Ray cluster") from None
            raise
        events = []
        for ref in ready:
            what, rank = self._pending.pop(ref)
            try:
                answer = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - RayActorError, ActorDiedError, node gone, ...
                self._pending = {}
                events.append(self._died(rank, exc))
                break
            if what == "start":
                self.node = answer["node_id"]
                self.pids = tuple(sorted({*self.pids, answer["pid"]}))
                continue
            events.extend(answer)
            if rank < len(self._polled) and not self.closing:
                self._pending[self._polled[rank].poll.remote(POLL_S)] = ("poll", rank)
        return events

    def _died(self, rank: int, exc: BaseException) -> Died:
        reason = _death_reason(exc)
        where = f"node {self.node[:8]}" if self.node else "its node"
        return Died(reason, f"Ray actor of rank {rank} on {where} ended ({reason})",
                    f"Ray actor (rank {rank} on {where}) stopped during the job ({reason})", reap_timeout=0)

    def prepare_respawn(self, died: Died) -> None:
        verdict = NODE_VERDICT_S if died.reason == UNAVAILABLE else 0
        node_gone = died.reason == NODE_LEFT or self._node_left(wait=verdict)
        if self.node_id and node_gone:
            # Its node left: place it again wherever the cluster has room (a node that comes back
            # has a new id), not on the node that is gone.
            log.warning("%s: its node %s left the cluster; placing it anew", self.name, self.node_id[:8])
            self._remove_group()
            self.node_id = None

    def _node_left(self, wait: float) -> bool:
        """Whether this worker's node is gone from the cluster, waiting up to `wait` s for Ray to say so."""
        deadline = time.monotonic() + wait
        while self.node and self.node in {n.node_id for n in alive_nodes()}:
            if time.monotonic() >= deadline or self.closing:
                return False
            threading.Event().wait(0.5)
        return bool(self.node)

    def reap(self, timeout: float) -> None:
        ray = _ray()
        if not ray.is_initialized():  # the cluster connection is gone, and its actors with it
            self._actors = []
            return
        actors, self._actors = self._actors, []
        if actors and timeout > 0 and self.closing:
            try:  # a Stop was sent: give the worker loops a moment to end on their own
                ray.wait([a.poll.remote(0) for a in actors], num_returns=len(actors),
                         timeout=min(timeout, 1.0))
            except Exception:  # noqa: BLE001 - dead already: killed below anyway
                pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def close(self) -> None:
        self._remove_group()

    def _remove_group(self) -> None:
        if self._group is not None and _ray().is_initialized():
            from ray.util.placement_group import remove_placement_group  # WORKERS=ray only

            try:
                remove_placement_group(self._group)
            except Exception:  # noqa: BLE001 - the cluster is gone
                pass
        self._group = None


def _bundle(plan: WorkerPlan) -> dict:
    """A rank's share of the placement group: a CPU, and its GPUs."""
    gpus = sum(d.startswith("cuda:") for d in plan.devices)
    return {"CPU": 1.0, "GPU": float(gpus)} if gpus else {"CPU": 1.0}


def _death_reason(exc: BaseException) -> str:
    text = str(exc)
    if "node" in text.lower() and ("died" in text.lower() or "dead" in text.lower()):
        return NODE_LEFT
    if "SIGKILL" in text or "killed" in text.lower() or "exit" in text.lower() or "died" in text.lower():
        return "its process died"
    return type(exc).__name__
