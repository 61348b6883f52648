"""The layout model: descriptors built from tensors and from vLLM-style views; rejections."""

import pytest
import torch

from kvx.kernels.layout import LAYOUTS, KVLayout
from kvx.testing import make_kv_caches

GEOM = dict(num_layers=3, num_blocks=5, block_size=16, num_heads=4, head_size=8, dtype=torch.bfloat16)


def vllm_views(layout_name, L=3, B=5, H=4, N=16, C=16, dtype=torch.bfloat16):
    """Per-layer views exactly as vLLM 0.32's create_kv_cache_views builds them (one int8 buffer)."""
    from kvx.testing import _ORDERS

    order = _ORDERS[layout_name]
    logical = (L, B, H, N, C * 2)  # content in bytes
    phys = [logical[d] for d in order]
    raw = torch.zeros(int(torch.tensor(phys).prod()), dtype=torch.int8)
    strides = [0] * 5
    cur = 1
    for d in reversed(order):
        strides[d] = cur
        cur *= logical[d]
    view5 = torch.as_strided(raw, logical, strides)
    return {f"model.layers.{l}.self_attn.attn": view5[l].view(dtype) for l in range(L)}


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_from_vllm_views(name):
    views = vllm_views(name)
    lay = KVLayout.from_vllm(views, name)
    assert (lay.num_layers, lay.num_planes, lay.num_blocks, lay.num_heads, lay.block_size, lay.head_size) == (
        3,
        2,
        5,
        4,
        16,
        8,
    )
    assert lay.paged.plane_stride == 8 * 2  # V follows K inside the content dim
    assert lay.page.segments == 1 and lay.page.segment_bytes == 4 * 16 * 16 * 2
    if name.startswith("BL"):
        assert lay.paged.block_stride == 3 * lay.page_bytes  # a block spans every layer
    else:
        assert lay.paged.block_stride == lay.page_bytes
    assert lay.layer_names[0] == "model.layers.0.self_attn.attn"


def test_from_vllm_accepts_enum_like_and_legacy_names():
    class FakeEnum:
        name = "HND"

    lay = KVLayout.from_vllm(vllm_views("LBHNC"), FakeEnum())
    assert lay.name == "LBHNC"


def test_from_vllm_dedups_aliased_layers():
    views = vllm_views("LBNHC")
    views["shared"] = views["model.layers.0.self_attn.attn"]
    assert KVLayout.from_vllm(views, "LBNHC").num_layers == 3


def test_from_vllm_cpu_backend_is_opaque():
    lay = KVLayout.from_vllm(vllm_views("LBHNC"), "LBHNC", backend="CPU_ATTN")
    assert lay.name == "cpu" and lay.opaque and lay.num_planes == 1 and lay.head_size == 16


def test_from_vllm_mla():
    base = torch.zeros(7, 16, 576, dtype=torch.bfloat16)
    lay = KVLayout.from_vllm({"a": base, "b": torch.zeros_like(base)}, "LBNHC", use_mla=True)
    assert (lay.name, lay.num_planes, lay.num_heads, lay.head_size, lay.num_layers) == ("mla", 1, 1, 576, 2)


def test_unknown_layout_name():
    with pytest.raises(ValueError, match=r"layout: expected one of .* got 'NCHW'"):
        KVLayout.from_tensors(torch.zeros(2, 2, 2, 2), "NCHW")


def test_head_outer_vllm_layout_rejected():
    with pytest.raises(ValueError, match="layout: expected a vLLM KVCacheLayout"):
        KVLayout.from_vllm(vllm_views("LBNHC"), "LHBNC")


def test_name_disagrees_with_strides():
    views = vllm_views("LBHNC")
    with pytest.raises(ValueError, match="expects token-major pages"):
        KVLayout.from_vllm(views, "LBNHC")


def test_wrong_rank():
    with pytest.raises(ValueError, match=r"tensors\[0\]: layout 'flash' expects \[2, blocks"):
        KVLayout.from_tensors(torch.zeros(3, 4, 16, 2, 8), "flash")


def test_odd_packed_content():
    with pytest.raises(ValueError, match="an even content dim"):
        KVLayout.from_tensors(torch.zeros(4, 2, 16, 7), "LBHNC")


def test_layers_with_different_geometry():
    a = make_kv_caches("flash", **GEOM)
    b = make_kv_caches("flash", **{**GEOM, "num_blocks": 6})
    with pytest.raises(ValueError, match=r"layers\[1\]: expected the geometry of layers\[0\]"):
        KVLayout.from_tensors([a[0], b[0]], "flash")


def test_non_tensor_layer():
    with pytest.raises(TypeError, match=r"tensors\[1\]: expected a torch.Tensor, got list"):
        KVLayout.from_tensors([torch.zeros(2, 4, 16, 2, 8), [1, 2]], "flash")


def test_overlapping_rows_rejected():
    t = torch.zeros(2, 4, 16, 2, 8).as_strided((2, 4, 16, 2, 8), (0, 256, 16, 8, 1))  # K and V alias
    with pytest.raises(ValueError, match="rows of layout 'flash' overlap"):
        KVLayout.from_tensors(t, "flash")


def test_non_contiguous_rows_rejected():
    t = torch.zeros(2, 4, 16, 2, 16)[..., ::2]
    with pytest.raises(ValueError, match="rows must be contiguous"):
        KVLayout.from_tensors(t, "flash")


def test_empty_layers():
    with pytest.raises(ValueError, match="layers: expected at least one layer"):
        KVLayout.from_tensors([], "flash")
    with pytest.raises(ValueError, match="kv_caches: expected at least one layer"):
        KVLayout.from_vllm({}, "LBNHC")


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_builds(name):
    geom = {**GEOM, "num_heads": 1} if name == "mla" else GEOM
    lay = KVLayout.from_tensors(make_kv_caches(name, **geom), name)
    planes, head_size = {"mla": (1, 8), "cpu": (1, 16)}.get(name, (2, 8))  # cpu: one plane, rows of 2D
    assert (lay.num_layers, lay.num_planes, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size) == (
        3,
        planes,
        5,
        16,
        geom["num_heads"],
        head_size,
    )
    assert lay.page is not None and lay.page.page_bytes == lay.page_bytes  # the runs cover the whole block


def test_legacy_flash_page_has_two_segments():
    lay = KVLayout.from_tensors(make_kv_caches("flash", **GEOM), "flash")
    assert lay.page.segments == 2 and lay.page.segment_bytes == 16 * 4 * 8 * 2
