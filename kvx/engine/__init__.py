"""Transfer engine: asynchronous copies beside the model's compute, and the one rule that orders them.

**Copy queues.** Four queues, with one API on every device (:class:`TransferEngine`, made by :func:`make_engine`):

- ``load``: copies that write blocks (a load's reshape from its staging buffer, a DMA straight into blocks, a
  kernel copy into blocks): the forward waits for them layer by layer.
- ``save``: copies that read blocks (a save's gather into its staging buffer, ...): nothing waits for a save until
  its blocks are about to change.
- ``h2d``: a load's DMA from pinned host memory into its staging buffer (the copy engines; no SM);
- ``d2h``: a save's DMA from its staging buffer to pinned host memory.

The connector's copies are compiled plans (:mod:`kvx.kernels.plan`), issued by compiled code
(``csrc/plan/queues.h``: ``kvx._C.issue_load``, ``issue_save``, ``fence_range``), one call per layer: each engine
offers its queues to that code as :attr:`TransferEngine.queues` (``kvx._C.Queues``). A staged load leg is two jobs,
``h2d`` then ``load``; a staged save leg two, ``save`` then ``d2h``: with two streams per direction the DMA of one
leg overlaps the reshape of the previous one.

A job is ``fn(stream)``: ``stream`` is its queue's CUDA stream handle (an int, ``cudaStream_t``) on CUDA, None
elsewhere; the CUDA engine does not change torch's current stream (use :func:`on_stream` for torch ops in a job).
``marker()`` records an event on the compute stream; ``submit(after=...)`` makes the queue wait for markers and for
jobs of other queues; ``fence(job)`` makes the compute stream wait for a job; no host synchronisation on CUDA.

Three engines (``KVX_COPY_QUEUE`` picks on CPU, :func:`copy_queue_mode`), and a fourth for measurements; callers ask
their properties (:attr:`TransferEngine.layerwise`, :attr:`~TransferEngine.staged`,
:attr:`~TransferEngine.host_copies`), not a mode:

- :class:`CudaEngine` (a CUDA cache): the four queues are four side streams, driven by ``kvx._C.CudaQueues`` (each
  operation one CUDA API call, events from a pool).
- :class:`NullEngine` (the host-only benchmark): a CUDA engine's host work with nothing run, the CUDA API calls
  counted (``kvx._C.NullQueues``).
- :class:`ThreadEngine` (CPU default, ``KVX_COPY_QUEUE=thread``): one worker thread per queue; the forward runs
  on the host, so a marker is already passed when it is taken and a fence waits on the host. Host copies use the
  copy kernel (no staging: host memory is the cache's memory).
- :class:`DeferredEngine` (CPU, ``KVX_COPY_QUEUE=deferred``): GPU semantics on the CPU, stricter than a GPU, so a
  missing fence or edge shows up in CPU CI as wrong KV. It runs the CUDA code path (staging included, CPU memory
  standing in for the device's), and the compiled issue path itself: its queues (:class:`EngineQueues`) turn each
  operation that code issues into a job of the graph. Every job is a node of a happens-before graph: it follows the
  previous job of its queue and whatever it was submitted ``after``. Nothing runs when submitted:

  * a load-side job (``h2d``, ``load``) runs as *early* as its edges allow, at the engine's next observation
    point (a fence, a step's begin or forward end, :meth:`~TransferEngine.poll`), DMAs before reshapes: a load
    that is not ordered after the compute stream overwrites blocks an earlier forward still reads, and a DMA
    into a staging buffer that is not ordered after the reshape still reading it overwrites the bytes first;
  * a save-side job (``save``, ``d2h``) runs as *late* as allowed: when a fence or a host wait needs it, or else
    only once the *next* step's forward has written the cache (see :meth:`DeferredEngine.forward_done`), gathers
    before DMAs: a save that is not fenced before its blocks change reads the new owner's KV, and a gather into a
    staging buffer not ordered after the DMA still reading it overwrites the bytes first;
  * a load that is not fenced before the layer that reads it runs after that forward too: attention read stale
    blocks.

  The compute stream is the host (vLLM's CPU forward runs in ``execute_model``), so a fence runs the job and what
  it depends on at once. A simulated engine can instead put its forward on a virtual compute stream
  (:meth:`DeferredEngine.compute`): forwards then run lazily too, after every job fenced before them, which is how
  a test shows a load racing an earlier forward (a GPU's host running a step ahead).

**The rule** (:class:`BlockOrder`, used for every copy the connector makes):

1. A copy that writes blocks (a load) runs after every earlier use of them on the compute stream (a
   marker taken when it is submitted) and after every queued copy that reads them (the save of the
   request that held them before).
2. A copy that reads blocks (a save) runs after the forward that wrote them (a marker) and after every
   queued load into them.
3. Before a forward writes blocks, every queued copy that reads or writes them is fenced. The scheduler
   names those blocks in each step's metadata: the blocks the step computes and the blocks freed since
   the last step (``KVXMetadata.forward_blocks``), learned in the step that may reuse them, not later.
4. Before a forward reads loaded blocks, their load is fenced: per layer, in ``wait_for_layer_load``.
5. A staging buffer is reused only after every copy that read or wrote it completed: a copy that writes it (a
   load's DMA in, a save's gather) runs after its previous user of the other queue (a load's reshape, a save's
   DMA), which the compiled ring (``kvx._C.StagingRing``) hands out with the buffer (:meth:`BlockOrder.load_plan`,
   :meth:`BlockOrder.save_plan`). The ring is a fixed set of buffers taken in turn: a step larger than the budget
   waits on the device for a buffer, never on the host, and allocates nothing.

Rules 1, 2 and 5 for the legs of one plan, and rule 4, are kept by the compiled issue path; what crosses plans
and steps (the queued copies of each block, rule 3) is :class:`BlockOrder`'s, per step.

``Job.done()`` polls without blocking (a CUDA event query); ``Job.wait()`` blocks (off the per-step path);
an exception raised by a job is kept and re-raised by ``wait()`` / returned by ``error()``.

Modules: :mod:`.base` (jobs, the staging ring, the interface, :class:`EngineQueues`), :mod:`.engines` (the engines,
:func:`make_engine`), :mod:`.order` (:class:`BlockOrder`).
"""

from ..kernels.streams import on_stream, torch_stream
from .base import (
    COMPUTE,
    ENV,
    MODES,
    QUEUES,
    STAGING_BUFFERS,
    EngineQueues,
    Job,
    StagingRing,
    TransferEngine,
    copy_queue_mode,
)
from .engines import CudaEngine, DeferredEngine, NullEngine, ThreadEngine, make_engine
from .order import NOW, BlockOrder

__all__ = [
    "COMPUTE",
    "ENV",
    "MODES",
    "NOW",
    "QUEUES",
    "STAGING_BUFFERS",
    "BlockOrder",
    "CudaEngine",
    "DeferredEngine",
    "EngineQueues",
    "Job",
    "NullEngine",
    "StagingRing",
    "ThreadEngine",
    "TransferEngine",
    "copy_queue_mode",
    "make_engine",
    "on_stream",
    "torch_stream",
]
