"""What a node answers its peers' control requests, and the CRC32C of each chunk they lease.

A peer's control connection (:mod:`.peers`: ``have``, ``lease``, ``release``, ``reserve``, ``commit_pushed``,
``describe``) is read on its own thread, which asks :class:`PeerAnswers` for each reply; what touches the index runs on
the loop thread (``call``), which owns it. The CRC32C a lease carries is computed when the chunk is committed (off the
loop, on this module's thread), so that a pull spends no time hashing on the serving side.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..store.codec import crc32c_update
from .protocol import KEYS_RE, NAMESPACE_RE


class PeerAnswers:
    """The replies to peers' control requests, and the CRC32C cache of READY chunks.

    ``call(fn)`` runs ``fn(state)`` on the loop thread (the index's owner); ``count(name, n)`` adds to the cluster's
    counters. State: ``pool``, ``epoch`` and ``transport`` are set by :meth:`use_pool` (the loop thread, under
    ``_lock``) and read by the control threads; the CRC cache is filled by this object's CRC thread and by the
    control threads, and read by them, under ``_lock``.
    """

    def __init__(self, call: Callable[[Callable[[Any], Any]], Any], count: Callable[[str, int], None]):
        self._call = call
        self._count = count
        self._lock = threading.Lock()
        self.pool = None
        self.epoch = ""
        self.transport = None
        self._crcs: dict[int, tuple[int, int, int]] = {}  # slot offset -> (generation, nbytes, CRC32C)
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="kvx-node-crc")

    def use_pool(self, pool, epoch: str, transport) -> None:
        """The pool is made: ``pool`` maps the whole file, ``epoch`` names it, ``transport`` reads and writes it."""
        with self._lock:
            self.pool, self.epoch, self.transport = pool, epoch, transport
            self._crcs.clear()

    def close(self) -> None:
        self._crc_pool.shutdown(wait=False, cancel_futures=True)

    def answer(self, cid: int, peer: str, msg: dict) -> dict:
        """The reply to ``msg`` from ``peer``'s control connection ``cid`` (its thread); ValueError: refused."""
        op = msg.get("op")
        if op == "describe":
            with self._lock:
                t, epoch = self.transport, self.epoch
            return {"descriptor": t.descriptor().hex() if t else "", "epoch": epoch}
        if op == "release":
            keys, gens = msg.get("keys"), msg.get("generations")
            if not (isinstance(keys, list) and isinstance(gens, list) and len(keys) == len(gens)):
                raise ValueError("release: expected keys and generations, lists of one length")
            return {"intact": self._call(lambda s: s.peer_release(cid, keys, gens))}
        ns, keys = msg.get("namespace"), msg.get("keys")
        if not (isinstance(ns, str) and NAMESPACE_RE.fullmatch(ns)):
            raise ValueError(f"namespace: expected 8-128 hex digits, got {str(ns)[:80]!r}")
        if not (isinstance(keys, str) and KEYS_RE.fullmatch(keys)):
            raise ValueError("keys: expected keys of 32 lowercase hex digits end to end")
        keys = [keys[i : i + 32] for i in range(0, len(keys), 32)]
        if op == "have":
            return {"ready": self._call(lambda s: s.peer_have(ns, keys))}
        if op == "reserve":
            nbytes = msg.get("nbytes")
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
            sealed = msg.get("seal", False) is True  # the pusher's namespace is sealed: it writes sealed
            offsets, sealed = self._call(
                lambda s: (s.push_reserve(cid, peer, ns, keys, nbytes, sealed), s.is_sealed(ns) and s.seal_transit)
            )
            return {"offsets": offsets, **({"sealed": True} if sealed else {})}
        if op == "commit_pushed":
            crcs, nbytes = msg.get("crcs"), msg.get("nbytes")
            if not (isinstance(crcs, list) and len(crcs) == len(keys) and isinstance(nbytes, int) and nbytes > 0):
                raise ValueError("commit_pushed: expected one crc per key and nbytes")
            offsets = self._call(lambda s: s.pending_offsets(cid, keys))
            with memoryview(self.pool) as view:
                good = [o is not None and crc32c_update(view[o : o + nbytes]) == c for o, c in zip(offsets, crcs)]
            if not all(good):
                self._count("bad_chunks", len(good) - sum(good))
            n = self._call(lambda s: s.push_commit(cid, keys, good, crcs))
            self._count("received", n)
            return {"committed": n}
        if op == "lease":
            nbytes = msg.get("nbytes")
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
            leased, sealed = self._call(lambda s: (s.peer_lease(cid, ns, keys, nbytes), s.is_sealed(ns)))
            if msg.get("crc", True):  # every puller asks for them; False: a puller that checks nothing
                chunks = [[k, off, gen, self._crc(off, gen, nbytes)] for k, off, gen in leased]
            else:
                chunks = [[k, off, gen, None] for k, off, gen in leased]
            self._count("served", len(chunks))
            # sealed: the chunks are a sealed namespace's, which this node serves only to a sealed read
            return {"chunks": chunks, "epoch": self.epoch, **({"sealed": True} if sealed else {})}
        raise ValueError(f"op: expected have, lease, release, reserve, commit_pushed or describe, got {str(op)[:40]!r}")

    def committed(self, offset: int, generation: int, nbytes: int, crc: int | None = None) -> None:
        """A chunk became READY here (loop thread: the index's hook): its CRC32C is computed now, off the loop, so
        that a peer's lease of it finds it made: the puller checks the bytes it reads against it (as they stream,
        over tcp; after each NIXL READ), and this node spends no time of the pull hashing what it sends. ``crc``: the
        CRC32C its writer checked it against (a chunk pulled or pushed here), kept as it is."""
        if crc is not None and nbytes > 0:
            with self._lock:
                self._crcs[offset] = (generation, nbytes, crc)
        elif nbytes > 0:
            try:
                self._crc_pool.submit(self._crc, offset, generation, nbytes)
            except RuntimeError:  # closed: the node stops
                pass

    def _crc(self, offset: int, generation: int, nbytes: int) -> int:
        """CRC32C of the chunk of ``nbytes`` at ``offset`` in its slot's ``generation`` (kept per slot: a slot's
        bytes do not change while it is READY, and a new generation is another chunk)."""
        with self._lock:
            hit = self._crcs.get(offset)
        if hit is not None and hit[:2] == (generation, nbytes):
            return hit[2]
        with memoryview(self.pool) as view:
            crc = crc32c_update(view[offset : offset + nbytes])
        with self._lock:
            self._crcs[offset] = (generation, nbytes, crc)
        return crc
