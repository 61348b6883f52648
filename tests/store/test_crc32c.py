"""kvx._C.crc32c (AVX-512 VPCLMULQDQ folding) against the crc32c package, bit for bit, and the codec's
choice between them."""

from __future__ import annotations

import os
import random
import re

import crc32c as pkg
import numpy as np
import pytest
import torch

from kvx._ext import C as _C
from kvx.store import codec

CPU_FLAGS = set()
if os.path.exists("/proc/cpuinfo"):
    m = re.search(r"^flags\s*:(.*)$", open("/proc/cpuinfo").read(), re.M)
    CPU_FLAGS = set(m.group(1).split()) if m else set()

needs_vpclmul = pytest.mark.skipif(
    not _C.crc32c_accelerated(), reason="this CPU lacks AVX-512 VPCLMULQDQ: the codec uses the crc32c package"
)

POLY = 0x1EDC6F41  # CRC32C (Castagnoli), x^32 implied


def fold_constant(distance: int, sign: int) -> int:
    """x^(distance + sign * 32) mod P, bit-reflected and shifted left by one: the multiplier that moves a
    64-bit half of a 128-bit lane ``distance`` bits forward."""
    r = 1
    for _ in range(distance + sign * 32):
        r <<= 1
        if r & (1 << 32):
            r ^= (1 << 32) | POLY
    return int(f"{r:032b}"[::-1], 2) << 1


def test_the_fold_constants_in_the_source_are_derived_from_the_polynomial():
    src = open(os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "cpu", "crc32c.cpp")).read()
    for d in (2048, 512, 384, 256, 128):
        lo, hi = fold_constant(d, +1), fold_constant(d, -1)
        assert re.search(rf"kFold{d}\[2\] = \{{{lo:#x}ULL, {hi:#x}ULL\}};", src), (d, hex(lo), hex(hi))


@pytest.mark.skipif(not CPU_FLAGS, reason="no /proc/cpuinfo flags on this system")
def test_the_fast_path_runs_where_the_cpu_has_the_instructions():
    want = {"avx512f", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= CPU_FLAGS
    assert _C.crc32c_accelerated() == want
    assert codec.CRC32C_IMPL.startswith("kvx._C") == want


@needs_vpclmul
def test_check_values():
    assert _C.crc32c(b"123456789") == 0xE3069283
    assert _C.crc32c(b"hello world") == 3381945770
    assert _C.crc32c(b" world", _C.crc32c(b"hello")) == 3381945770
    assert _C.crc32c(b"") == 0 and _C.crc32c(b"", 0x1234) == 0x1234


@needs_vpclmul
def test_bit_exact_with_the_crc32c_package_on_random_data():
    rng = random.Random(0)
    buf = np.random.default_rng(0).integers(0, 256, (4 << 20) + 4096, dtype=np.uint8)
    mv = memoryview(buf)
    # every length through several folds (256-byte blocks, 64-byte blocks, the tail), then odd large ones
    lengths = list(range(0, 1100)) + [rng.randrange(1100, 300_000) for _ in range(300)] + [1 << 20, 4 << 20]
    for n in lengths:
        off, init = rng.randrange(0, 64), rng.getrandbits(32)  # unaligned starts, any running value
        view = mv[off : off + n]
        assert _C.crc32c(view, init) == pkg.crc32c(view, init), (n, off, init)


@needs_vpclmul
def test_pieces_chain_like_one_pass():
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    mv, value, pos = memoryview(data), 0, 0
    for step in (1, 255, 256, 257, 4096, 65535, 65536, 300_001):
        value, pos = _C.crc32c(mv[pos : pos + step], value), pos + step
    value = _C.crc32c(mv[pos:], value)
    assert value == pkg.crc32c(data)


@needs_vpclmul
def test_every_kind_of_buffer_the_codec_passes():
    t = torch.randn(3, 257, dtype=torch.float32)
    b = codec.byte_view(t)
    assert _C.crc32c(b) == _C.crc32c(bytes(b)) == _C.crc32c(bytearray(bytes(b))) == pkg.crc32c(bytes(b))
    assert _C.crc32c(memoryview(b)[5:1001]) == pkg.crc32c(bytes(b)[5:1001])


@needs_vpclmul
def test_bad_input_names_the_argument():
    strided = memoryview(np.arange(100, dtype=np.uint8))[::2]
    with pytest.raises(TypeError, match=r"data: expected a C-contiguous bytes-like object, got memoryview"):
        _C.crc32c(strided)
    with pytest.raises(TypeError, match=r"data: expected a C-contiguous bytes-like object, got str"):
        _C.crc32c("text")
    with pytest.raises(TypeError):
        _C.crc32c(b"x", -1)  # the running value is an unsigned 32-bit CRC


def test_the_codec_checksum_equals_the_packages():
    t = torch.randint(-128, 127, (5, 1031), dtype=torch.int8)
    assert codec.crc32c(t) == f"{pkg.crc32c(bytes(codec.byte_view(t))):08x}"
    assert codec.crc32c_update(b"123456789") == 0xE3069283
    assert codec.crc32c_update(b"56789", codec.crc32c_update(b"1234")) == 0xE3069283
    h, payload = codec.encode(t, "k" * 8, "fp")
    assert codec.decode_header(h).meta["crc32c"] == codec.crc32c(t)
