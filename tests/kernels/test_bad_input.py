"""One test per bad input: each is refused with a ValueError/TypeError that names the argument."""

import re

import pytest
import torch

from kvx.kernels import ops
from kvx.kernels.layout import KVLayout
from kvx.kernels.plan import Copies
from kvx.testing import make_kv_caches, make_layout
from tests.helpers import assert_all_same_bytes, assert_same_bytes

GEOM = dict(num_layers=2, num_blocks=6, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)


@pytest.fixture
def lay():
    return make_layout("LBNHC", **GEOM)


def test_block_id_out_of_range(lay):
    with pytest.raises(ValueError, match=r"block_ids: expected block ids in \[0, 6\), got max 6"):
        ops.gather_blocks(lay, [0, 6])


def test_negative_block_id(lay):
    with pytest.raises(ValueError, match=r"block_ids: .* got min -1"):
        ops.gather_blocks(lay, [-1, 2])


def test_slot_id_out_of_range(lay):
    with pytest.raises(ValueError, match=r"slot_ids: expected slot ids in \[0, 96\)"):
        ops.gather_slots(lay, [3, 96])


def test_duplicate_block_ids_in_scatter(lay):
    src = torch.zeros(lay.canonical_shape(32), dtype=torch.float16)
    with pytest.raises(ValueError, match="block_ids: expected distinct block ids"):
        ops.scatter_blocks(lay, [1, 1], src)


def test_duplicate_slot_ids_in_scatter(lay):
    src = torch.zeros(lay.canonical_shape(3), dtype=torch.float16)
    with pytest.raises(ValueError, match="slot_ids: expected distinct slot ids"):
        ops.scatter_slots(lay, [5, -1, 5], src)


def test_repeated_padding_slots_are_fine(lay):
    src = torch.ones(lay.canonical_shape(3), dtype=torch.float16)
    ops.scatter_slots(lay, [-1, 4, -1], src)
    assert_same_bytes(ops.gather_slots(lay, [4])[:, :, 0], src[:, :, 1])


def test_wrong_dtype_out(lay):
    out = torch.empty(lay.canonical_shape(16), dtype=torch.float32)
    with pytest.raises(TypeError, match=r"out: expected dtype torch.float16 .* got torch.float32"):
        ops.gather_blocks(lay, [0], out)


def test_wrong_shape_src(lay):
    src = torch.empty(lay.canonical_shape(15), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"src: expected shape \(2, 2, 16, 2, 8\) .* got \(2, 2, 15, 2, 8\)"):
        ops.scatter_blocks(lay, [0], src)


def test_wrong_device_out(lay):
    out = torch.empty(lay.canonical_shape(16), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="out: expected a CPU tensor for a CPU cache, got meta"):
        ops.gather_blocks(lay, [0], out)


def test_non_dense_rows(lay):
    out = torch.empty(*lay.canonical_shape(16)[:-1], 16, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="out: expected rows contiguous"):
        ops.gather_blocks(lay, [0], out)


def test_output_overlapping_itself(lay):
    out = torch.empty(2, 1, 16, 2, 8, dtype=torch.float16).expand(lay.canonical_shape(16))
    with pytest.raises(ValueError, match="out: its elements overlap in memory"):
        ops.gather_blocks(lay, [0], out)


def test_output_overlapping_the_cache():
    caches = make_kv_caches("flash", **GEOM)
    lay = KVLayout.from_tensors(caches, "flash")
    alias = caches[1].view(-1)[: 2 * 2 * 16 * 2 * 8].view(lay.canonical_shape(16))
    with pytest.raises(ValueError, match=r"out: overlaps the paged KV cache \(layer.1\)"):
        ops.gather_blocks(lay, [3], alias)


def test_ids_wrong_type(lay):
    with pytest.raises(TypeError, match="block_ids: expected an integer tensor, got torch.float32"):
        ops.gather_blocks(lay, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="block_ids: expected integers"):
        ops.gather_blocks(lay, [1.5])
    with pytest.raises(TypeError, match="block_ids: expected a CPU integer tensor or a sequence of ints"):
        ops.gather_blocks(lay, "12")


def test_ids_wrong_shape_and_device(lay):
    with pytest.raises(ValueError, match=r"block_ids: expected a 1-D tensor, got shape \(1, 2\)"):
        ops.gather_blocks(lay, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="block_ids: expected a CPU tensor or a sequence of ints"):
        ops.gather_blocks(lay, torch.tensor([1], device="meta"))


def test_unknown_impl(lay):
    with pytest.raises(
        ValueError,
        match=r"impl: expected one of \('reference', 'cpu', 'triton', 'cuda', "
        r"'cuda_sim'\)",
    ):
        ops.gather_blocks(lay, [0], impl="magic")


def test_impl_that_cannot_run_here(lay):
    with pytest.raises(ValueError, match="impl: 'cuda' cannot run for a cache on cpu"):
        ops.gather_blocks(lay, [0], impl="cuda")


def test_not_a_layout():
    with pytest.raises(TypeError, match="layout: expected a kvx.kernels.layout.KVLayout, got Tensor"):
        ops.gather_blocks(torch.zeros(4), [0])


def test_scatter_without_src(lay):
    with pytest.raises(TypeError, match="src: expected a tensor to scatter, got None"):
        ops.scatter_blocks(lay, [0], None)


def test_negative_max_ctas(lay):
    with pytest.raises(ValueError, match="max_ctas: expected an int >= 0"):
        ops.gather_blocks(lay, [0], max_ctas=-1)


def test_unknown_path(lay):
    with pytest.raises(
        ValueError, match=r"path: expected one of \('kernel', 'dma', 'staged', 'auto'\) or None, got 'fast'"
    ):
        ops.gather_blocks(lay, [0], path="fast")


def test_path_kernel_runs_the_chosen_impls_kernel(lay):
    """On a CPU cache every path runs its CPU twin: ``kernel`` is the chosen implementation between buffer and blocks
    (on a CUDA cache, the copy kernel over device or mapped host memory)."""
    for impl in ("reference", "cpu"):
        assert_same_bytes(ops.gather_blocks(lay, [2, 0], impl=impl, path="kernel"), ops.gather_blocks(lay, [2, 0]))


def test_staging_only_with_the_staged_path(lay):
    out = torch.zeros(lay.canonical_shape(16), dtype=torch.float16)
    staging = torch.empty(1 << 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="staging: only path 'staged' .* uses a staging buffer, got path 'dma'"):
        ops.gather_blocks(lay, [0], out, path="dma", staging=staging)
    with pytest.raises(TypeError, match="staging: expected a uint8 tensor on cpu, got list"):
        ops.gather_blocks(lay, [0], out, path="staged", staging=[0] * 8)
    with pytest.raises(ValueError, match="staging: expected a contiguous uint8 tensor on cpu, got torch.float16"):
        ops.gather_blocks(lay, [0], out, path="staged", staging=torch.empty(1 << 15, dtype=torch.float16))
    block = lay.num_planes * lay.block_size * lay.num_heads * lay.row_bytes
    with pytest.raises(ValueError, match=rf"staging: expected at least {block} bytes \(one block of one layer"):
        ops.gather_blocks(lay, [0], out, path="staged", staging=staging[: block - 1])


def test_opaque_cpu_backend_pages_refuse_tokens():
    lay = make_layout("cpu", **GEOM)
    with pytest.raises(ValueError, match="layout: 'cpu' pages are packed by the attention backend"):
        ops.gather_slots(lay, [0, 1])
    with pytest.raises(ValueError, match="layout: 'cpu' pages are packed by the attention backend"):
        ops.gather_blocks(lay, [0])
    pages = ops.gather_pages(lay, [2, 0])  # whole pages are fine
    assert_same_bytes(pages, ops.gather_pages(lay, [2, 0], impl="reference"))


def test_pages_need_a_dense_page():
    lay = make_layout("LBNHC", **GEOM, padded=True)  # padding inside rows
    with pytest.raises(ValueError, match="layout: 'LBNHC' .* has no contiguous page per block"):
        ops.gather_pages(lay, [0])


def test_pages_split_by_head_need_a_head_major_page_and_no_whole_pages_beside_them():
    lay = make_layout("LBNHC", **GEOM)  # token-major: a head's bytes are not one run of the page
    seg = lay.page.segment_bytes
    with pytest.raises(ValueError, match="layout: 'LBNHC' .* cannot be split by head"):
        ops.gather_pages(lay, [0], torch.empty((*lay.page_shape(1)[:3], lay.num_heads, seg // lay.num_heads)))
    hm = make_layout("LBHNC", **GEOM)
    shape = hm.page_heads_shape(2)
    wrong = (*shape[:3], shape[3] + 1, shape[4])
    with pytest.raises(
        ValueError, match=rf"out: expected shape {re.escape(str(shape))} for the raw-page chunk split by"
    ):
        ops.gather_pages(hm, [0, 1], torch.empty(wrong, dtype=torch.uint8))
    out = torch.empty(shape, dtype=torch.uint8)
    ops.gather_pages(hm, [0, 1], out)
    assert_same_bytes(out.flatten(-2), ops.gather_pages(hm, [0, 1], impl="reference"))
    batch = Copies(hm, path="staged")  # one staged view per group: split or whole, not both
    batch.add("gather_pages", [0, 1], out)
    with pytest.raises(ValueError, match=r"op: raw-page buffers split by head .* and whole .* in one batch"):
        batch.add("gather_pages", [2], torch.empty(hm.page_shape(1), dtype=torch.uint8))


def test_empty_ids_are_a_no_op(lay):
    before = [t.clone() for t in lay.layers]
    out = ops.gather_blocks(lay, [])
    assert out.shape == lay.canonical_shape(0)
    ops.scatter_slots(lay, torch.empty(0, dtype=torch.int64), torch.empty(lay.canonical_shape(0), dtype=torch.float16))
    assert_all_same_bytes(lay.layers, before)  # bitwise: the random cache bytes include NaNs
