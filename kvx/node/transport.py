"""How chunk bytes move from one node's pool to another's: a :class:`Transport` reads byte ranges of a peer's pool
file into this node's pool file.

What a pull needs around it (the lease on the peer, the slot here, the checks before the chunk is served) is the
control channel's (:mod:`.peers`); a transport only moves bytes, and says when it could not. Two implement it:
:class:`kvx.node.tcp.TcpTransport` (kvx's own channel: a stream of the bytes over the peer's listen port) and
:class:`kvx.node.nixl.NixlTransport` (one NIXL READ per pull, over UCX: shared memory, TCP, RDMA, whatever UCX
finds between the hosts). Which one a node uses is its ``--transport``; both ends of a pull must run the same.
A sealed namespace's chunks cross only over tcp, encrypted (:mod:`.wire_seal`); over NIXL they stay on their host.

A transport's thread: the node's peer thread calls :meth:`Transport.read` (one pull at a time per peer); the
serving side of a transport (where it has one) runs on threads of its own and reads only the pool's bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One contiguous range: ``nbytes`` at byte ``remote`` of the peer's pool file into byte ``local`` of ours."""

    remote: int
    local: int
    nbytes: int


class TransferError(RuntimeError):
    """The bytes did not all arrive (the peer is gone, cut off, refused, or too slow): the pull fails, its slots are
    freed, and its chunks are misses (recomputed)."""


class Transport(ABC):
    """Reads spans of a peer's pool into the local pool.

    Args (of the implementations): ``pool``: the local pool file's whole mapping (a writable buffer: an
    ``mmap.mmap``), registered once; its byte 0 is the file's byte 0, as a :class:`Span`'s offsets count.
    """

    name: str  # "tcp" or "nixl": what a peer's hello must say for the two to pull from each other

    @abstractmethod
    def descriptor(self) -> bytes:
        """What a peer needs to read from this node (NIXL: the agent's metadata and the pool's address; tcp: none
        beyond the listen address, which the peer has). Sent to a peer only after the cluster handshake."""

    @abstractmethod
    def connect(self, peer: str, address: tuple[str, int], descriptor: bytes) -> None:
        """Make ``peer`` (a node's id) readable: its listen ``address`` and its :meth:`descriptor`. Idempotent for
        the same descriptor; a new one (the peer restarted) replaces the old."""

    @abstractmethod
    def forget(self, peer: str) -> None:
        """Drop what :meth:`connect` set up for ``peer`` (it is gone); a no-op for an unknown peer."""

    @abstractmethod
    def read(
        self,
        peer: str,
        spans: Sequence[Span],
        timeout: float,
        crcs: Sequence[int] | None = None,
        sealed: bool = False,
    ) -> list[bool] | None:
        """Copy every span from ``peer``'s pool into the local pool, or raise :class:`TransferError` within about
        ``timeout`` seconds. On return every byte is here, and per span whether its CRC32C matched (``crcs``, the
        peer's lease's, or else the peer's as it sends), where the transport checks them as they stream (tcp); None
        where it does not (the caller checks them against the CRC32Cs of the peer's lease before serving them).
        ``sealed``: the spans hold a sealed namespace's chunks, which cross only encrypted (tcp:
        :mod:`kvx.node.wire_seal`); a transport that cannot encrypt (NIXL's one-sided READ) raises
        :class:`TransferError` and moves nothing."""

    @abstractmethod
    def write(self, peer: str, spans: Sequence[Span], timeout: float, sealed: bool = False) -> None:
        """Copy every span from the local pool into ``peer``'s pool (a P/D push: ``remote`` offsets are slots the
        peer reserved for this node), or raise :class:`TransferError` within about ``timeout`` seconds.
        ``sealed``: as for :meth:`read`."""

    def close(self) -> None:  # noqa: B027 - not abstract: a transport with nothing to release keeps this one
        """Release everything (idempotent)."""
