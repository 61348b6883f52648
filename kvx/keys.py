"""Chunk keys: a hash chain over token ids, stable across processes, machines and restarts.

``key[i] = blake2b(key[i-1] || tokens of chunk i || extras of chunk i || len)`` (every part length-prefixed;
extras: the concatenated digests of the chunk's multimodal items, each over its hash, its offset
relative to the chunk and its length) with ``key[-1]`` the request's
*root*: a digest of the engine namespace (model, KV dtype, chunk format fingerprint; not the tensor- or
pipeline-parallel sizes where the chunk's bytes can be cut by KV head) and the request's own isolation inputs
(cache_salt, LoRA adapter). In a byte tier the chunk key names the chunk's record and each part of the chunk
has its own key, :func:`part_key` (:mod:`kvx.connector.parts`). A hybrid model's recurrent state
at a chunk's end is stored under :func:`state_key` of the chunk's key. Multimodal items are mixed into
every chunk their placeholder tokens overlap, so two prompts with the same placeholder ids but different images
never share a chunk. No Python ``hash()`` and no vLLM per-process seed are involved.

Keys are 32 lowercase hex digits (128 bits).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_VERSION = "kvx-key-2"  # 2: multimodal items hashed one by one (1 joined them with "|")
_KEY_RE = re.compile(r"[0-9a-f]{32}")


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def namespace_digest(**fields: object) -> bytes:
    """Digest of the engine namespace; ``fields`` are JSON-serialisable (sorted for stability)."""
    return _digest(KEY_VERSION.encode(), json.dumps(fields, sort_keys=True, default=str).encode())


@dataclass(frozen=True)
class MMItem:
    """A multimodal item: its content hash and the placeholder token range it occupies."""

    hash: str
    offset: int
    length: int


def request_root(
    namespace: bytes, cache_salt: str | None = None, lora: str | None = None, kvx_namespace: str | None = None
) -> bytes:
    """The chain root of one request. ``kvx_namespace``: the request's own isolation key (its
    ``kv_transfer_params``); without one the root is what it always was, so stored chunks stay valid."""
    root = _digest(namespace, (cache_salt or "").encode(), (lora or "").encode())
    return _digest(root, b"kvx_namespace", kvx_namespace.encode()) if kvx_namespace else root


def chunk_keys(
    root: bytes,
    token_ids: Sequence[int],
    chunk_size: int,
    *,
    num_chunks: int | None = None,
    mm_items: Sequence[MMItem] = (),
    partial_tokens: int = 0,
) -> list[str]:
    """Keys of the leading full chunks of ``token_ids`` (at most ``num_chunks``), then, if
    ``partial_tokens > 0``, one more key for a trailing chunk of exactly that many tokens.

    Args:
        root: from :func:`request_root`.
        token_ids: the request's tokens (prompt, or prompt + output).
        chunk_size: tokens per chunk.
    """
    if not _is_int(chunk_size) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if num_chunks is not None and (not _is_int(num_chunks) or num_chunks < 0):
        raise ValueError(f"num_chunks: expected a non-negative int or None, got {num_chunks!r}")
    if not _is_int(partial_tokens) or partial_tokens < 0:
        raise ValueError(f"partial_tokens: expected a non-negative int, got {partial_tokens!r}")
    # explicit little-endian int64: the bytes hashed (hence the keys) are the same on every machine
    toks = np.asarray(token_ids)
    if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
        raise ValueError(f"token_ids: expected a flat sequence of ints, got {toks.dtype} of shape {toks.shape}")
    toks = toks.astype("<i8", copy=False)
    full = len(toks) // chunk_size
    if num_chunks is not None:
        full = min(full, num_chunks)
    keys: list[str] = []
    prev = root
    spans = [(i * chunk_size, (i + 1) * chunk_size) for i in range(full)]
    if partial_tokens > 0:
        start = full * chunk_size
        if partial_tokens >= chunk_size or start + partial_tokens > len(toks):
            raise ValueError(
                f"partial_tokens: expected < {chunk_size} tokens after the {full} full chunks of a "
                f"{len(toks)}-token sequence, got {partial_tokens}"
            )
        spans.append((start, start + partial_tokens))
    for start, end in spans:
        # one fixed-size digest per item: no content hash can forge an item boundary
        extras = b"".join(
            _digest(m.hash.encode(), str(m.offset - start).encode(), str(m.length).encode())
            for m in mm_items
            if m.offset < end and m.offset + m.length > start
        )
        prev = _digest(prev, toks[start:end].tobytes(), extras, str(end - start).encode())
        keys.append(prev.hex())
    return keys


def part_key(key: str, name: str) -> str:
    """The storage key of part ``name`` of chunk ``key`` in a byte tier (:mod:`kvx.connector.parts`: a KV head's
    layers, ``h3/l0-32``; or a rank's whole share where heads cannot be cut, ``tp1of2/l0-32``). The chunk key itself
    names the chunk's record."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"key: expected 32 lowercase hex digits, got {key!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a part name such as 'h0/l0-32', got {name!r}")
    return _digest(bytes.fromhex(key), b"part", name.encode()).hex()


def state_key(key: str) -> str:
    """The key of chunk ``key``'s state object: a hybrid model's recurrent state at the chunk's last token (see
    :mod:`kvx.connector.common`). Derived from the chunk key, so it inherits its namespace and prefix."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"key: expected 32 lowercase hex digits, got {key!r}")
    return _digest(bytes.fromhex(key), b"recurrent-state").hex()
