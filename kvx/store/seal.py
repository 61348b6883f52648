"""Sealed chunks: AES-256-GCM over a byte tier's chunks (the tiers' ``"encryption"`` option).

A tier with ``"encryption": {"key_file": PATH}`` (or ``{"key_files": [newest, ..., oldest]}``: key rotation)
writes every chunk sealed and reads only sealed chunks it can open. The sealed encoding is the codec's
(:mod:`kvx.store.codec`: an 8-byte header length, a JSON header, the payload) with:

- ``kvx_format`` = ``kvx-sealed-1`` (kvx versions and engines without the key see a format they do not
  read: a miss, never ciphertext served as KV);
- the payload: the chunk's bytes encrypted with AES-256-GCM (same length as the chunk), no CRC (the GCM tag
  authenticates every byte);
- ``kid``: which secret sealed it (16 hex digits of SHA-256 over the secret: a reader picks its key without
  trial decryption), ``nonce``: 96 random bits, ``tag``: the GCM tag.

Names. The tenant is part of a sealed chunk's identity: a store names it by its chunk key *and* its kid (disk
``<key>-<kid>.safetensors``, Redis ``kvx:1:{<key>}-<kid>``), and a tier looks up only the names of the secrets
it holds (newest first). So a chunk sealed with a secret the tier does not hold is a miss at lookup (never a
hit that then fails to open), tenants with different secrets each store and find their own copy of the same
prompt, and during a rotation chunks sealed with an older listed secret keep being found. A chunk whose
header names another key or another kid than its name is misplaced (:meth:`Sealer.misplaced`) and dropped.

Keys. The AES key of a chunk is ``HKDF-SHA256(secret, salt="kvx-seal-1", info="kvx chunk" || fingerprint ||
chunk key)``. The chunk key is the hash chain whose root folds in the request's isolation namespace
(``cache_salt``, ``kvx_namespace``, the LoRA adapter, the engine namespace: :func:`kvx.keys.request_root`),
so every namespace gets its own keys (a refinement of one key per namespace: one per namespace and prefix),
derived where the tier encodes and decodes, with no namespace passed to the tier. A key encrypts one chunk
(a few times at most: a chunk rewritten after an eviction), far below AES-GCM's bound on random nonces per key.

Associated data: ``kvx-sealed-1`` and a canonical JSON of every header field but the tag (chunk key,
fingerprint, kid, nonce, length, dtype, shape, creation time, the writer's extra fields) with the key and
fingerprint the *reader* expects. So a chunk stored under another key (replayed, or with its header edited to
name the key it now sits at), for another fingerprint, with another tenant's secret, or with any byte of its
header or payload changed fails the tag: :class:`ChunkError`, a miss, recomputed.

Reading decrypts piece by piece from a small per-thread staging buffer into the caller's tensor as the bytes
arrive (AES-GCM with VAES outruns the socket and the disk: benchmarks/results/redis_sealed_cpu.md and
disk_read_sealed_cpu.md), so a sealed read moves the bytes once more through the cache and never into a second
chunk-sized buffer; the tensor holds plaintext that is served only once the tag matched.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import field_validator, model_validator

from ..log import get_logger
from . import codec
from .errors import ChunkError
from .tier import StrictConfig

log = get_logger(__name__)
_WARNED: set[str] = set()  # key files already warned about (the check and each tier's open read them)
SEALED_VERSION = "kvx-sealed-1"
CIPHER = "aes-256-gcm"
MIN_SECRET_BYTES = 32  # 256 bits: the AES key's size (a hex secret of 32 characters carries only 128)
_SALT = b"kvx-seal-1"
_NONCE_BYTES, _TAG_BYTES = 12, 16
STAGING_BYTES = 256 << 10  # ciphertext bytes decrypted per step (in cache; bench_redis.py)


class EncryptionConfig(StrictConfig):
    """``{"key_file": PATH}`` or ``{"key_files": [newest, ..., oldest]}``: files holding the secrets (at least
    32 bytes each; one trailing newline is not part of the secret). Chunks are written with the first, read
    with any."""

    key_file: str | None = None
    key_files: list[str] | None = None

    @field_validator("key_file")
    @classmethod
    def _file(cls, v):
        if v is not None and not v.strip():
            raise ValueError("key_file: expected the path of a file holding the secret, got ''")
        return v

    @field_validator("key_files")
    @classmethod
    def _files(cls, v):
        if v is None:
            return v
        if not v:
            raise ValueError("key_files: expected a non-empty list of paths (newest key first), got []")
        for i, p in enumerate(v):
            if not p.strip():
                raise ValueError(f"key_files[{i}]: expected the path of a file holding a secret, got ''")
        return v

    @model_validator(mode="after")
    def _one_of(self):
        if self.key_file is not None and self.key_files is not None:
            raise ValueError(
                f"encryption: expected either key_file or key_files (newest first), got both "
                f"(key_file={self.key_file!r}, key_files={self.key_files!r})"
            )
        if self.key_file is None and self.key_files is None:
            raise ValueError("encryption: expected key_file (a path) or key_files (paths, newest first), got neither")
        return self

    @property
    def paths(self) -> list[str]:
        return [self.key_file] if self.key_file is not None else list(self.key_files or [])

    def names(self) -> list[str]:
        """The config key naming each path (for errors)."""
        return ["key_file"] if self.key_file is not None else [f"key_files[{i}]" for i in range(len(self.paths))]


def _read_secret(path: str, name: str) -> bytes:
    """The secret in ``path`` (ValueError naming ``name``, what was expected and what was given)."""
    full = os.path.expanduser(path)
    try:
        st = os.stat(full)
    except FileNotFoundError:
        raise ValueError(
            f"{name}: expected a readable file holding the secret, got {path!r}, which does not exist"
        ) from None
    except OSError as e:
        raise ValueError(f"{name}: expected a readable file holding the secret, got {path!r} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{name}: expected a regular file holding the secret, got {path!r}, which is not one")
    try:
        with open(full, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(
            f"{name}: expected a readable file holding the secret, got {path!r}, which this process cannot read "
            f"({e.strerror})"
        ) from None
    if st.st_mode & 0o077 and full not in _WARNED:
        _WARNED.add(full)
        log.warning(
            "kvx: %s: the key file %s is readable by its group or others (mode %o); chmod 600 it",
            name,
            path,
            stat.S_IMODE(st.st_mode),
        )
    secret = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{name}: expected a secret of at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32 > "
            f"{path}`), got {len(secret)} bytes in {path!r}"
        )
    return secret


def load_secrets(config: EncryptionConfig, where: str = "encryption") -> list[bytes]:
    """The secrets of ``config``, newest first (ValueError listing every problem, each naming its key)."""
    secrets, problems = [], []
    for path, name in zip(config.paths, config.names()):
        try:
            secrets.append(_read_secret(path, f"{where}.{name}"))
        except ValueError as e:
            problems.append(str(e))
    if not problems:
        seen: dict[str, int] = {}
        for i, s in enumerate(secrets):
            kid = key_id(s)
            if kid in seen:
                problems.append(
                    f"{where}.key_files[{i}]: expected a secret other than key_files[{seen[kid]}]'s, got the same "
                    f"one ({config.paths[i]!r})"
                )
            seen[kid] = i
    if problems:
        raise ValueError("\n  ".join(problems))
    return secrets


def check_encryption(config: EncryptionConfig | None, where: str) -> list[str]:
    """Problems with a tier's ``encryption`` on this machine (for ``Tier.check_config``)."""
    if config is None:
        return []
    try:
        load_secrets(config, f"{where}.encryption")
    except ValueError as e:
        return str(e).split("\n  ")
    return []


def key_id(secret: bytes) -> str:
    """The id stored with chunks sealed by ``secret`` (16 hex digits; reveals nothing usable about it)."""
    return hashlib.sha256(b"kvx-seal-kid\0" + secret).hexdigest()[:16]


def _aad(meta: dict[str, str], key: str, fingerprint: str, dtype: str, shape) -> bytes:
    fields = {k: v for k, v in meta.items() if k != "tag"}
    fields["key"], fields["fingerprint"] = key, fingerprint  # what the reader asks for, whatever the header says
    doc = {"meta": fields, "dtype": dtype, "shape": [int(s) for s in shape]}
    return SEALED_VERSION.encode() + b"\0" + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


_local = threading.local()


def _staging() -> memoryview:
    buf = getattr(_local, "staging", None)
    if buf is None:
        buf = _local.staging = memoryview(bytearray(STAGING_BYTES))
    return buf


@dataclass
class Opening:
    """Decryption of one sealed payload as it arrives: :meth:`buffer` hands out where the next ciphertext
    goes (the thread's staging buffer), :meth:`advance` decrypts what landed there into ``out``'s bytes;
    :meth:`finish` checks the tag (ChunkError on a mismatch)."""

    decryptor: object
    out: memoryview
    where: str
    pos: int = 0
    stage: memoryview = field(default_factory=lambda: _staging())  # the opening thread's staging buffer

    def buffer(self, limit: int | None = None) -> memoryview:
        left = len(self.out) - self.pos
        n = min(STAGING_BYTES, left, limit) if limit else min(STAGING_BYTES, left)
        return self.stage[:n]

    def advance(self, n: int) -> None:
        """The first ``n`` bytes of the last :meth:`buffer` arrived: decrypt them into ``out``."""
        self.decryptor.update_into(self.stage[:n], self.out[self.pos : self.pos + n])
        self.pos += n

    def finish(self) -> None:
        from cryptography.exceptions import InvalidTag

        if self.pos != len(self.out):
            raise ChunkError(f"{self.where}: {self.pos} of {len(self.out)} sealed payload bytes decrypted")
        try:
            self.decryptor.finalize()
        except InvalidTag:
            raise ChunkError(
                f"{self.where}: failed authentication (AES-GCM tag mismatch: sealed with another secret or for "
                f"another key, or altered)"
            ) from None


class Sealer:
    """Seals and opens one tier's chunks with its secrets (newest first: writes use it). Thread-safe."""

    def __init__(self, secrets: list[bytes], fingerprint: str):
        if not secrets:
            raise ValueError("secrets: expected at least one secret, got none")
        self.fingerprint = fingerprint
        self._secrets = {key_id(s): s for s in secrets}
        self.write_kid = key_id(secrets[0])

    @classmethod
    def of(cls, config: EncryptionConfig | None, fingerprint: str, where: str = "encryption") -> Sealer | None:
        return None if config is None else cls(load_secrets(config, where), fingerprint)

    @property
    def kids(self) -> list[str]:
        return list(self._secrets)

    def _aes_key(self, kid: str, key: str) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = b"kvx chunk\0" + self.fingerprint.encode() + b"\0" + key.encode()
        return HKDF(hashes.SHA256(), 32, _SALT, info).derive(self._secrets[kid])

    # ---------------------------------------------------------------- writing
    def seal(
        self, chunk: torch.Tensor, key: str, extra: dict[str, str] | None = None, created: float | None = None
    ) -> tuple[bytes, np.ndarray]:
        """(header, payload) of ``chunk`` sealed as ``key``: the payload is a new buffer of ciphertext (one
        pass over the chunk: AES-GCM instead of the CRC)."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        codec.check_chunk(chunk)
        codec.check_extra(extra)
        chunk = chunk.contiguous()
        plain = codec.byte_view(chunk)
        n = plain.nbytes
        nonce = os.urandom(_NONCE_BYTES)
        meta = {
            **(extra or {}),
            "kvx_format": SEALED_VERSION,
            "key": key,
            "fingerprint": self.fingerprint,
            "length": str(n),
            "seal": CIPHER,
            "kid": self.write_kid,
            "nonce": nonce.hex(),
            "created": f"{(time.time() if created is None else created):.3f}",
        }
        dtype, shape = codec.ST_DTYPES[chunk.dtype], list(chunk.shape)
        aead, aad = AESGCM(self._aes_key(self.write_kid, key)), _aad(meta, key, self.fingerprint, dtype, shape)
        if hasattr(aead, "encrypt_into"):  # cryptography >= 45: into a buffer of our own (no zeroing)
            buf = np.empty(n + _TAG_BYTES, dtype=np.uint8)
            aead.encrypt_into(nonce, plain, aad, buf)
        else:
            buf = np.frombuffer(aead.encrypt(nonce, plain, aad), dtype=np.uint8)
        meta["tag"] = buf[n:].tobytes().hex()
        head = json.dumps(
            {"__metadata__": meta, "kv": {"dtype": dtype, "shape": shape, "data_offsets": [0, n]}},
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
        head += b" " * (-len(head) % 8)
        return struct.pack("<Q", len(head)) + head, buf[:n]

    # ---------------------------------------------------------------- reading
    def problems(self, h: codec.Header, key: str, shape=None, dtype=None, kid: str | None = None) -> list[str]:
        """What is wrong with a chunk's header for a sealed read (empty: nothing); the codec's checks too.
        ``kid``: the key id the chunk's name says it was sealed with (:meth:`misplaced`)."""
        fmt = h.meta.get("kvx_format")
        if fmt != SEALED_VERSION:
            return [f"not sealed (format {fmt!r}): this tier reads only chunks sealed with its key"]
        problems = codec.check(h, key, self.fingerprint, shape, dtype, versions=(SEALED_VERSION,))
        if h.meta.get("seal") != CIPHER:
            problems.append(f"seal {h.meta.get('seal')!r} != {CIPHER!r}")
        elif kid is not None and h.meta.get("kid") != kid:
            problems.append(f"sealed with key id {h.meta.get('kid')!r}, stored under the name of key id {kid!r}")
        elif h.meta.get("kid") not in self._secrets:
            problems.append(
                f"sealed with key id {h.meta.get('kid')!r}, which this tier does not hold (its keys: {self.kids}): "
                f"another tenant's secret, or one rotated out"
            )
        return problems

    @staticmethod
    def misplaced(h: codec.Header, key: str, kid: str | None) -> bool:
        """A chunk stored under a name it was not sealed for: another chunk key, or another secret's key id than
        its name says (``kid``). Never servable from there, whoever reads it: a store drops it."""
        return h.key != key or (kid is not None and h.meta.get("kid") != kid)

    def opening(self, h: codec.Header, key: str, out: torch.Tensor, where: str) -> Opening:
        """Start decrypting the payload of ``h`` (checked by :meth:`problems`) into ``out``."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        try:
            nonce, tag = bytes.fromhex(h.meta["nonce"]), bytes.fromhex(h.meta["tag"])
            if len(nonce) != _NONCE_BYTES or len(tag) != _TAG_BYTES:
                raise ValueError(f"{len(nonce)}-byte nonce, {len(tag)}-byte tag")
        except (KeyError, ValueError) as e:
            raise ChunkError(f"{where}: unreadable seal ({type(e).__name__}: {e})") from None
        dec = Cipher(algorithms.AES(self._aes_key(h.meta["kid"], key)), modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(
            _aad(h.meta, key, self.fingerprint, codec.ST_DTYPES.get(out.dtype, ""), h.shape)
        )
        return Opening(dec, memoryview(codec.byte_view(out)), where)
