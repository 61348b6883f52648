"""Sealed chunks on the wire between nodes: a key per data connection, and the pieces' cipher.

A sealed namespace's chunks (its engine seals its byte tiers, :mod:`kvx.store.seal`) cross between nodes only over
kvx's TCP channel (:class:`kvx.node.tcp.TcpTransport`), and only encrypted: AES-256-GCM. No key crosses. Both ends
of a data connection derive its keys from what they already share, the cluster secret, and what the handshake
(:mod:`.handshake`) exchanged in the clear, its two nonces and the two node ids (:class:`~.handshake.Keying`)::

    HKDF-SHA256(secret, salt = acceptor nonce || dialer nonce,
                info = "kvx-wire-1" || len | acceptor id || len | dialer id)  ->  64 bytes
    the first 32: the acceptor -> dialer key (a read's bytes), the last 32: the dialer -> acceptor key (a write's)

Fresh nonces on every connection make its keys fresh (a recorded connection's keys open nothing of another); one key
per direction means the two directions' GCM nonces never collide. A piece's GCM nonce is a 96-bit counter, one per
direction per connection, counted alike by both ends (TCP keeps the order): never reused; a connection whose counter
would wrap closes (it would take 2^96 pieces).

A span (``nbytes`` at byte ``offset`` of the serving node's pool) crosses as pieces of :data:`PIECE` bytes (the last
shorter), each its ciphertext then its 16-byte tag, the associated data binding the piece to its place:
``"kvx-wire-1" | offset | nbytes | piece index`` (so a piece replayed into another span or place fails its tag).
The receiver takes the ciphertext straight into its pool slot and decrypts it there, in place; the slot is PENDING,
served only once the whole read checked (tags and CRC32Cs), freed otherwise.

Threads: a :class:`WireSession` belongs to its connection, used by one thread at a time (the reading side's per-peer
lock; the serving side's connection thread).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..store.codec import crc32c_update
from .handshake import Keying

INFO = b"kvx-wire-1"
PIECE = 256 << 10  # plaintext bytes per GCM piece: small enough to be in cache still when its CRC32C is summed
TAG = 16
_NONCE_LIMIT = 1 << 96  # a 96-bit counter: a connection stops before it wraps
_AAD = struct.Struct("<QQQ")


class SealError(ConnectionError):
    """A sealed piece failed (a bad tag: changed in transit or sealed with another key; or a nonce counter at its
    end): the transfer fails and its connection closes."""


def derive_keys(secret: bytes, keying: Keying) -> tuple[bytes, bytes]:
    """The connection's (acceptor -> dialer, dialer -> acceptor) AES-256 keys (module docstring)."""
    if len(keying.acceptor_nonce) != 16 or len(keying.dialer_nonce) != 16:
        raise ValueError(
            f"keying: expected two 16-byte nonces, got {len(keying.acceptor_nonce)} and {len(keying.dialer_nonce)}"
        )
    info = INFO
    for part in (keying.acceptor.encode(), keying.dialer.encode()):
        info += len(part).to_bytes(4, "little") + part
    okm = HKDF(
        algorithm=hashes.SHA256(), length=64, salt=keying.acceptor_nonce + keying.dialer_nonce, info=info
    ).derive(secret)
    return okm[:32], okm[32:]


def _aad(offset: int, nbytes: int, index: int) -> bytes:
    return INFO + _AAD.pack(offset, nbytes, index)


class WireSession:
    """One data connection's two keys and their nonce counters, as seen from ``keying.side``'s end."""

    def __init__(self, secret: bytes, keying: Keying):
        to_dialer, to_acceptor = derive_keys(secret, keying)
        if keying.side == "dialer":
            send, recv = to_acceptor, to_dialer
        elif keying.side == "acceptor":
            send, recv = to_dialer, to_acceptor
        else:
            raise ValueError(f"keying.side: expected 'dialer' or 'acceptor', got {keying.side!r}")
        self._send, self._recv = algorithms.AES(send), algorithms.AES(recv)
        self._sent = self._received = 0  # pieces so far each way: the next GCM nonce
        self._staging = bytearray(PIECE + TAG)  # a piece's ciphertext and tag on their way out

    @staticmethod
    def _nonce(n: int) -> bytes:
        if n >= _NONCE_LIMIT:
            raise SealError("wire: this connection's GCM nonce counter is at its end; the connection closes")
        return n.to_bytes(12, "big")

    def send_span(self, sock: socket.socket, span: memoryview, offset: int, left: Callable[[], float]) -> None:
        """Send ``span`` (plaintext: the pool's bytes at ``offset``) as sealed pieces."""
        nbytes = len(span)
        out = memoryview(self._staging)
        for index, at in enumerate(range(0, nbytes, PIECE)):
            n = min(PIECE, nbytes - at)
            enc = Cipher(self._send, modes.GCM(self._nonce(self._sent))).encryptor()
            self._sent += 1
            enc.authenticate_additional_data(_aad(offset, nbytes, index))
            with span[at : at + n] as piece:
                enc.update_into(piece, out[:n])
            enc.finalize()
            out[n : n + TAG] = enc.tag
            sock.settimeout(left())
            sock.sendall(out[: n + TAG])
        out.release()

    def recv_span(self, sock: socket.socket, part: memoryview, offset: int, left: Callable[[], float]) -> int:
        """Receive the sealed pieces of a span of ``len(part)`` bytes at ``offset`` (of the sender's pool) into
        ``part`` (a slot: each piece's ciphertext lands there and is decrypted in place), and return the CRC32C of
        its plaintext, summed piece by piece while each is in cache. :class:`SealError` on a bad tag."""
        nbytes, crc = len(part), 0
        tag = bytearray(TAG)
        for index, at in enumerate(range(0, nbytes, PIECE)):
            n = min(PIECE, nbytes - at)
            with part[at : at + n] as piece:
                _recv_all(sock, piece, left)
                _recv_all(sock, memoryview(tag), left)
                dec = Cipher(self._recv, modes.GCM(self._nonce(self._received))).decryptor()
                self._received += 1
                dec.authenticate_additional_data(_aad(offset, nbytes, index))
                dec.update_into(piece, piece)
                try:
                    dec.finalize_with_tag(bytes(tag))
                except InvalidTag:
                    raise SealError(
                        f"wire: piece {index} of the sealed span [{offset}, {offset + nbytes}) failed its GCM tag "
                        "(changed in transit, or sealed with another key)"
                    ) from None
                crc = crc32c_update(piece, crc)
        return crc


def _recv_all(sock: socket.socket, buf: memoryview, left: Callable[[], float]) -> None:
    got = 0
    while got < len(buf):
        sock.settimeout(left())
        k = sock.recv_into(buf[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection mid-span")
        got += k
