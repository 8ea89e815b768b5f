"""The trainer's watch over its own collectives: all-to-all time, fingerprints, timeouts that say who.

One `CommWatch` per trainer (not per process: it is built from the run's config and meshes and
passed around; nothing global outlives a step). While a step runs inside `watch.step(...)`, the
collectives that dropless issues itself (the EP all-to-alls of distributed/comm.py, forward and
backward, and the data-parallel reductions of distributed/parallelize.py) go through `watch.run`:

- **All-to-all time.** On the CPU (gloo: a blocking call) the host clock around the call, which
  includes waiting for the slowest peer: the time the step lost to the exchange. On CUDA (NCCL)
  an event pair on the current stream around each call, read only when the log interval asks for
  the figure (`take_a2a_ms`, at the log step's existing sync): no new host sync inside a step.
- **Fingerprints** (`parallel.check_collectives`): every watched collective is recorded before it
  is issued (fingerprint.py: op, the group's role and size, dtype and shape into a running digest;
  the last 256 kept). At check steps the ranks compare digests through the rendezvous store,
  outside every process group, so a rank that is one collective ahead or behind cannot make the
  comparison itself hang or pair up wrongly; a difference raises `CollectiveMismatchError` on every rank, naming the first
  collective where the ranks differ.
- **Timeouts** (`parallel.collective_timeout_s`): set on every process group of the run (the
  default group and the mesh's), so a collective a peer never joins fails after that time instead of
  waiting forever (gloo: an error; NCCL: the watchdog aborts the communicator). The error alone
  names no rank; the watch catches it when it came from a watched collective (the one in flight) and
  every rank posts its report to the store ("abort" round); ranks waiting at a check join it. The
  error then names the ranks that did not arrive, the first divergence and where each rank is.
  Collectives issued inside torch (FSDP's all-gathers and reduce-scatters) get the timeout but are
  not fingerprinted: a hang there reports the ranks and their last watched collective.

The watch is found by comm.py through a context variable set by `step()`; the autograd functions keep
it in their context, so the backward all-to-alls (on CUDA: in autograd's device thread) are watched
by the step that ran the forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .fingerprint import CollectiveLog, Entry, divergence

if TYPE_CHECKING:
    from ..config import ParallelConfig
    from .mesh import Meshes

_CURRENT: contextvars.ContextVar["CommWatch | None"] = contextvars.ContextVar("dropless_comm_watch", default=None)
_POLL_S = 0.02
# the collectives whose time is the EP exchange's (the all-to-alls, the ring dispatch's gather and scatter)
TIMED = ("all_to_all", "all_gather", "reduce_scatter")


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives, or a collective timed out: the message says which and where."""


def current() -> "CommWatch | None":
    """The watch of the step running on this thread (None outside a watched step)."""
    return _CURRENT.get()


class CommWatch:
    def __init__(self, groups: dict[str, ProcessGroup | None], device: torch.device, *, check: bool = False,
                 timeout_s: float = 0.0, store: dist.Store | None = None, keep: int = 256) -> None:
        """`groups`: role name -> process group (None: the default group), for the logs. `timeout_s`
        > 0 sets that timeout on every group given and the default group; `check` records
        fingerprints and compares them at `step(check=True)`."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device, self.check, self.timeout_s = device, check, timeout_s
        self._roles = {self._name(g): (role, tuple(dist.get_process_group_ranks(g) if g is not None
                                                   else range(self.world))) for role, g in groups.items()}
        self.log = CollectiveLog(keep)
        self._store, self._prefixed = store, None  # the rendezvous store: looked up when first needed
        self.in_flight: Entry | None = None
        self.cur_step, self._rounds, self._steps = 0, 0, 0
        self._a2a_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        if timeout_s > 0:
            for g in {None, *groups.values()}:
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), g)

    @staticmethod
    def _name(group: ProcessGroup | None) -> str:
        return "" if group is None else group.group_name

    # -- the hook comm.py calls -----------------------------------------------------------------------

    def run(self, op: str, group: ProcessGroup | None, x: torch.Tensor, issue: Callable[[], object],
            splits: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        """Record (check mode), time (all-to-alls) and issue one blocking collective."""
        self._enter(op, group, x, splits)
        timed = op in TIMED
        if timed and x.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            issue()
            end.record()
            self._events.append((start, end))
        elif timed:
            t0 = time.perf_counter()
            issue()
            self._a2a_s += time.perf_counter() - t0
        else:
            issue()
        self.in_flight = None

    def run_async(self, op: str, group: ProcessGroup | None, x: torch.Tensor, issue: Callable[[], Any],
                  splits: tuple[Sequence[int], Sequence[int]] | None = None) -> Callable[[], None]:
        """Record and issue one `async_op=True` collective (`issue` returns its Work); returns the
        wait. Recorded at the issue (every rank issues in the same order); `in_flight` again while
        waiting, so a timeout in the wait names it. Time: on the CPU the host time blocked in the
        issue and in the wait (what the step lost to the exchange, not the overlapped part); on CUDA
        events from the issue to the end of the wait (the current stream then waits on NCCL's), so
        the figure includes the overlapped span."""
        entry = self._enter(op, group, x, splits)
        timed, cuda = op in TIMED, x.device.type == "cuda"
        start = None
        if timed and cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        work = issue()
        if timed and not cuda:
            self._a2a_s += time.perf_counter() - t0
        self.in_flight = None

        def wait() -> None:
            self.in_flight = entry
            t1 = time.perf_counter()
            work.wait()
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((start, end))
            elif timed:
                self._a2a_s += time.perf_counter() - t1
            self.in_flight = None
        return wait

    def _enter(self, op: str, group: ProcessGroup | None, x: torch.Tensor,
               splits: tuple[Sequence[int], Sequence[int]] | None) -> Entry:
        role, ranks = self._roles.get(self._name(group), ("other", ()))
        shape = tuple(x.shape[1:]) + (len(splits[0]),) if splits is not None else tuple(x.shape)
        dtype = str(x.dtype).removeprefix("torch.")
        if self.check:
            self.in_flight = self.log.record(op, role, ranks, dtype, shape, self.cur_step,
                                             *(splits if splits is not None else (None, None)))
        else:  # not recorded, but a failure can still say which collective it was
            self.in_flight = Entry(-1, self.cur_step, op, role, ranks, dtype, shape)
        return self.in_flight

    # -- per step ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, step: int, check: bool = False) -> Iterator[None]:
        """Watch one training step; with `check` (and check mode on) compare fingerprints at its end."""
        self.cur_step = step
        token = _CURRENT.set(self)
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, CollectiveMismatchError) or not (self.in_flight is not None or _collective_error(err)):
                raise  # not from a collective: not ours to explain
            flight, self.in_flight = self.in_flight, None
            message = self._abort(f"a collective failed ({str(err).splitlines()[0][:200]})", flight)
            raise CollectiveMismatchError(message) from err
        finally:
            _CURRENT.reset(token)
        self._steps += 1
        if check and self.check:
            self.compare(f"the check of step {step}")

    def take_a2a_ms(self) -> torch.Tensor:
        """Mean all-to-all milliseconds per watched step since the last call, as a float64 tensor on
        the trainer's device (for the max over ranks); restarts the interval. Reads the CUDA events:
        call it where the host syncs anyway (the log step)."""
        ms = self._a2a_s * 1e3
        for start, end in self._events:
            end.synchronize()
            ms += start.elapsed_time(end)
        steps = max(self._steps, 1)
        self._a2a_s, self._events, self._steps = 0.0, [], 0
        return torch.tensor(ms / steps, dtype=torch.float64, device=self.device)

    # -- comparing through the store ------------------------------------------------------------------

    def compare(self, where: str) -> None:
        """All ranks post (count, digest) under this round's key; only when they differ does every
        rank post and read the recent logs. A difference, a rank that never posts, or another rank's
        abort raises `CollectiveMismatchError` on every rank."""
        tag = f"c{self._rounds}"
        self._rounds += 1
        small = {"rank": self.rank, "step": self.cur_step, "count": self.log.count, "digest": self.log.digest,
                 "where": where, "in_flight": None, "recent": []}
        reports = self._gather(tag, small)
        if reports is None:  # another rank aborted: join it
            raise CollectiveMismatchError(self._join_abort(self.log.report(self.rank, self.cur_step, where, None)))
        if self._rounds > 1:
            self.store.delete_key(f"c{self._rounds - 2}/{self.rank}")  # every rank has read it
        if len(reports) == self.world and len({(r["count"], r["digest"]) for r in reports.values()}) == 1:
            return
        if len(reports) == self.world:  # they differ: the logs name where
            reports = self._gather(f"{tag}-log", self.log.report(self.rank, self.cur_step, where, None)) or reports
        raise CollectiveMismatchError(divergence(reports, range(self.world), self._deadline_s())
                                      or "fingerprints differ")

    def _abort(self, what: str, flight: Entry | None) -> str:
        where = f"a failed collective the watch does not see (FSDP's?) in step {self.cur_step}"
        report = self.log.report(self.rank, self.cur_step, where, flight)
        return f"{what} on rank {self.rank}; " + self._join_abort(report)

    def _join_abort(self, report: dict) -> str:
        self.store.add("aborted", 1)  # ranks polling at a check see it in one read
        reports = self._gather("abort", report, abortable=False) or {}
        return (divergence(reports, range(self.world), self._deadline_s())
                or "every rank reported the same collectives and none waits")

    @property
    def store(self) -> dist.Store:
        if self._prefixed is None:
            self._prefixed = dist.PrefixStore("dropless-watch", self._store or _default_store())
        return self._prefixed

    def _deadline_s(self) -> float:
        # A peer stuck in a collective can report only once that collective times out, up to one
        # timeout after this rank got here: wait two (without a timeout set: the backend's default
        # is 10-30 minutes, so a check waits at most 2 minutes and names whoever is missing).
        return 2 * self.timeout_s if self.timeout_s > 0 else 120.0

    def _gather(self, tag: str, report: dict, abortable: bool = True) -> dict[int, dict] | None:
        """Every rank's report of round `tag`, waiting up to the timeout; the ranks that did not post
        are left out. None when another rank posted an abort meanwhile (and `abortable`)."""
        self.store.set(f"{tag}/{self.rank}", json.dumps(report))
        keys = [f"{tag}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + self._deadline_s()
        while not self.store.check(keys) and time.monotonic() < deadline:  # one read per poll
            if abortable and self.store.add("aborted", 0) > 0:
                return None
            time.sleep(_POLL_S)
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}


def _collective_error(err: RuntimeError) -> bool:
    """A failure of a collective issued inside torch (FSDP's), which the watch did not see go out:
    NCCL raises `DistError`s; gloo a plain RuntimeError whose text says it timed out, or that the
    peer closed the connection (a peer whose own watch timed out first and left: on a loaded machine
    its timer can fire before this rank's, and this rank must still join the abort and explain)."""
    text = str(err)
    return isinstance(err, dist.DistError) or "Timed out waiting" in text or "Connection closed by peer" in text


def _default_store() -> dist.Store:
    # The rendezvous store every rank already shares (TCPStore under torchrun, a FileStore in the
    # tests): a channel that does not depend on the process groups agreeing on their next collective.
    return dist.distributed_c10d._get_default_store()


def build_watch(meshes: "Meshes | None", device: torch.device, cfg: "ParallelConfig") -> CommWatch | None:
    """The trainer's watch over the run's groups (None without a process group)."""
    if meshes is None:
        return None
    groups = {"ep": meshes.ep_group, "edp": meshes.mesh.get_group("edp"), "dp": meshes.dp_group}
    return CommWatch(groups, device, check=cfg.check_collectives, timeout_s=cfg.collective_timeout_s)


@contextlib.contextmanager
def watch_step(watch: CommWatch | None, step: int, check: bool = False) -> Iterator[None]:
    """`watch.step(step, check)`, or nothing when the run has no watch (one process)."""
    if watch is None:
        yield
        return
    with watch.step(step, check):
        yield
