"""The one chunk codec of every byte-oriented tier (disk files, Redis values, any third-party tier).

A chunk's bytes are a safetensors file holding one tensor ``"kv"``: an 8-byte little-endian header
length, a JSON header padded with spaces to a multiple of 8, then the payload (the chunk's bytes as
they lie in memory). The header's ``__metadata__`` carries the format version (``kvx_format``), the
chunk ``key``, the engine ``fingerprint`` (what the bytes mean: layout, dtype, format), the payload
``length`` and its checksum; the tensor entry carries dtype and shape. So a value copied out of any
tier is a file the safetensors library (and ``kvx store verify``) reads.

Checksum: CRC32C (format ``kvx-2``; ``kvx-1`` chunks, checksummed with zlib's ``crc32``, are still read).
On CPUs with AVX-512 VPCLMULQDQ it is kvx's own (``kvx._C.crc32c``, about twice the package's rate); elsewhere
the ``crc32c`` package's (SSE4.2). zlib's CRC32 was replaced because it cost a large share of a Redis GET. Both
release the GIL over large buffers, so a writer thread's checksum does not stall vLLM's Python threads
(google-crc32c, used before, held it). The measurements: ``benchmarks/bench_crc.py``, results in
``benchmarks/results/crc_cpu.md``.

Readers check everything before a byte is served: :func:`decode_header` then :func:`check` (version,
key, fingerprint, dtype, shape, length), then :func:`check_crc` over the payload once it is in the
caller's buffer. Any mismatch is a :class:`ChunkError`: the connector reports the chunk's blocks as a
load error, and vLLM recomputes them.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np
import torch

from .errors import ChunkError

try:
    from .._ext import C as _kvx_C  # None when kvx._C is not built
except ImportError:  # kvx not built: the package computes the same checksum
    _kvx_C = None

if _kvx_C is not None and _kvx_C.crc32c_accelerated():
    _crc, CRC32C_IMPL = _kvx_C.crc32c, "kvx._C (AVX-512 VPCLMULQDQ)"
else:
    _crc, CRC32C_IMPL = _crc32c.crc32c, f"crc32c {_crc32c.__version__}"


def crc32c_update(data, value: int = 0) -> int:
    """CRC32C of a C-contiguous buffer continuing from ``value`` (the CRC of the bytes before; 0 to
    start): the codec's checksum, by whichever implementation this CPU runs (``CRC32C_IMPL``)."""
    return _crc(data, value)


FORMAT_VERSION = "kvx-2"
READABLE_VERSIONS = ("kvx-1", "kvx-2")  # kvx-1: zlib crc32
PREFIX_BYTES = 8
_MAX_HEADER = 1 << 20  # a kvx header is a few hundred bytes; a larger length is not a chunk
# the seal's fields (kvx.store.seal) too: an extra field must never pass for one
RESERVED_META = (
    "kvx_format",
    "key",
    "fingerprint",
    "crc32",
    "crc32c",
    "length",
    "created",
    "seal",
    "kid",
    "nonce",
    "tag",
)
# torch dtype -> safetensors dtype name: the library's own table (safetensors.torch._TYPES, 0.8), less the
# dtypes this torch lacks
ST_DTYPES = {
    getattr(torch, t): name
    for t, name in (
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("complex64", "C64"),
        ("uint64", "U64"),
        ("uint32", "U32"),
        ("uint16", "U16"),
    )
    if hasattr(torch, t)
}
_DTYPES = {name: dt for dt, name in ST_DTYPES.items()}

if sys.byteorder != "little":  # the payload is written as it lies in memory
    raise ImportError("kvx: chunk payloads are little-endian (safetensors); this host is big-endian")


@dataclass(frozen=True)
class Header:
    """A decoded chunk header. ``size``: bytes before the payload (prefix + JSON)."""

    meta: dict[str, str]
    dtype: torch.dtype | None  # None: a dtype this torch lacks
    shape: tuple[int, ...]
    nbytes: int
    size: int

    @property
    def key(self) -> str | None:
        return self.meta.get("key")

    @property
    def total(self) -> int:
        """Bytes of the whole encoded chunk."""
        return self.size + self.nbytes


def byte_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array sharing its memory (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"chunk: expected a contiguous tensor, got strides {tuple(t.stride())}")
    try:  # one torch call fewer than reshape(-1) first: about half the time with cold caches
        return t.detach().view(torch.uint8).numpy().reshape(-1)
    except RuntimeError:  # a 0-d tensor of a dtype wider than a byte
        return t.detach().reshape(-1).view(torch.uint8).numpy()


def crc32(t: torch.Tensor) -> str:
    """zlib CRC32 of a contiguous CPU tensor's bytes, as 8 hex digits (format kvx-1)."""
    return f"{zlib.crc32(byte_view(t)):08x}"


def crc32c(t: torch.Tensor) -> str:
    """CRC32C of a contiguous CPU tensor's bytes, as 8 hex digits (GIL released)."""
    return f"{_crc(byte_view(t)):08x}"


def check_chunk(chunk) -> None:
    """A chunk that can be encoded: a CPU tensor of a safetensors dtype."""
    if not isinstance(chunk, torch.Tensor) or not chunk.is_cpu:  # is_cpu: no device object made
        raise ValueError(f"chunk: expected a CPU tensor, got {type(chunk).__name__} {getattr(chunk, 'device', '')}")
    if chunk.dtype not in ST_DTYPES:
        raise ValueError(f"chunk: expected a dtype in {sorted(str(d) for d in ST_DTYPES)}, got {chunk.dtype}")


def check_extra(extra) -> None:
    if extra is not None and (
        not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items())
    ):
        raise ValueError(f"extra: expected a dict of str -> str, got {extra!r}")
    if extra and any(k in RESERVED_META for k in extra):
        # would overwrite the fields readers verify (key, fingerprint, checksum, ...)
        raise ValueError(f"extra: keys {sorted(set(extra) & set(RESERVED_META))} are reserved")


def encode_header(
    chunk: torch.Tensor, key: str, fingerprint: str, extra: dict[str, str] | None = None, created: float | None = None
) -> bytes:
    """The header of ``chunk`` (computes its CRC: one pass over the bytes)."""
    check_chunk(chunk)
    chunk = chunk.contiguous()
    return _header(chunk, byte_view(chunk), key, fingerprint, extra, created)


def _header(
    chunk: torch.Tensor, payload, key: str, fingerprint: str, extra: dict[str, str] | None, created: float | None
) -> bytes:
    """The header of ``chunk``, whose bytes are ``payload`` (its :func:`byte_view`)."""
    check_extra(extra)
    nbytes = payload.nbytes
    meta = {
        **(extra or {}),
        "kvx_format": FORMAT_VERSION,
        "key": key,
        "fingerprint": fingerprint,
        "length": str(nbytes),
        "crc32c": f"{_crc(payload):08x}",
    }
    if created is not None:
        meta["created"] = f"{created:.3f}"
    head = json.dumps(
        {
            "__metadata__": meta,
            "kv": {"dtype": ST_DTYPES[chunk.dtype], "shape": list(chunk.shape), "data_offsets": [0, nbytes]},
        },
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def encode(
    chunk: torch.Tensor, key: str, fingerprint: str, extra: dict[str, str] | None = None, created: float | None = None
) -> tuple[bytes, object]:
    """(header, payload): the payload is a view of the chunk's memory, not a copy."""
    check_chunk(chunk)
    chunk = chunk.contiguous()
    payload = byte_view(chunk)  # one view for the CRC and the sender (each is several torch calls)
    return _header(chunk, payload, key, fingerprint, extra, created), payload


def header_length(prefix: bytes) -> int:
    """Bytes of JSON after the 8-byte prefix (raises :class:`ChunkError` on a length no kvx header has)."""
    if len(prefix) < PREFIX_BYTES:
        raise ChunkError(f"chunk header: expected {PREFIX_BYTES} bytes of length, got {len(prefix)}")
    (n,) = struct.unpack("<Q", bytes(prefix[:PREFIX_BYTES]))
    if not 0 < n <= _MAX_HEADER:
        raise ChunkError(f"chunk header: length {n} is not a kvx header's")
    return n


def decode_header(buf) -> Header:
    """Parse a header from ``buf`` (at least the prefix and the JSON; more is ignored)."""
    n = header_length(buf)
    if len(buf) < PREFIX_BYTES + n:
        raise ChunkError(f"chunk header: expected {PREFIX_BYTES + n} bytes, got {len(buf)}")
    try:
        doc = json.loads(bytes(buf[PREFIX_BYTES : PREFIX_BYTES + n]))
        meta = doc.get("__metadata__") or {}
        kv = doc["kv"]
        lo, hi = kv["data_offsets"]
        shape = tuple(int(s) for s in kv["shape"])
        dtype = _DTYPES.get(kv["dtype"])
        if not isinstance(meta, dict) or lo != 0 or hi < 0:
            raise ValueError("bad layout")
    except ChunkError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed header is a bad chunk
        raise ChunkError(f"chunk header: unreadable ({type(e).__name__}: {e})") from None
    return Header({str(k): str(v) for k, v in meta.items()}, dtype, shape, int(hi), PREFIX_BYTES + n)


def check(
    h: Header,
    key: str,
    fingerprint: str,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    versions: Sequence[str] = READABLE_VERSIONS,
) -> list[str]:
    """What is wrong with a chunk's header for this reader (empty: nothing). ``versions``: the formats it
    reads (sealed readers: :mod:`kvx.store.seal`'s)."""
    problems = []
    if h.meta.get("kvx_format") not in versions:
        fmt = h.meta.get("kvx_format")
        hint = " (sealed: this tier has no encryption key)" if fmt == "kvx-sealed-1" else ""
        problems.append(f"format {fmt!r} not in {tuple(versions)}{hint}")
    if h.meta.get("key") != key:
        problems.append(f"key {h.meta.get('key')!r}")
    if h.meta.get("fingerprint") != fingerprint:
        problems.append(f"fingerprint {h.meta.get('fingerprint')!r} != {fingerprint!r}")
    if "length" in h.meta and h.meta["length"] != str(h.nbytes):
        problems.append(f"length {h.meta['length']} != {h.nbytes} payload bytes")
    if shape is not None and h.shape != tuple(shape):
        problems.append(f"shape {h.shape} != {tuple(shape)}")
    if dtype is not None and h.dtype != dtype:
        problems.append(f"dtype {h.dtype} != {dtype}")
    elif h.dtype is not None and h.nbytes != _numel(h.shape) * h.dtype.itemsize:
        problems.append(f"{h.nbytes} payload bytes for shape {h.shape} of {h.dtype}")
    return problems


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class RunningChecksum:
    """The header's checksum over a payload that arrives in pieces (``update`` in order, then
    ``matches``): a reader checks each piece while the next one is still on the wire."""

    def __init__(self, h: Header):
        self.h = h
        self.kind = "crc32c" if "crc32c" in h.meta else ("crc32" if h.meta.get("kvx_format") == "kvx-1" else None)
        self.value = 0

    def update(self, data) -> None:
        if self.kind == "crc32c":
            self.value = _crc(data, self.value)  # any C-contiguous buffer, no copy; GIL released
        elif self.kind == "crc32":
            self.value = zlib.crc32(data, self.value)

    def matches(self) -> bool:
        return self.kind is not None and self.h.meta.get(self.kind) == f"{self.value:08x}"


def check_crc(h: Header, payload: torch.Tensor) -> bool:
    """The payload's checksum is the header's (CRC32C; zlib CRC32 in kvx-1 chunks)."""
    if "crc32c" in h.meta:
        return h.meta["crc32c"] == crc32c(payload)
    return h.meta.get("kvx_format") == "kvx-1" and h.meta.get("crc32") == crc32(payload)


def verified_header(buf, key: str, fingerprint: str, out: torch.Tensor, where: str) -> Header:
    """Decode and check the header of a chunk to be read into ``out`` (raises :class:`ChunkError`)."""
    h = decode_header(buf)
    problems = check(h, key, fingerprint, tuple(out.shape), out.dtype)
    if problems:
        raise ChunkError(f"chunk {key}: {where} failed verification: {'; '.join(problems)}")
    return h


def decode_into(buf, key: str, fingerprint: str, out: torch.Tensor, where: str = "value") -> Header:
    """Verify an encoded chunk held in ``buf`` (bytes-like) and copy its payload into ``out``."""
    h = verified_header(buf, key, fingerprint, out, where)
    if len(buf) != h.total:
        raise ChunkError(f"chunk {key}: {where} holds {len(buf)} bytes, its header says {h.total}")
    byte_view(out)[:] = np.frombuffer(buf, dtype=np.uint8, count=h.nbytes, offset=h.size)
    if not check_crc(h, out):
        raise ChunkError(f"chunk {key}: {where} failed verification: checksum mismatch (corrupt bytes)")
    return h
