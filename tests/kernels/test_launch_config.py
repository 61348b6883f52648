"""The CUDA copy kernel's launch decisions (csrc/cuda/launch_config.h: plain host arithmetic, testable anywhere): the
row segments (tpr lanes x wpl words per work item), the grid and its caps, the 32-bit / 64-bit index choice at its
boundary and the FastDivmods. The emulation that runs exactly that grid is test_cuda_sim.py's.
"""

import math
import re

import pytest
import torch

from kvx._ext import C as _ext_C
from kvx.kernels.layout import Op, c_descs, copy_geometry
from kvx.testing import make_layout
from tests.helpers import case_seed

_C = _ext_C  # None without the extension: then conftest.py fails every test, with the import error
_BLOCKS = 0
THREADS = 256  # threads per CTA of copy_cuda.cu (kThreads)
CTAS_PER_SM = 4  # launch_config.h kCtasPerSm: the grid's fill cap per SM
INDEX32_LIMIT = 1 << 31  # launch_config.h kIndex32Limit
H100_SMS = 132


# ------------------------------------------------------------------------------ launch decisions (anywhere)
def _rows_config(row_bytes, rows, *, sm_count=H100_SMS, max_ctas=0, contig=1 << 24, index32_limit=INDEX32_LIMIT):
    """The launch for `rows` rows of `row_bytes` bytes: one layer, one plane, one row per block id."""
    paged = _C.PagedDesc(
        plane_stride=0,
        block_stride=row_bytes,
        token_stride=0,
        head_stride=0,
        num_blocks=rows,
        num_planes=1,
        block_size=1,
        num_heads=1,
    )
    dense = _C.ContigDesc(layer_stride=rows * row_bytes, plane_stride=0, token_stride=row_bytes, head_stride=row_bytes)
    return _C.cuda_launch_config(
        paged, dense, row_bytes, 1, rows, _BLOCKS, [1 << 20], contig, sm_count, max_ctas, index32_limit=index32_limit
    )


def _items_per_pass(wpl):
    """Work items a thread takes per pass (launch_config.h items_per_pass): 4 words' worth, 2 one-word items."""
    return 2 if wpl == 1 else 4 // wpl


@pytest.mark.parametrize(
    "row_bytes,contig_offset,width,tpr,wpl,segments",
    [
        (256, 0, 16, 4, 4, 1),  # LBNHC bf16 head 128: 16 words, 4 lanes x 4 words per row
        (128, 0, 16, 2, 4, 1),  # 8 words
        (512, 0, 16, 8, 4, 1),
        (2048, 0, 16, 32, 4, 1),
        (4096, 0, 16, 32, 4, 2),  # long rows: segments of 32 lanes x 4 words (2 KiB)
        (65536, 0, 16, 32, 4, 32),  # a raw LBNHC page: 32 work items, not one warp's serial walk
        (1152, 0, 16, 2, 4, 9),  # an MLA row (576 bf16): 72 words = 9 segments of 2 x 4
        (64, 0, 16, 2, 2, 1),  # 4 words: 8 does not divide them, 4 does
        (320, 0, 16, 2, 2, 5),  # 20 words: 5 segments of 2 x 2
        (160, 0, 16, 1, 2, 5),  # 10 words (head 80 bf16): no group of 2+ lanes divides them, 1 lane x 2 words
        (16, 0, 16, 1, 1, 1),  # 1 word
        (48, 0, 16, 1, 1, 3),  # 3 words: one word per item
        (272, 0, 16, 1, 1, 17),  # 17 words
        (72, 0, 8, 1, 1, 9),  # 9 words of 8 bytes
        (256, 2, 2, 32, 4, 1),  # 128 words of 2 bytes: a group must read >= 32 bytes, so 16+ lanes
        (64, 2, 2, 16, 2, 1),  # 32 words of 2 bytes: 16 lanes x 2
        (32, 2, 2, 1, 4, 4),  # 16 words of 2 bytes: no group of 16+ lanes divides them, 1 lane x 4 words
        (12, 0, 4, 1, 1, 3),
        (24, 4, 4, 1, 2, 3),  # 6 words of 4 bytes
        (10, 0, 2, 1, 1, 5),
        (20, 0, 4, 1, 1, 5),
        (1, 0, 1, 1, 1, 1),
        (3, 0, 1, 1, 1, 3),
    ],
)
def test_row_segments(row_bytes, contig_offset, width, tpr, wpl, segments):
    """Rows are cut into equal segments of tpr lanes x wpl words (launch_config.h choose_segments()): the widest
    wpl, then the most lanes, that divide the row, a group's load covering >= 32 bytes; else one word each."""
    c = _rows_config(row_bytes, 1000, contig=(1 << 24) + contig_offset)
    assert (c.width, c.tpr, c.wpl, c.segments) == (width, tpr, wpl, segments)
    assert c.words == row_bytes // width == c.segments * c.tpr * c.wpl
    assert c.groups == THREADS // tpr and c.items_per_cta == c.groups * _items_per_pass(wpl)
    assert c.params.row_bytes == row_bytes and c.total_rows == 1000 and c.total_items == 1000 * segments
    assert c.tpr * c.width >= 32 or c.tpr == 1


@pytest.mark.parametrize(
    "row_bytes,rows,sm_count,max_ctas,ctas",
    [
        (64, 1000, H100_SMS, 0, 4),  # 128 groups x 2 items per CTA pass: ceil(1000 / 256)
        (512, 1000, H100_SMS, 0, 32),  # 32 groups of 8 lanes, one 4-word item each: ceil(1000 / 32)
        (16, 1000, H100_SMS, 0, 2),  # one-word items, 2 per thread per pass: ceil(1000 / 512)
        (512, 1, H100_SMS, 0, 1),
        (4096, 100_000, H100_SMS, 0, CTAS_PER_SM * H100_SMS),  # fill cap
        (4096, 100_000, 4, 0, CTAS_PER_SM * 4),
        (4096, 100_000, H100_SMS, 8, 8),  # the caller's cap (H2D_MAX_CTAS)
        (512, 1000, H100_SMS, 1000, 32),  # a cap above the need changes nothing
        (512, 1000, 10, 30, 30),  # the smaller of both caps
    ],
)
def test_cta_count_and_caps(row_bytes, rows, sm_count, max_ctas, ctas):
    c = _rows_config(row_bytes, rows, sm_count=sm_count, max_ctas=max_ctas)
    assert c.ctas == ctas
    assert c.ctas == min(math.ceil(c.total_items / c.items_per_cta), CTAS_PER_SM * sm_count, max_ctas or rows)


def test_grid_stride_when_items_exceed_the_grid():
    c = _rows_config(4096, 100_000)
    assert c.ctas * c.items_per_cta == CTAS_PER_SM * H100_SMS * 8 < c.total_items  # each group comes round ~47 times


def test_a_long_row_is_spread_over_ctas():
    """One 64 KiB row is 32 items of 2 KiB: 4 CTAs of 8 groups take one each (the old kernel gave the whole row
    to one warp of one CTA)."""
    c = _rows_config(65536, 1)
    assert (c.total_items, c.items_per_cta, c.ctas) == (32, 8, 4)


# The 32-bit index path holds while every index it computes stays below 2^31: the item counter up to its last
# grid-stride step, the paged token number (block * block_size + token) and the contiguous token.
def _slots_config(num_blocks, block_size, num_ids, *, row_bytes=256, index32_limit=INDEX32_LIMIT):
    paged = _C.PagedDesc(
        plane_stride=0,
        block_stride=block_size * row_bytes,
        token_stride=row_bytes,
        head_stride=row_bytes,
        num_blocks=num_blocks,
        num_planes=1,
        block_size=block_size,
        num_heads=1,
    )
    dense = _C.ContigDesc(layer_stride=num_ids * row_bytes, plane_stride=0, token_stride=row_bytes, head_stride=0)
    return _C.cuda_launch_config(
        paged, dense, row_bytes, 1, num_ids, 1, [1 << 20], 1 << 24, H100_SMS, index32_limit=index32_limit
    )


def test_index_width_at_the_item_limit():
    """16-byte rows of one word: items == rows. 32-bit exactly while items + one grid's worth <= 2^31 (the last
    value the grid-stride counter takes); one item more and the kernel divides in 64 bits."""
    grid_span = CTAS_PER_SM * H100_SMS * THREADS * 2  # ctas x items per CTA pass (2 one-word items per thread)
    at = _rows_config(16, INDEX32_LIMIT - grid_span)
    assert (at.ctas * at.items_per_cta, at.index_bits) == (grid_span, 32)
    assert _rows_config(16, INDEX32_LIMIT - grid_span + 1).index_bits == 64
    assert _rows_config(16, 3 << 31).index_bits == 64


def test_index_width_at_the_slot_limit():
    """Slot mode: a valid slot id is < num_blocks * block_size, divided in 32 bits only when that is <= 2^31."""
    assert _slots_config(1 << 27, 16, 100).index_bits == 32  # ids up to 2^31 - 1
    assert _slots_config((1 << 27) + 1, 16, 100).index_bits == 64
    assert _slots_config(1 << 20, 16, 100).divisors["block_size"][0] == 16


def test_index_width_at_the_contiguous_token_limit():
    """Block mode with the tokens merged into one row (a dense block): few items, but the contiguous token of
    id index i is i * block_size, a 32-bit index like the others: num_ids * block_size must stay <= 2^31."""

    def config(num_ids):
        paged = _C.PagedDesc(
            plane_stride=0,
            block_stride=16 * 64,
            token_stride=64,
            head_stride=64,
            num_blocks=4,
            num_planes=1,
            block_size=16,
            num_heads=1,
        )
        dense = _C.ContigDesc(layer_stride=0, plane_stride=0, token_stride=64, head_stride=64)
        return _C.cuda_launch_config(paged, dense, 64, 1, num_ids, _BLOCKS, [1 << 20], 1 << 24, H100_SMS)

    ok, over = config(1 << 27), config((1 << 27) + 1)
    assert ok.params.iter_tokens == 1 and ok.total_items == 1 << 27  # one 1 KiB row per id: 2^27 items
    assert (ok.index_bits, over.index_bits) == (32, 64)


def _fast_div(n, div, mul, shift):
    """copy_kernel.cuh's fast_div() in Python, 32-bit wrap-around included."""
    return ((((n * mul) >> 32) + n) & 0xFFFFFFFF) >> shift


@pytest.mark.parametrize("row_bytes,rows", [(256, 1000), (1152, 3), (16, 1_000_003), (4096, 7)])
def test_fast_divisors_are_exact_below_2_31(row_bytes, rows):
    """The (div, mul, shift) triples the host computes divide every n < 2^31 exactly, and every divisor the
    kernel uses is there."""
    c = _rows_config(row_bytes, rows)
    assert c.index_bits == 32
    divs = c.divisors
    assert divs["segments"][0] == c.segments and divs["rows_per_entry"][0] == 1 and divs["ids"][0] == rows
    assert c.id_tokens == 1  # block mode, block_size 1
    g = torch.Generator().manual_seed(case_seed("fastdiv", row_bytes))
    probe = torch.randint(0, INDEX32_LIMIT, (2000,), generator=g).tolist()
    for div, mul, shift in divs.values():
        edges = [0, 1, div - 1, div, div + 1, INDEX32_LIMIT - 1, (INDEX32_LIMIT - 1) // div * div]
        for n in edges + probe:
            assert _fast_div(n, div, mul, shift) == n // div, (n, div)


def test_fast_divisor_fails_past_2_31():
    """Why the boundary: from 2^31 on, umulhi(n, mul) + n overflows 32 bits for some divisors, and the
    quotient is wrong (the host must choose 64 bits there)."""
    c = _rows_config(16, 1025)
    div, mul, shift = c.divisors["ids"]
    assert div == 1025
    n = INDEX32_LIMIT + (1 << 22)
    assert _fast_div(n, div, mul, shift) != n // div


def _one_row_descs():
    """A paged and a contiguous descriptor of 4 one-token blocks of one 64-byte row each."""
    paged = _C.PagedDesc(
        plane_stride=0,
        block_stride=64,
        token_stride=0,
        head_stride=0,
        num_blocks=4,
        num_planes=1,
        block_size=1,
        num_heads=1,
    )
    return paged, _C.ContigDesc(layer_stride=0, plane_stride=0, token_stride=64, head_stride=64)


def test_nothing_to_launch():
    paged, dense = _one_row_descs()
    assert _C.cuda_launch_config(paged, dense, 64, 1, 0, _BLOCKS, [1 << 20], 1 << 24, H100_SMS).ctas == 0
    assert _C.cuda_launch_config(paged, dense, 0, 1, 4, _BLOCKS, [1 << 20], 1 << 24, H100_SMS).ctas == 0


def test_launch_config_collapses_rows_and_reads_alignment():
    """legacy flash: a block-plane is one row; an address 8 bytes off narrows the vector to 8 bytes."""
    lay = make_layout("flash", num_layers=2, num_blocks=4, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
    buf = torch.empty(lay.canonical_shape(3 * 16), dtype=torch.float16)
    c = _config("blocks", lay, 3, buf)
    assert (c.params.row_bytes, c.total_rows, c.width, c.tpr, c.wpl) == (16 * 2 * 8 * 2, 2 * 2 * 3, 16, 8, 4)
    assert _config("blocks", lay, 3, buf, contig=buf.data_ptr() + 8).width == 8


def test_launch_config_checks_its_arguments():
    with pytest.raises(ValueError, match="layer_ptrs: expected num_layers = 2 addresses, got 1"):
        _C.cuda_launch_config(
            *_one_row_descs(),
            64,
            2,
            4,
            _BLOCKS,
            [1 << 20],
            1 << 24,
            H100_SMS,
        )
    with pytest.raises(ValueError, match="sm_count: expected >= 1, got 0"):
        _rows_config(64, 10, sm_count=0)
    for bad in (0, INDEX32_LIMIT + 1):
        with pytest.raises(ValueError, match=re.escape(f"index32_limit: expected 1 .. 2^31, got {bad}")):
            _rows_config(64, 10, index32_limit=bad)


def _config(kind, lay, n, buf, *, sm_count=H100_SMS, max_ctas=0, contig=None, index32_limit=INDEX32_LIMIT):
    plan = copy_geometry(Op("gather_" + kind), lay, buf, n)
    return _C.cuda_launch_config(
        *c_descs(plan),
        plan.row_bytes,
        plan.num_layers,
        plan.num_ids,
        plan.mode,
        lay.layer_ptrs().tolist(),
        buf.data_ptr() if contig is None else contig,
        sm_count,
        max_ctas,
        index32_limit=index32_limit,
    )
