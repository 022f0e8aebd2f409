"""Tensor parallelism over Ray actors: ``--distributed-executor-backend ray``.

:class:`RayExecutor` runs the N ranks of ``--tensor-parallel-size N`` as Ray actors
(:class:`RankActor`), each holding the same :class:`~chassis.core.worker.Worker` a
tensor-parallel worker process holds, so the ranks may sit on several nodes of a Ray cluster.
It joins the cluster this process can reach (``RAY_ADDRESS``, or one started with ``ray
start`` on this node), else starts a local one; reserves one placement-group bundle per rank
(the resources ``Platform.ray_resources`` names: a GPU on CUDA, a core on the CPU), packed
onto as few nodes as fit; starts one actor per bundle; and joins them in one
``torch.distributed`` group over the platform's ``dist_backend``, with a TCP rendezvous on rank
0's node. Ranks on the driver's node come first, so rank 0 normally shares this node.

Every rank, rank 0 included, is an actor: Ray reserves each rank's device and makes only that
one visible to its actor, which a rank in this process could not be given (this process sees
every device of its node, and Ray does not say which of them it reserved for a bundle). The
cost is one round trip through Ray per step for rank 0's result, which tensor parallelism's
all-reduces outweigh; this process holds no device and joins no group.

The step protocol is the tensor-parallel executor's (:class:`~chassis.core.tp_executor.
RankGroupExecutor`): the same plan goes to every rank, rank 0 returns its output, the others
its :func:`~chassis.core.tp_executor.step_summary`, which must equal rank 0's; KV sizing takes
the smallest block count; LoRA adapters are pinned on every rank or none. Failures are
reported as the multiprocess executor reports them (docs/architecture.md): a rank that fails
a command reports its error and is killed (the others' collectives with it fail at once); a
rank whose actor dies is named (``tensor-parallel rank 1 exited``), also when another rank
fails first because of it, and while the engine is idle (:meth:`RayExecutor.check_health`);
afterwards every step says the group cannot run any more. A step not answered by every rank
within ``--execute-model-timeout-s`` is the step watchdog's (:mod:`chassis.core.tp_watchdog`,
as for worker processes): the ranks that have not answered are named, with their Python
stacks (each actor registers ``faulthandler`` for ``SIGUSR1``, writing to a file it has
already unlinked; :func:`dump_stacks` signals it and reads the dump through ``/proc``, on
the rank's node), the actors are killed and the step raises ``StepTimeoutError``. Commands
and results travel as Ray arguments and return values (Ray pickles them): the cluster is one
trust domain.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import tempfile
import threading
import weakref
from typing import Any

import torch

from chassis.core import parallel_state
from chassis.core.config import EngineConfig
from chassis.core.tp_executor import RankGroupExecutor, _rank_error, run_command
from chassis.core.tp_watchdog import (
    StepTimeout,
    StepWatchdog,
    file_size,
    read_new_text,
)
from chassis.core.tp_worker_proc import failure_detail

logger = logging.getLogger(__name__)

#: how long the placement group may wait for busy resources before start-up fails
_PLACEMENT_TIMEOUT_S = 300.0
#: how long a failed step waits for another rank's death to be reported (it says more)
_FAILURE_WAIT_S = 3.0
#: how long an idle health check waits for the ranks' replies
_HEALTH_TIMEOUT_S = 10.0
#: how long the watchdog waits for the stack dumps of ranks on other nodes
_REMOTE_DUMP_TIMEOUT_S = 15.0
#: the driver's environment the ranks need (Ray starts actors with the raylet's)
_FORWARDED_ENV = ("CHASSIS_", "HF_", "GLOO_SOCKET_IFNAME", "NCCL_")
_MISSING_RAY = (
    "--distributed-executor-backend ray needs Ray, which is not installed: "
    "pip install 'chassis-llm[ray]'"
)

#: how many executors of this process use the Ray connection they opened (closed at zero)
_connection_lock = threading.Lock()
_connection_users = 0


def import_ray() -> Any:
    """The ``ray`` module; ``ValueError`` naming the extra to install without it."""
    try:
        import ray
    except ImportError:
        raise ValueError(_MISSING_RAY) from None
    return ray


class RankActor:
    """One rank, in a Ray actor: its :class:`~chassis.core.worker.Worker` and its place in
    the group. Every method returns instead of raising (``(ok, result-or-error)``) where the
    driver must tell a rank's own failure from its actor's death."""

    def __init__(self, log_level: int) -> None:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s [ray rank] %(name)s: %(message)s"
        )
        self.rank = 0
        self.worker: Any = None
        # The step watchdog's view of this rank (dump_stacks): faulthandler writes every
        # thread's stack from its signal handler, in C, so it answers even while this
        # actor's thread is blocked in a collective or a kernel. The file is unlinked at
        # once (a killed actor leaves nothing behind); it is read through /proc, and stays
        # open for the actor's life.
        self._stacks = tempfile.TemporaryFile(mode="w+", prefix="chassis-ray-stacks-")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)

    def locate(self) -> tuple[str, str, int, int]:
        """Where this rank is: its node's IP and Ray id, its process id, and the descriptor
        of its stack-dump file (:func:`dump_stacks`)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return ray.util.get_node_ip_address(), node, os.getpid(), self._stacks.fileno()

    def node_ip(self) -> str:
        """The IP address of this actor's node, as Ray knows it."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (for the group's rendezvous)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def start(
        self, config: EngineConfig, rank: int, init_method: str, multi_node: bool
    ) -> tuple[bool, Any]:
        """Join the group as ``rank`` (returning once every rank has joined) and load this
        rank's share of the model on the one device Ray made visible. Result: this rank's
        LoRA target shapes (None without ``--enable-lora``), the dtype of its weights, its
        ``Worker.kv_cache_group_windows`` and its ``Worker.kv_cache_group_chunks``."""
        try:
            from chassis.core.worker import Worker
            from chassis.platforms import get_current_platform

            self.rank = rank
            platform = get_current_platform()
            if multi_node:
                # the collectives' sockets must listen where the other nodes reach this one
                # (on one node, init_tensor_parallel keeps them on loopback)
                unset = [
                    n for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if n not in os.environ
                ]
                interface = _interface_of(self.node_ip()) if unset else None
                if unset and interface is None:
                    raise ValueError(
                        f"no network interface carries this node's address {self.node_ip()}; "
                        f"set {' and '.join(unset)} on every node"
                    )
                for name in unset:
                    os.environ[name] = interface
            size = config.tensor_parallel_size
            parallel_state.init_tensor_parallel(
                rank,
                size,
                platform.dist_backend,
                init_method,
                expert_parallel=config.enable_expert_parallel,
            )
            self.worker = Worker(config, device_index=platform.tensor_parallel_devices(1)[0])
            lora = self.worker.lora
            shapes = None if lora is None else dict(lora.target_shapes)
            worker = self.worker
            windows, chunks = worker.kv_cache_group_windows(), worker.kv_cache_group_chunks()
            return True, (shapes, worker.dtype, windows, chunks)
        except Exception as exc:
            return False, failure_detail(rank, "start", exc)

    def run(self, method: str, payload: Any) -> tuple[bool, Any]:
        """Run one command (``chassis.core.tp_executor.run_command``); ranks other than 0
        answer ``execute`` with the step's summary."""
        try:
            return True, run_command(self.worker, method, payload, self.rank)
        except Exception as exc:
            return False, failure_detail(self.rank, method, exc)

    def ping(self) -> bool:
        """True (the actor answers)."""
        return True


def dump_stacks(pid: int, fd: int) -> str:
    """On a rank's node: the Python stacks of every thread of the actor process ``pid``,
    which it writes to its descriptor ``fd`` on ``SIGUSR1`` (:class:`RankActor`); "" when
    the process is gone or writes nothing within a few seconds."""
    path = f"/proc/{pid}/fd/{fd}"
    offset = file_size(path)
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return ""
    return read_new_text(path, offset)


def dump_stacks_on(ray: Any, node: str, pid: int, fd: int) -> Any:
    """The Ray reference of :func:`dump_stacks` run by a task pinned to the node ``node``
    (a Ray node id), asking no CPU (the ranks' bundles may hold them all)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(dump_stacks).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    )
    return task.remote(pid, fd)


def _interface_of(ip: str) -> str | None:
    """The network interface whose IPv4 address is ``ip`` (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), siocgifaddr, request)[20:24])
            except OSError:
                continue
            if address == ip:
                return name
    return None


class RayExecutor(RankGroupExecutor):
    """The driver of N ranks in Ray actors (see the module docstring). Raises ``ValueError``
    before any actor starts for settings the group cannot run (a model that cannot be sharded,
    a cluster without the resources), and for a rank's ``ValueError`` at start-up, after
    stopping every actor it started."""

    def __init__(self, config: EngineConfig) -> None:
        from chassis.platforms import get_current_platform

        ray = import_ray()
        self.size = config.tensor_parallel_size
        if self.size > 1:
            config = self._group_config(config)
        self._broken = None
        self._ray = ray
        #: what the step watchdog found, once a step timed out (then raised for
        #: that step as :class:`StepTimeoutError`)
        self._timed_out: StepTimeout | None = None
        #: the ranks that have answered the command in flight (the watchdog reads it)
        self._answered: set[int] = set()
        self._watchdog = (
            StepWatchdog(config.execute_model_timeout_s, self._step_timed_out)
            if config.execute_model_timeout_s > 0
            else None
        )
        self._cluster = _Cluster(ray, self.size, get_current_platform().ray_resources())
        # Stop the actors when the engine is dropped without shutdown() (an LLM going away).
        self._finalizer = weakref.finalize(self, _stop, self._cluster, self._watchdog)
        try:
            self._cluster.start_actors()
            #: the ranks' actors, by rank
            self.actors: list[Any] = self._cluster.actors
            ips = self._cluster.ips
            port = ray.get(self.actors[0].free_port.remote())
            host = f"[{ips[0]}]" if ":" in ips[0] else ips[0]
            multi_node = len(set(ips)) > 1
            starts = [
                actor.start.remote(config, rank, f"tcp://{host}:{port}", multi_node)
                for rank, actor in enumerate(self.actors)
            ]
            (
                self._lora_shapes,
                self._dtype,
                self._kv_group_windows,
                self._kv_group_chunks,
            ) = self._gather("start", starts)[0]
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "ray: %d ranks ready on %d node(s), rendezvous on %s", self.size, len(set(ips)), host
        )

    def _run_on_all(self, method: str, payload: Any) -> list[Any]:
        self._refuse_if_broken()
        self._answered = set()
        if self._watchdog is not None:
            self._watchdog.arm(method)
        try:
            refs = [actor.run.remote(method, payload) for actor in self.actors]
            return self._gather(method, refs)
        finally:
            if self._watchdog is not None:
                self._watchdog.disarm()

    def _step_timed_out(self, method: str, _driver_thread: int) -> None:
        """The watchdog's expiry (in its thread): collect the stack of every rank that has
        not answered ``method`` (:meth:`_stacks`), log the report, break the group and kill
        every actor, so that the driver, waiting for the ranks' replies, gets their deaths
        and raises :class:`StepTimeoutError` (:meth:`_raise_if_timed_out`). Nothing when
        every rank has answered (the step completed as the time ran out)."""
        pending = [rank for rank in range(self.size) if rank not in self._answered]
        if not pending:
            return
        stacks = self._stacks(pending)
        assert self._watchdog is not None
        timeout = StepTimeout.of(method, self._watchdog.timeout_s, pending, stacks, self.size)
        logger.error("%s", timeout.report)
        self._timed_out, self._broken = timeout, timeout.broken
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray is gone
                logger.debug("ray: killing a rank failed", exc_info=True)

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stacks of ``ranks``' actors (:func:`dump_stacks`): read here for a rank
        on this node, by a task pinned to its node (no CPU asked: the ranks hold the
        bundles) for one elsewhere; a rank whose dump does not come is left out."""
        ray = self._ray
        here = ray.get_runtime_context().get_node_id()
        stacks: dict[int, str] = {}
        remote: dict[Any, int] = {}
        for rank in ranks:
            node, pid, fd = self._cluster.places[rank]
            if node != here:
                remote[dump_stacks_on(ray, node, pid, fd)] = rank
        for rank in ranks:  # (the remote dumps are being taken meanwhile)
            node, pid, fd = self._cluster.places[rank]
            if node == here:
                stacks[rank] = dump_stacks(pid, fd)
        if remote:
            ready, _ = ray.wait(
                list(remote), num_returns=len(remote), timeout=_REMOTE_DUMP_TIMEOUT_S
            )
            for ref in ready:
                try:
                    stacks[remote[ref]] = ray.get(ref)
                except ray.exceptions.RayError:
                    logger.debug("ray: a rank's stack dump failed", exc_info=True)
        return stacks

    def _raise_if_timed_out(self, cause: BaseException | None = None) -> None:
        """:class:`StepTimeoutError` once a step timed out (whatever failure the driver then
        saw: the killed actors): its message is the watchdog's summary, without the stacks,
        which the log has."""
        if self._timed_out is not None:
            self._broken = self._broken or "a step timed out"
            raise self._timed_out.error() from cause

    def model_dtype(self) -> torch.dtype:
        return self._dtype

    # local_device: None (the base's answer); every rank, rank 0 included, is an actor

    def check_health(self) -> None:
        if self._broken is not None:
            return
        ray = self._ray
        pings = {actor.ping.remote(): rank for rank, actor in enumerate(self.actors)}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=_HEALTH_TIMEOUT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise self._died(pings[ref], "idle", exc) from exc

    def shutdown(self) -> None:
        """Kill every actor, remove the placement group and close the Ray connection this
        executor opened (a local cluster it started stops with it)."""
        self._broken = self._broken or "it was shut down"
        self._finalizer()

    # -- replies ------------------------------------------------------------------------------

    def _gather(self, method: str, refs: list[Any]) -> list[Any]:
        """Every rank's result of ``method``, by rank, as the replies come. A rank's failure
        raises its error (``ValueError`` for a rank's ``ValueError``, else ``RuntimeError``),
        a dead actor raises naming its rank; either breaks the group."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(ref)
            try:
                ok, result = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._raise_if_timed_out(exc)  # the watchdog killed it
                raise self._died(rank, method, exc) from exc
            except ray.exceptions.RayError as exc:  # Ray could not run or return the call
                ok, result = False, f"{type(exc).__name__}: {exc}"
            if not ok:
                self._raise_if_timed_out()
                self._broken = f"rank {rank} failed"
                error = _rank_error(rank, result)
                # a killed rank makes the others fail their collectives: name it first
                self._raise_if_a_rank_died(pending, method, error)
                # the others' collectives with this rank fail at once (a failed process exits)
                ray.kill(self.actors[rank], no_restart=True)
                raise error
            results[rank] = result
            self._answered.add(rank)
        return [results[rank] for rank in range(len(refs))]

    def _raise_if_a_rank_died(self, pending: dict[Any, int], method: str, cause: Exception) -> None:
        """Raise :meth:`_died` for a rank among ``pending`` whose actor is found dead within a
        few seconds; nothing otherwise."""
        ray = self._ray
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_FAILURE_WAIT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                raise self._died(pending[ref], method, cause) from cause
            except ray.exceptions.RayError:
                continue

    def _died(self, rank: int, method: str, exc: BaseException) -> RuntimeError:
        """The error that names rank ``rank``'s dead actor; breaks the group."""
        self._broken = f"rank {rank} exited"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return RuntimeError(
            f"tensor-parallel rank {rank} exited (its Ray actor died: {reason}) during {method!r}"
        )


def _stop(cluster: _Cluster, watchdog: StepWatchdog | None) -> None:
    """What shutting the executor down (or dropping it) does: end the watchdog, stop the
    actors."""
    if watchdog is not None:
        watchdog.close()
    cluster.stop()


class _Cluster:
    """This executor's Ray connection, placement group and actors."""

    def __init__(self, ray: Any, size: int, bundle: dict[str, float]) -> None:
        self.ray = ray
        self.size = size
        self.bundle = dict(bundle)
        self.actors: list[Any] = []
        #: the node IP of each rank's actor, by rank
        self.ips: list[str] = []
        #: each rank's node id, process id and stack-dump descriptor (RankActor.locate)
        self.places: list[tuple[str, int, int]] = []
        self.placement_group: Any = None
        self.connected = _connect(ray)
        try:
            self._reserve()
        except BaseException:
            self.stop()
            raise

    def _reserve(self) -> None:
        """One bundle per rank, packed onto as few nodes as fit; ``ValueError`` when the
        cluster has not got them in all, or they do not come free in time."""
        from ray.util.placement_group import placement_group

        ray = self.ray
        total = ray.cluster_resources()
        for name, amount in self.bundle.items():
            if total.get(name, 0.0) < amount * self.size:
                raise ValueError(
                    f"--tensor-parallel-size {self.size} with Ray needs {amount * self.size:g} "
                    f"{name} (one bundle of {self.bundle} per rank); the Ray cluster has "
                    f"{total.get(name, 0.0):g}"
                )
        self.placement_group = placement_group([dict(self.bundle)] * self.size, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(
                f"the Ray cluster did not free {self.size} bundles of {self.bundle} within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s (free now: {ray.available_resources()})"
            ) from None

    def start_actors(self) -> None:
        """One :class:`RankActor` per bundle, ordered by rank: the driver's node first."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        resources = dict(self.bundle)
        options = {
            "num_cpus": resources.pop("CPU", 0.0),
            "num_gpus": resources.pop("GPU", 0.0),
            "resources": resources,
            "max_restarts": 0,
            "runtime_env": {"env_vars": _forwarded_env()},
        }
        remote = ray.remote(RankActor)
        level = logging.getLogger().getEffectiveLevel()
        actors = [
            remote.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=index
                ),
            ).remote(level)
            for index in range(self.size)
        ]
        self.actors = actors  # stop() kills them, whatever happens next
        try:
            located = ray.get([actor.locate.remote() for actor in actors])
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a rank's Ray actor did not start: {exc}") from exc
        ips = [ip for ip, *_ in located]
        here = ray.util.get_node_ip_address()
        order = sorted(range(self.size), key=lambda i: (ips[i] != here, ips[i], i))
        self.actors = [actors[i] for i in order]
        self.ips = [ips[i] for i in order]
        self.places = [tuple(located[i][1:]) for i in order]  # type: ignore[misc]

    def stop(self) -> None:
        """Kill the actors, remove the placement group, close the connection this executor
        opened. Idempotent (``weakref.finalize`` runs it once)."""
        global _connection_users
        ray = self.ray
        try:
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead, or Ray is gone
                    logger.debug("ray: killing a rank failed", exc_info=True)
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:
                    logger.debug("ray: removing the placement group failed", exc_info=True)
        finally:
            self.actors = []
            if self.connected:
                self.connected = False
                with _connection_lock:
                    _connection_users -= 1
                    if _connection_users == 0 and ray.is_initialized():
                        ray.shutdown()


def _connect(ray: Any) -> bool:
    """Connect this process to Ray unless it is already: to the cluster ``RAY_ADDRESS`` names
    or one running on this node, else to a new local one. True when this call connected (the
    last executor using the connection closes it)."""
    global _connection_users
    with _connection_lock:
        if _connection_users == 0 and ray.is_initialized():
            return False  # the caller's own connection: theirs to close
        if not ray.is_initialized():
            try:
                ray.init(address="auto", logging_level=logging.WARNING)
            except ConnectionError:
                if os.environ.get("RAY_ADDRESS"):
                    raise ValueError(
                        f"no Ray cluster answers at RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
                    ) from None
                logger.info("ray: no cluster running; starting a local one")
                ray.init(include_dashboard=False, logging_level=logging.WARNING)
        _connection_users += 1
        return True


def _forwarded_env() -> dict[str, str]:
    """The driver's settings the ranks must see too (platform choice, hub caches, the
    collectives' interfaces)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
