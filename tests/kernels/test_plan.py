"""The host-side plan of kv_layout.h (collapse_rows, moving_strides, copy_width), through kvx._C.plan_launch.

It is the one implementation of row merging and alignment: the C++ kernels call it directly, the Triton
launcher through ``kvx._C.plan_launch``.
"""

import importlib.util

import pytest
import torch

from kvx._ext import C as _ext_C
from kvx.kernels.layout import Op, c_descs, copy_geometry
from kvx.testing import make_layout

_C = _ext_C  # None without the extension: then conftest.py fails every test, with the import error

GEOM = dict(num_layers=2, num_blocks=4, block_size=16, num_heads=2, head_size=8, dtype=torch.float16)
_BLOCKS, _SLOTS = 0, 1


def _launch(kind, lay, buf, n):
    plan = copy_geometry(Op("gather_" + kind), lay, buf, n)
    return _C.plan_launch(
        *c_descs(plan),
        plan.row_bytes,
        plan.num_layers,
        plan.num_ids,
        plan.mode,
        lay.layer_ptrs().tolist(),
        buf.data_ptr(),
    )


def _paged(**kw):
    base = dict(
        plane_stride=0,
        block_stride=4096,
        token_stride=256,
        head_stride=64,
        num_blocks=8,
        num_planes=1,
        block_size=4,
        num_heads=4,
    )
    return _C.PagedDesc(**{**base, **kw})


def _contig(**kw):
    return _C.ContigDesc(**{**dict(layer_stride=65536, plane_stride=0, token_stride=256, head_stride=64), **kw})


def test_legacy_flash_block_is_one_row():
    """[2, B, N, H, D] against a dense canonical chunk: heads, then tokens, merge into one 512-byte row."""
    lay = make_layout("flash", **GEOM)
    buf = torch.empty(lay.canonical_shape(3 * 16), dtype=torch.float16)
    p = _launch("blocks", lay, buf, 3).params
    assert (p.row_bytes, p.iter_tokens, p.iter_heads) == (16 * 2 * 8 * 2, 1, 1)


def test_packed_kv_rows_do_not_merge():
    """vLLM 0.32 LBNHC packs K|V in a row of the page: a head's K row is D elements, its neighbour is V."""
    lay = make_layout("LBNHC", **GEOM)
    buf = torch.empty(lay.canonical_shape(3 * 16), dtype=torch.float16)
    launch = _launch("blocks", lay, buf, 3)
    assert (launch.params.row_bytes, launch.params.iter_tokens, launch.params.iter_heads) == (16, 16, 2)
    assert launch.width == 16
    slots = _launch("slots", lay, torch.empty(lay.canonical_shape(5), dtype=torch.float16), 5)
    assert (slots.params.iter_tokens, slots.params.iter_heads) == (1, 2)


def test_odd_rows_narrow_the_width():
    lay = make_layout("LBNHC", **{**GEOM, "head_size": 5})  # 10-byte rows
    buf = torch.empty(lay.canonical_shape(16), dtype=torch.float16)
    assert _launch("blocks", lay, buf, 1).width == 2


def test_strides_that_never_move_do_not_narrow_the_width():
    # one layer: the contiguous layer stride (3) is never used, and is reported as 0
    one = _C.plan_launch(_paged(), _contig(layer_stride=3), 64, 1, 4, _SLOTS, [1 << 20], 1 << 21)
    assert one.width == 16 and one.params.contig.layer_stride == 0
    # two layers: it moves, and bytes are all that divides it
    two = _C.plan_launch(_paged(), _contig(layer_stride=3), 64, 2, 4, _SLOTS, [1 << 20, 1 << 21], 1 << 22)
    assert two.width == 1 and two.params.contig.layer_stride == 3
    # one head per token: the head strides never move
    heads = _C.plan_launch(
        _paged(num_heads=1, head_stride=7), _contig(head_stride=7), 64, 1, 4, _SLOTS, [1 << 20], 1 << 21
    )
    assert heads.width == 16 and heads.params.paged.head_stride == 0 and heads.params.contig.head_stride == 0


def test_layer_and_buffer_addresses_set_the_width():
    ok = _C.plan_launch(_paged(), _contig(), 64, 2, 4, _BLOCKS, [1 << 20, 1 << 21], 1 << 22)
    assert ok.width == 16
    assert _C.plan_launch(_paged(), _contig(), 64, 2, 4, _BLOCKS, [1 << 20, (1 << 21) + 4], 1 << 22).width == 4
    assert _C.plan_launch(_paged(), _contig(), 64, 2, 4, _BLOCKS, [1 << 20, 1 << 21], (1 << 22) + 8).width == 8


def test_raw_pages_move_whole_pages_in_16_byte_words():
    lay = make_layout("LBNHC", **GEOM)
    buf = torch.empty(lay.page_shape(3), dtype=torch.uint8)
    launch = _launch("pages", lay, buf, 3)
    assert (launch.params.row_bytes, launch.params.iter_tokens, launch.params.iter_heads) == (lay.page_bytes, 1, 1)
    assert launch.width == 16


def test_plan_launch_checks_the_layer_count():
    with pytest.raises(ValueError, match="layer_ptrs: expected num_layers = 2 addresses, got 1"):
        _C.plan_launch(_paged(), _contig(), 64, 2, 4, _BLOCKS, [1 << 20], 1 << 22)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("head_size,word,vec", [(8, 8, 2), (5, 2, 1)])
def test_triton_word_and_unit_come_from_copy_width(head_size, word, vec):
    """Triton's widest word is int64: a 16-byte width moves int64 words two per 16-byte unit."""
    import triton.language as tl

    from kvx.triton_kernels import copy as tk

    words = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
    lay = make_layout("LBNHC", **{**GEOM, "head_size": head_size})
    buf = torch.empty(lay.canonical_shape(16), dtype=torch.float16)
    plan = copy_geometry(Op.GATHER_BLOCKS, lay, buf, 1)
    _, args, meta = tk._launch_args(
        plan, lay.layer_ptrs().tolist(), torch.zeros(1, dtype=torch.int64), buf, 0, lay.plane_views(0)[0]
    )
    assert meta["WORD"] == words[word] and meta["VEC"] == vec
    assert args[5] == head_size * 2 // (word * vec)  # row length in units
