"""``kvx.kernels.ops.host_copy``: ``dst.copy_(src)`` on the calling thread alone, bit-exact between strided CPU
views (a KV head's slice of a chunk and its part), every dtype kvx stores, and its bad input."""

from __future__ import annotations

import pytest
import torch

from kvx.kernels.ops import host_copy
from tests.helpers import same_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, 256, (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()), generator=g, dtype=torch.uint8
    ).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_heads_slice_and_its_part_both_ways(dtype):
    chunk = rand((3, 2, 17, 5, 24), dtype, 1)  # [L, P, T, H, D]: odd tokens, odd heads
    for h in range(5):
        part = torch.empty((3, 2, 17, 24), dtype=dtype)
        host_copy(part, chunk[:, :, :, h])
        assert same_bytes(part, chunk[:, :, :, h].contiguous())
        back = torch.zeros_like(chunk)
        host_copy(back[:, :, :, h], part)
        assert same_bytes(back[:, :, :, h].contiguous(), part)
        others = [i for i in range(5) if i != h]
        assert not back[:, :, :, others].view(torch.uint8).any()  # nothing else written


def test_strided_on_both_sides_and_layer_ranges():
    src = rand((6, 2, 9, 4, 8), torch.bfloat16, 2).movedim(3, 0)[1]  # a head of [L, P, T, H, D]
    dst = torch.zeros((4, 10, 2, 9, 8), dtype=torch.bfloat16).movedim(1, 3)[:, :, :, 7][1:4]  # 3 of 4 layers
    host_copy(dst, src[2:5])
    assert same_bytes(dst.contiguous(), src[2:5].contiguous())
    empty = torch.empty((0, 2, 9, 8), dtype=torch.bfloat16)
    host_copy(empty, src[:0])  # nothing to copy


@pytest.mark.parametrize(
    "dst, src, match",
    [
        (torch.empty(2, 3), torch.empty(3, 2), "one shape and dtype"),
        (torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float16), "one shape and dtype"),
        (torch.empty(3, 2).t(), torch.empty(2, 3), "dense last dim"),
        (torch.empty(()), torch.empty(()), "dense last dim"),
    ],
    ids=["shape", "dtype", "last-dim", "scalar"],
)
def test_bad_input_names_the_arguments(dst, src, match):
    with pytest.raises(ValueError, match=f"^dst, src: expected .*{match}"):
        host_copy(dst, src)
