"""The receive side of a GET (:class:`ChunkSink`): a chunk's value, or its manifest and then its parts,
received straight into the caller's tensor and verified on the way (header before the payload, the
checksum as each piece lands).

One sink per :meth:`RedisTier.get_into` call, used only by the thread running it (through
``RespConnection.get_into``): no locking.
"""

from __future__ import annotations

import torch

from .. import codec
from ..errors import ChunkError
from ..seal import Opening, Sealer
from .layout import MANIFEST_MAX, PARTS_MAGIC


class ChunkSink:
    """Receives a chunk's encoded bytes (one value, or its parts in order) into ``out``: the header into
    a small buffer (verified before the payload arrives), the payload straight into ``out``'s memory."""

    _PREFIX, _MANIFEST, _HEADER, _PAYLOAD, _DONE = range(5)

    def __init__(
        self,
        key: str,
        fingerprint: str,
        out: torch.Tensor,
        where: str,
        piece: int | None = None,
        sealer: Sealer | None = None,
        kid: str | None = None,
    ):
        self.key, self.fingerprint, self.out, self.where, self.piece = key, fingerprint, out, where, piece
        self.sealer = sealer  # a sealed tier: only sealed chunks it can open are read (kvx.store.seal)
        self.kid = kid  # the key id the value's name says it was sealed with (a sealed tier)
        self.opening: Opening | None = None  # the payload's decryption, once the header checked
        self.payload: memoryview | None = None  # out's bytes: :meth:`prepare`
        self.used = False  # handed to a GET (a second try takes a new sink)
        self.phase, self.pos, self.received = self._PREFIX, 0, 0
        self.buf = bytearray(codec.PREFIX_BYTES)
        self.header: codec.Header | None = None
        self.manifest: bytes | None = None
        self.missing = False
        self.parts: list[int] | None = None  # expected length of each part (None: a single value)
        self.value_len = 0
        self.torn = False

    def prepare(self) -> None:
        """View ``out``'s bytes (several torch calls). Called once the GET is out (``RespConnection.get_into``'s
        ``ready``), while the server prepares the value, so the view costs no wait: a value's first byte comes after a
        round trip (``benchmarks/bench_redis.py``, ``results/redis_cpu.md``)."""
        if self.payload is None:
            self.payload = memoryview(codec.byte_view(self.out))

    def _error(self, what: str, torn: bool = False) -> ChunkError:
        self.torn = self.torn or torn
        return ChunkError(f"chunk {self.key}: {self.where}: {what}")

    def begin(self, index: int, length: int | None) -> None:
        if self.parts is None:
            if length is None:
                self.missing = True
                return
            if length < codec.PREFIX_BYTES:
                raise self._error(f"value of {length} bytes is not a chunk", torn=True)
            self.value_len = length
            self.prepare()
            return
        if length is None:
            raise self._error(f"part {index} of {len(self.parts)} is gone (evicted or expired): torn chunk", torn=True)
        if length != self.parts[index]:
            raise self._error(f"part {index} holds {length} bytes, its manifest says {self.parts[index]}", torn=True)

    def buffer(self) -> memoryview:
        if self.phase == self._PAYLOAD:
            if self.opening is not None:  # ciphertext lands in a staging buffer, decrypted into out by advance
                return self.opening.buffer(self.piece)
            # at most a piece per receive: each is checksummed (advance) while it is still in cache
            # (bench_redis.py, "bytes received per checksum step")
            return self.payload[self.pos : self.pos + self.piece] if self.piece else self.payload[self.pos :]
        if self.phase == self._DONE:
            raise self._error(f"value is longer than its header says ({self.header.total} bytes)", torn=True)
        return memoryview(self.buf)[self.pos :]

    def advance(self, n: int) -> None:
        self.pos += n
        self.received += n
        if self.phase == self._PAYLOAD:
            # each piece is checksummed as it lands, while the next one is on the wire (CRC32C runs faster than
            # the socket delivers: hidden behind it); a sealed one is decrypted into out likewise
            if self.opening is not None:
                self.opening.advance(n)
            else:
                self.crc.update(self.payload[self.pos - n : self.pos])
            if self.pos == len(self.payload):
                self.phase = self._DONE
            return
        if self.phase == self._PREFIX and self.pos == len(self.buf):
            prefix = bytes(self.buf)
            if prefix == PARTS_MAGIC and self.parts is None:
                if self.value_len > MANIFEST_MAX:
                    raise self._error(f"manifest of {self.value_len} bytes is not a kvx manifest", torn=True)
                self.phase, self.buf = self._MANIFEST, bytearray(self.value_len)
                self.buf[: len(prefix)] = prefix
                if self.pos == self.value_len:
                    self._manifest_done()
                return
            try:
                n_head = codec.header_length(prefix)
            except ChunkError as e:  # neither a chunk nor a manifest at a kvx key: damage
                raise self._error(str(e), torn=True) from None
            self.phase, self.buf = self._HEADER, bytearray(codec.PREFIX_BYTES + n_head)
            self.buf[: len(prefix)] = prefix
        elif self.phase == self._MANIFEST and self.pos == len(self.buf):
            self._manifest_done()
        elif self.phase == self._HEADER and self.pos == len(self.buf):
            try:
                h = codec.decode_header(self.buf)
            except ChunkError as e:
                raise self._error(str(e), torn=True) from None
            if self.sealer is not None:
                problems = self.sealer.problems(h, self.key, tuple(self.out.shape), self.out.dtype, self.kid)
            else:
                problems = codec.check(h, self.key, self.fingerprint, tuple(self.out.shape), self.out.dtype)
            if problems:
                # another fingerprint, format or shape is not damage (another engine's chunk): kept;
                # another key or key id inside is (a value written under the wrong name): dropped
                raise self._error(
                    f"failed verification: {'; '.join(problems)}", torn=Sealer.misplaced(h, self.key, self.kid)
                )
            self.header = h
            self.crc = codec.RunningChecksum(h)
            if self.header.nbytes != len(self.payload):
                raise self._error(f"header says {self.header.nbytes} payload bytes, out holds {len(self.payload)}")
            if self.sealer is not None:
                self.opening = self.sealer.opening(h, self.key, self.out, f"chunk {self.key}: {self.where}")
            self.phase, self.pos = (self._PAYLOAD, 0) if self.header.nbytes else (self._DONE, 0)

    def _manifest_done(self) -> None:
        self.manifest = bytes(self.buf)
        self.phase = self._DONE

    def expect_parts(self) -> tuple[str, int]:
        """After a manifest: (nonce, parts); the sink then takes the parts as one stream."""
        try:
            magic, version, nonce, n, total, psize = self.manifest.decode("ascii").split(":")
            n, total, psize = int(n), int(total), int(psize)
            int(nonce, 16)
            if (
                magic != PARTS_MAGIC.decode()
                or version != "1"
                or not (n >= 1 and psize >= 1 and (n - 1) * psize < total <= n * psize)
            ):
                raise ValueError("inconsistent fields")
        except (UnicodeDecodeError, ValueError) as e:
            raise self._error(f"unreadable manifest {self.manifest[:MANIFEST_MAX]!r} ({e})", torn=True) from None
        self.parts = [min(psize, total - i * psize) for i in range(n)]
        self.value_len = total
        self.phase, self.pos, self.received, self.buf = self._PREFIX, 0, 0, bytearray(codec.PREFIX_BYTES)
        return nonce, n

    def finish(self) -> codec.Header:
        """After the last value: the whole chunk arrived and its checksum matches (else ChunkError)."""
        if self.phase != self._DONE or self.header is None:
            raise self._error(f"value ended after {self.received} bytes, before the chunk did", torn=True)
        if self.received != self.header.total or self.received != self.value_len:
            raise self._error(f"{self.received} bytes received, header says {self.header.total}", torn=True)
        if self.opening is not None:
            try:
                self.opening.finish()  # the GCM tag: every byte of the header and payload, for this key
            except ChunkError as e:
                self.torn = True  # sealed with this tier's secret yet not authentic: altered or misplaced
                raise e from None
        elif not self.crc.matches():
            raise self._error("failed verification: checksum mismatch (corrupt bytes)", torn=True)
        return self.header
