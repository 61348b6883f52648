"""The ordering rule between copies and forwards, per block: :class:`BlockOrder` (see :mod:`kvx.engine`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from .._ext import C as _C
from .base import Job, TransferEngine

NOW = object()  # save_edges' marker taken by the compiled code that issues the copy, right then
_NO_EDGES: list = []


class BlockOrder:
    """The ordering rule between copies and forwards, per block (see the module docstring). Owned by one
    worker and used from its thread only."""

    def __init__(self, engine: TransferEngine):
        self.engine = engine
        self._readers: dict[int, list[Job]] = {}  # block -> queued saves reading it
        self._writers: dict[int, list[Job]] = {}  # block -> queued loads writing it
        self._since_prune = 0

    def load_edges(self, blocks: Sequence[int], marker=None) -> list:
        """Rule 1: what a copy writing ``blocks`` runs after: the compute stream's last use of them (``marker``,
        taken now if None) and every queued copy reading them."""
        return [marker if marker is not None else self.engine.marker(), *self._live(self._readers, blocks)]

    def save_edges(self, blocks: Sequence[int], marker=None, loads: bool = True) -> list:
        """Rule 2: what a copy reading ``blocks`` runs after: the forward that wrote them (``marker``, taken right
        after it; now if None; :data:`NOW`: by the compiled code issuing the copy) and (``loads``) every queued load
        into them."""
        edges = [marker if marker is not None else self.engine.marker()]
        return edges + self._live(self._writers, blocks) if loads else edges

    def load(self, blocks: Sequence[int], fn: Callable, name: str = "", marker=None) -> Job:
        """One copy ``fn(stream)`` that writes ``blocks``, on the ``load`` queue (rule 1)."""
        job = self.engine.submit(fn, queue="load", after=self.load_edges(blocks, marker), name=name)
        self._note(self._writers, blocks, job)
        return job

    def save(self, blocks: Sequence[int], fn: Callable, name: str = "", marker=None) -> Job:
        """One copy ``fn(stream)`` that reads ``blocks``, on the ``save`` queue (rule 2)."""
        job = self.engine.submit(fn, queue="save", after=self.save_edges(blocks, marker), name=name)
        self._note(self._readers, blocks, job)
        return job

    def load_plan(self, blocks: Sequence[int], plan, marker=None) -> Job | None:
        """Issue every leg of a load plan that writes ``blocks`` (:mod:`kvx.kernels.plan`), in compiled code: rule 1
        once for them all (one marker, the queued saves reading any of the blocks), rule 5 per staged leg (the
        engine's load ring). Only the last leg's job is recorded against the blocks: the load queue runs the legs
        in order, so fencing it (rule 3) fences them all. Returns that job (None: the plan has no leg)."""
        n = plan.num_legs
        if not n:
            return None
        eng = self.engine
        ring = eng.ring("load").c if plan.staged else None
        _C.issue_load(eng.queues, plan, ring, 0, n, [eng.event_of(e) for e in self.load_edges(blocks, marker)])
        job = eng.job_of(plan.touched(n - 1), getattr(plan, "name", ""), "load")
        self._note(self._writers, blocks, job)
        return job

    def save_plan(self, blocks: Sequence[int], plan, r: int, first: bool = True, last: bool = True) -> Job | None:
        """Issue the legs of layer range ``r`` of a save plan that reads ``blocks``, in compiled code, right after the
        forward wrote them: rule 2 (a marker the compiled code takes now and, with ``first``, the queued loads into
        any of the blocks), rule 5 per staged leg (the save ring). A plan issued range by range (a step's saves,
        layer by layer): ``first`` for its first call, which decides its edges once (the save queue runs the later
        calls after it), ``last`` for the one whose reading job is recorded against the blocks (rule 3 fences it, and
        the legs before it are ahead of it on the save queue). Returns the range's last reading job (None: not
        ``last``, or no leg)."""
        eng = self.engine
        if first:
            eng.sync_compute()  # the marker's stream: the one the plan's id table was uploaded on (CUDA)
            edges = self.save_edges(blocks, NOW)
            plan.marker = any(e is NOW for e in edges)  # each range takes its own marker (rule 2)
            after = [eng.event_of(e) for e in edges if e is not NOW]
            plan.ring = eng.ring("save").c if plan.staged else None
        else:
            after = _NO_EDGES
        _C.issue_save_range(eng.queues, plan, plan.ring, r, after, plan.marker)
        if not last:
            return None
        lo, hi = plan.range_legs(r)
        job = eng.job_of(plan.touched(hi - 1), getattr(plan, "name", ""), "save") if hi > lo else None
        if job is not None:
            self._note(self._readers, blocks, job)
        return job

    def before_forward(self, blocks: Iterable[int]) -> list[BaseException]:
        """Rule 3: fence every queued copy that reads or writes ``blocks``. Returns the errors of fenced jobs
        (the caller reports them where it reports the job)."""
        errors, seen = [], set()
        for table in (self._readers, self._writers):
            for b in blocks:
                for job in table.pop(b, ()):
                    if id(job) in seen or job.done():
                        continue
                    seen.add(id(job))
                    try:
                        self.engine.fence(job)
                    except Exception as e:  # noqa: BLE001 - kept by the job too
                        errors.append(e)
        return errors  # finished jobs of other blocks are forgotten every 256 notes (_note), not every step

    def pending(self) -> int:
        """Queued copies not finished, counted once per block they touch."""
        return sum(not j.done() for table in (self._readers, self._writers) for jobs in table.values() for j in jobs)

    @staticmethod
    def _live(table: dict[int, list[Job]], blocks: Sequence[int]) -> list[Job]:
        out, seen = [], set()
        for b in blocks:
            for job in table.get(b, ()):
                if id(job) not in seen and not job.done():
                    seen.add(id(job))
                    out.append(job)
        return out

    def _note(self, table: dict[int, list[Job]], blocks: Sequence[int], job: Job) -> None:
        # the block's last job of the table's queue stands for the earlier ones: every writer runs on the load queue
        # and every reader on the save queue, each in order, so fencing it fences them (and the table stays a job
        # per block, however often a block is copied before a forward writes it)
        for b in blocks:
            table[b] = [job]
        self._since_prune += 1
        if self._since_prune >= 256:
            self._prune()

    def _prune(self) -> None:
        """Forget finished jobs (bounded memory: blocks that are saved and never written again)."""
        self._since_prune = 0
        for table in (self._readers, self._writers):
            for b in [b for b, jobs in table.items() if all(j.done() for j in jobs)]:
                del table[b]
