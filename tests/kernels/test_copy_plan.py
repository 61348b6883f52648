"""The compiled plan and its issue path (``csrc/plan``): what a leg issues, in what order, on which queue; the
calls a CUDA engine would make, counted; the plan's run lists against the kernels' own; its errors."""

import pytest
import torch

from kvx._ext import C as _C
from kvx.kernels import ops
from kvx.kernels.layout import Op, c_descs, copy_geometry
from kvx.kernels.plan import Copies
from kvx.testing import make_layout, random_fill_

LOAD, SAVE, H2D, D2H, COMPUTE = range(5)


def _lay(layers=4):
    return make_layout(
        "LBNHC", num_layers=layers, num_blocks=12, block_size=16, num_heads=2, head_size=8, dtype=torch.bfloat16
    )


def _plan(lay, op="scatter_blocks", n_chunks=2, path="staged", ranges=None, capacity=1 << 20):
    g = torch.Generator().manual_seed(3)
    copies = Copies(lay, path=path, sm_count=132)
    for c in range(n_chunks):
        buf = random_fill_(torch.empty(lay.canonical_shape(2 * lay.block_size), dtype=lay.dtype), g)
        copies.add(op, [2 * c + 1, 2 * c + 2], buf)
    ranges = ranges if ranges is not None else [(layer, layer + 1) for layer in range(lay.num_layers)]
    return copies.plan(ranges, capacity)


class Recorder(_C.Queues):
    """Queues that record each operation the compiled issue path makes (a Python engine's queues do the same)."""

    def __init__(self):
        super().__init__()
        self.log, self.n = [], 0

    def record(self, queue):
        self.n += 1
        ev = _C.Event.of(f"e{self.n}")
        self.log.append(("record", queue, f"e{self.n}"))
        return ev

    def wait(self, queue, event):
        self.log.append(("wait", queue, event.payload))

    def dma(self, queue, plan, leg, staging):
        self.log.append(("dma", queue, leg, staging))

    def reshape(self, queue, plan, leg, staging):
        self.log.append(("reshape", queue, leg, staging))


def test_a_staged_load_leg_is_a_dma_then_its_reshape_ordered_by_the_ring():
    """Leg k: the DMA into the ring's next buffer on h2d, after the reshape that last read that buffer (rule 5);
    the reshape on load after the DMA and, for the first leg only, after the plan's edges (rule 1)."""
    plan = _plan(_lay(3))
    ring = _C.StagingRing([1 << 20, 2 << 20], 1 << 20)
    q = Recorder()
    _C.issue_load(q, plan, ring, 0, plan.num_legs, [_C.Event.of("marker")])
    assert q.log == [
        ("dma", H2D, 0, 1 << 20),
        ("record", H2D, "e1"),
        ("wait", LOAD, "marker"),
        ("wait", LOAD, "e1"),
        ("reshape", LOAD, 0, 1 << 20),
        ("record", LOAD, "e2"),
        ("dma", H2D, 1, 2 << 20),
        ("record", H2D, "e3"),
        ("wait", LOAD, "e3"),
        ("reshape", LOAD, 1, 2 << 20),
        ("record", LOAD, "e4"),
        ("wait", H2D, "e2"),  # buffer 1 again: after leg 0's reshape read it
        ("dma", H2D, 2, 1 << 20),
        ("record", H2D, "e5"),
        ("wait", LOAD, "e5"),
        ("reshape", LOAD, 2, 1 << 20),
        ("record", LOAD, "e6"),
    ]
    assert [plan.touched(k).payload for k in range(3)] == ["e2", "e4", "e6"]
    q.log.clear()
    _C.fence_range(q, plan, 1)  # rule 4: the compute stream waits for layer 1's leg
    assert q.log == [("wait", COMPUTE, "e4")]


def test_a_staged_save_takes_its_marker_and_a_layer_at_a_time():
    """A save's range: a marker on the compute stream now (rule 2), the gather on save after it and after the DMA
    that last emptied the buffer (rule 5), then its DMA on d2h after the gather."""
    plan = _plan(_lay(3), "gather_blocks")
    ring = _C.StagingRing([1 << 20, 2 << 20], 1 << 20)
    q = Recorder()
    for r in range(3):
        _C.issue_save_range(q, plan, ring, r, [_C.Event.of("load")] if r == 0 else [], True)
    gathers = [e for e in q.log if e[0] == "reshape"]
    assert [e[1] for e in gathers] == [SAVE] * 3 and [e[0] for e in q.log[:3]] == ["record", "wait", "wait"]
    assert q.log[:3] == [("record", COMPUTE, "e1"), ("wait", SAVE, "e1"), ("wait", SAVE, "load")]
    leg2 = q.log[q.log.index(("record", COMPUTE, "e7")) :]
    assert leg2[:3] == [("record", COMPUTE, "e7"), ("wait", SAVE, "e7"), ("wait", SAVE, "e3")]  # buffer 1's DMA
    assert ("wait", D2H, "e8") in leg2 and ("dma", D2H, 2, 1 << 20) in leg2
    assert plan.touched(2).payload == "e8" and plan.done(2).payload == "e9"


def test_null_queues_count_what_a_cuda_engine_calls():
    """Per layer of a staged load: a batched DMA and a launch, two records, the waits; the id table's upload once."""
    lay = _lay(4)
    plan = _plan(lay, n_chunks=2)
    q = _C.NullQueues()
    ring = _C.StagingRing([1 << 20, 2 << 20], 1 << 20)
    _C.issue_load(q, plan, ring, 0, plan.num_legs, [_C.Event()])
    assert (q.dma_calls, q.launches, q.records, q.uploads) == (4, 4, 8, 2)
    assert q.waits == 1 + 4 + 2  # the edge, each reshape after its DMA, legs 2 and 3 after their buffer's reshape
    assert all(launch["ctas"] > 0 for k in range(plan.num_legs) for launch in plan.launches(k))
    q.reset()
    for r in range(plan.num_ranges):
        _C.fence_range(q, plan, r)
    assert q.total == q.waits == 4


def test_the_dma_path_runs_are_the_kernels_run_lists_layer_by_layer():
    """Path dma: a leg's runs are kv_layout.h's plan_runs of each copy (the function the CUDA DMA path issues),
    layer by layer, merged where they continue each other."""
    lay = _lay(2)
    buf = torch.empty(lay.page_shape(3), dtype=torch.uint8)
    copies = Copies(lay, path="dma")
    copies.add("gather_pages", [4, 5, 9], buf)  # blocks 4 and 5: adjacent pages, one run
    plan = copies.plan([(0, 1), (1, 2)])
    for layer in range(2):
        dst, src, size = plan.runs(layer)
        sub = lay.layer_range(layer, layer + 1)
        ids = torch.tensor([4, 5, 9])
        view = buf.narrow(0, layer, 1)
        geo = copy_geometry(Op.GATHER_PAGES, sub, view, 3)
        paged, contig = c_descs(geo)
        want = _C.plan_runs(
            layer_ptrs=sub.layer_ptrs().data_ptr(),
            num_layers=1,
            ids=ids.data_ptr(),
            num_ids=3,
            contig=view.data_ptr(),
            paged=paged,
            contig_strides=contig,
            row_bytes=geo.row_bytes,
            mode=geo.mode,
            direction=0,
        )
        assert (dst.tolist(), src.tolist(), size.tolist()) == tuple(a.tolist() for a in want)
    assert len(plan.runs(0)[2]) == 2  # blocks 4-5 merged, block 9


def test_issue_and_plan_errors_name_what_is_wrong():
    lay = _lay(2)
    plan = _plan(lay, n_chunks=1)
    q = _C.NullQueues()
    with pytest.raises(ValueError, match="ring: path staged needs a staging ring, got none"):
        _C.issue_load(q, plan, None, 0, 1, [])
    with pytest.raises(ValueError, match="ring: a leg of 2048 bytes exceeds the ring's buffers of 1024"):
        _C.issue_load(q, plan, _C.StagingRing([1 << 20], 1024), 0, 1, [])
    with pytest.raises(IndexError, match=r"legs: expected 0 <= lo <= hi <= 2, got 1, 3"):
        _C.issue_load(q, plan, _C.StagingRing([1 << 20], 1 << 20), 1, 3, [])
    with pytest.raises(IndexError, match=r"range: expected 0 <= range < 2, got 2"):
        _C.fence_range(q, plan, 2)
    copies = Copies(lay, path="staged")
    copies.add("gather_blocks", [1])
    with pytest.raises(ValueError, match=r"capacity: expected at least 1024 bytes \(one block of one layer"):
        copies.plan(capacity=1000)
    with pytest.raises(RuntimeError, match="build: the plan is built already"):
        copies.plan(capacity=1024).build(2, [(0, 2)], 1024, 0, 0, 0)


def test_an_empty_set_plans_no_leg_and_runs_nothing():
    lay = _lay(2)
    copies = Copies(lay, path="staged")
    plan = copies.plan([(0, 1), (1, 2)], 1 << 20)
    assert plan.num_legs == 0 and plan.range_legs(1) == (0, 0)
    q = _C.NullQueues()
    _C.issue_load(q, plan, None, 0, 0, [])
    _C.fence_range(q, plan, 0)
    assert q.total == 0
    assert ops.gather_blocks(lay, []).shape == lay.canonical_shape(0)
