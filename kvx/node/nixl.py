"""The NIXL transport: a pull is one NIXL READ of a peer's pool file (registered once, there) into this node's pool
file (registered once, here), over UCX: on one host CMA (``process_vm_readv``, the reader copies; UCX picks it
by default, not its posix/sysv shared memory), across hosts RDMA where UCX finds it, else TCP (a software GET:
the peer's UCX worker answers each read with the bytes).

Two NIXL agents per node, both over the whole pool mapping:

- the *serving* agent, named the node's id: its metadata is :meth:`NixlTransport.descriptor`; peers read through it.
  It runs NIXL's progress thread, which answers the reads that need the target to take part (UCX over TCP). It
  sleeps in ``poll()`` on UCX's wake-up fd (NIXL's Python API would make it spin a core: :func:`_progress_wakeup`).
- the *initiating* agent (``<node id>/init<n>``): it loads the peers' descriptors and posts this node's reads
  (and writes). No progress thread: :meth:`NixlTransport.read` polls, and each poll progresses its UCX worker.

Why two: a READ abandoned on timeout cannot be cancelled (see :meth:`NixlTransport.read`): the only way to be sure
that it writes nothing more into this node's pool is to destroy the UCX worker that would write it. The initiating
agent is that worker: it is destroyed and made again (its peers loaded again from their descriptors), while the
serving agent, and so this node's descriptor that peers hold, stays as it was.

What NIXL/UCX (nixl-cu12 1.5.1, its bundled UCX) do that a caller should know:

- A peer that died is seen at once (CMA: ``process_vm_readv`` fails; TCP: the connection is reset): the READ ends
  in NIXL_ERR_REMOTE_DISCONNECT, a :class:`TransferError`, long before the timeout.
- UCX over TCP: a serving process aborts (``ucp_request.inl`` "Fatal: unexpected error: Endpoint timeout",
  SIGABRT) when it gets to answer a READ whose reader has gone meanwhile: the reader's process died, or its
  initiating agent was remade after a timeout, while the server was stalled with the request unanswered (seen here
  with a SIGSTOPped server; UCX's software GET reply treats any send error as fatal). CMA and RDMA reads need no
  answer, so they cannot trigger it.
- Over TCP the serving process answers any address a connected reader asks for: UCX's software GET checks no
  registration on the serving side (``rma_sw.c``: the reply copies from the address in the request), so whoever
  can reach a node's UCX port can read all of that node's process memory. Run it on a trusted network only.

Threads: the node's peer thread calls every method. They hold one lock (NIXL's agents are made without thread
sync), so calls from other threads too are safe but wait their turn: one READ in flight per node at a time. NIXL's
progress thread of the serving agent touches only NIXL's own state and reads the pool's bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..log import get_logger
from .transport import Span, TransferError, Transport

try:  # the wheel's import name is its CUDA variant's: nixl-cu12 (scripts/setup.sh installs it) or nixl-cu13
    from nixl_cu12 import _api as _nixl_api
except ImportError:  # pragma: no cover - whichever is installed
    from nixl_cu13 import _api as _nixl_api  # type: ignore[no-redef]

nixl_agent = _nixl_api.nixl_agent
nixl_agent_config = _nixl_api.nixl_agent_config

log = get_logger(__name__)
T = TypeVar("T")

_HEADER = struct.Struct("!4sHHQQ")  # magic, version, name length, pool base address, pool length; name, metadata
_MAGIC = b"KVXN"
_VERSION = 1

DEFAULT_SETTLE_S = 1.0  # how long read() waits past its timeout for an abandoned READ to end by itself
POLL_SPINS, POLL_PAUSE_S, POLL_PAUSE_MAX_S = 64, 50e-6, 1e-3  # read()'s polling: spins, then sleeps 50 us .. 1 ms
PROGRESS_WAKEUP_US = 10_000  # the serving agent's progress thread: poll()'s timeout between UCX wake-up events

_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def _progress_wakeup(us: int):
    """Agents made within this get a progress thread that sleeps in ``poll()`` up to ``us`` microseconds
    (rounded up to ms) between UCX's wake-up events. NIXL's Python API sets 0, which makes the thread spin (a whole
    core, always: it polls with a 0 ms timeout); its config type is patched for the constructor's call only
    (under a lock: other threads making NIXL agents at that moment would get the same)."""
    binding = _nixl_api.nixlBind
    real = binding.nixlAgentConfig

    class _Config(real):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return real.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            real.pthrDelay.__set__(self, max(int(value), us))

    with _CONFIG_LOCK:
        binding.nixlAgentConfig = _Config
        try:
            yield
        finally:
            binding.nixlAgentConfig = real


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` under its transport's lock."""

    @functools.wraps(method)
    def call(self: NixlTransport, *args, **kwargs) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


@dataclass(frozen=True)
class Descriptor:
    """A parsed :meth:`NixlTransport.descriptor`."""

    agent: str  # the serving agent's name (the node's id)
    base: int  # the address of byte 0 of the pool file in the serving process
    length: int  # the pool file's length in bytes
    metadata: bytes  # the serving agent's NIXL metadata

    def pack(self) -> bytes:
        name = self.agent.encode()
        return _HEADER.pack(_MAGIC, _VERSION, len(name), self.base, self.length) + name + self.metadata

    @classmethod
    def parse(cls, descriptor: bytes) -> Descriptor:
        """ValueError if ``descriptor`` is not one."""
        if not isinstance(descriptor, (bytes, bytearray, memoryview)):
            raise ValueError(f"descriptor: expected bytes, got {type(descriptor).__name__}")
        descriptor = bytes(descriptor)
        if len(descriptor) < _HEADER.size:
            raise ValueError(f"descriptor: expected at least {_HEADER.size} bytes, got {len(descriptor)}")
        magic, version, n, base, length = _HEADER.unpack_from(descriptor)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(
                f"descriptor: expected a kvx NIXL descriptor ({_MAGIC!r} version {_VERSION}), got magic {magic!r} "
                f"version {version} (a peer running another transport or kvx version?)"
            )
        name = descriptor[_HEADER.size : _HEADER.size + n]
        metadata = descriptor[_HEADER.size + n :]
        if n == 0 or len(name) != n or not metadata or length <= 0:
            raise ValueError(
                f"descriptor: expected an agent name, NIXL metadata and a pool length > 0, got a name of {len(name)} "
                f"bytes, {len(metadata)} bytes of metadata, pool length {length}"
            )
        return cls(name.decode(errors="replace"), base, length, metadata)


def _not_sealed(verb: str, sealed: bool) -> None:
    if sealed:
        raise TransferError(
            f"{verb}: sealed: expected plain spans over NIXL (its one-sided transfers cannot encrypt: a sealed "
            "namespace's chunks cross only over kvx's tcp transport), got sealed=True"
        )


class NixlTransport(Transport):
    """Reads spans of peers' pools with NIXL (module docstring: the two agents and why).

    Args:
        pool: the local pool file's whole mapping, writable (an ``mmap.mmap``). Its address is taken through a
            buffer export, so the mapping cannot be closed (``BufferError``) until :meth:`close`.
        node_id: this node's id: the serving agent's name, which peers' NIXL agents must not share.
        backends: NIXL backends of both agents (UCX: shared memory, TCP, RDMA, as UCX finds them; UCX's own
            environment, ``UCX_TLS`` and the like, chooses among them).
        settle_s: how long :meth:`read` waits past its timeout for a READ still in flight to end by itself before
            it abandons it (and remakes the initiating agent).
        progress_wakeup_us: the serving agent's progress thread's longest sleep between UCX wake-up events (NIXL's
            own API would make it spin a core; see :func:`_progress_wakeup`).
    """

    name = "nixl"

    def __init__(
        self,
        pool: mmap.mmap,
        node_id: str,
        backends: Sequence[str] = ("UCX",),
        settle_s: float = DEFAULT_SETTLE_S,
        progress_wakeup_us: int = PROGRESS_WAKEUP_US,
    ) -> None:
        if not isinstance(node_id, str) or not node_id:
            raise ValueError(f"node_id: expected a non-empty str, got {node_id!r}")
        if settle_s < 0:
            raise ValueError(f"settle_s: expected >= 0, got {settle_s}")
        length = len(pool)
        if length <= 0:
            raise ValueError(f"pool: expected a mapping of at least 1 byte, got {length} bytes")
        try:
            self._view = (ctypes.c_char * length).from_buffer(pool)  # a buffer export: pins the mapping
        except TypeError as e:
            raise ValueError(f"pool: expected a writable mapping (mmap.mmap), got {type(pool).__name__}: {e}") from e
        self.node_id = node_id
        self.base = ctypes.addressof(self._view)
        self.length = length
        self.backends = list(backends)
        self.settle_s = settle_s
        self.progress_wakeup_us = progress_wakeup_us
        self._region = np.array([[self.base, self.length, 0]], dtype=np.uint64)
        self._lock = threading.RLock()  # held by connect, forget, read, write and close
        self._peers: dict[str, Descriptor] = {}
        self._closed = False
        self._generation = 0  # how many initiating agents were made before the current one
        self._server, self._server_reg = self._agent(node_id, progress_thread=True)
        self._descriptor = Descriptor(node_id, self.base, self.length, bytes(self._server.get_agent_metadata())).pack()
        try:
            self._initiator, self._initiator_reg = self._agent(self._initiator_name(), progress_thread=False)
        except BaseException:
            self._drop(self._server, self._server_reg)
            raise

    # ------------------------------------------------------------------------------------------ the ABC
    def descriptor(self) -> bytes:
        """This node's descriptor (:class:`Descriptor`): a header (magic, version, the pool's address and length), the
        node id and the serving agent's NIXL metadata (UCX: ~300-500 bytes, its addresses and the pool's remote key).
        Called by the peer thread."""
        return self._descriptor

    @_locked
    def connect(self, peer: str, address: tuple[str, int], descriptor: bytes) -> None:
        """Load ``peer``'s descriptor into the initiating agent (UCX endpoints are made at once, connected on the first
        read). The same descriptor again: nothing; another: the old one is removed first (the peer restarted).
        ``address`` is not used (the descriptor has UCX's addresses). ValueError for a malformed descriptor or one
        whose agent another peer already has; TransferError if NIXL refuses it. Called by the peer thread."""
        self._check_open("connect")
        d = Descriptor.parse(descriptor)
        old = self._peers.get(peer)
        if old == d:
            return
        clash = [p for p, q in self._peers.items() if q.agent == d.agent and p != peer]
        if clash or d.agent == self.node_id:
            raise ValueError(
                f"descriptor: peer {peer!r}'s NIXL agent is named {d.agent!r}, which "
                + (f"peer {clash[0]!r} has too" if clash else "is this node's own id")
                + " (node ids must be unique in a cluster)"
            )
        if old is not None:
            self.forget(peer)
        self._load(d)
        self._peers[peer] = d

    @_locked
    def forget(self, peer: str) -> None:
        """Unload ``peer``'s descriptor (its UCX endpoints are closed); a no-op for an unknown peer. Called by the
        peer thread."""
        old = self._peers.pop(peer, None)
        if old is not None and not self._closed:
            self._remove_remote(old.agent)

    @_locked
    def read(
        self,
        peer: str,
        spans: Sequence[Span],
        timeout: float,
        crcs: Sequence[int] | None = None,
        sealed: bool = False,
    ) -> None:
        """Copy ``spans`` of ``peer``'s pool into this node's pool: one NIXL READ of all of them, polled until it is
        done (spinning first, then sleeping 50 us, doubling up to 1 ms). Called by the peer thread.

        Raises ValueError (nothing moved) for a span outside either pool or of no bytes, or a timeout <= 0;
        TransferError for an unknown peer, a READ that NIXL refuses or that fails (a dead peer: at once), or one
        still in flight after ``timeout`` seconds.

        A READ still in flight at the timeout cannot be cancelled: releasing its NIXL handle frees the request
        but not the UCX operation (``ucp_request_cancel`` cancels only tagged receives, not RMA), whose bytes then
        still land in this pool, after the caller freed the slots (seen here over TCP: all 64 MiB of a READ
        released while in flight arrived once the peer went on). So ``read`` first waits up to ``settle_s`` more
        for it to end by itself (done or failed: then nothing more is written); if it has not, it destroys the
        initiating agent (its UCX worker with it: nothing more is written once that returns; RDMA: the memory is
        deregistered from it too) and makes a new one, with every connected peer loaded again, before it raises.
        So the caller may free the slots whenever ``read`` raises, which is within about ``timeout + settle_s``
        plus the remaking (a few ms). The cost over TCP: the stalled peer aborts if it gets to answer the
        abandoned READ (module docstring).

        ``crcs``: not checked here (the caller checks the slots after the READ). ``sealed``: TransferError, nothing
        moved: a one-sided READ cannot encrypt, so a sealed namespace's chunks never cross over NIXL."""
        _not_sealed("read", sealed)
        self._transfer("READ", peer, spans, timeout)

    @_locked
    def write(self, peer: str, spans: Sequence[Span], timeout: float, sealed: bool = False) -> None:
        """Copy ``spans`` of this node's pool into ``peer``'s pool (a P/D push): one NIXL WRITE, as :meth:`read`
        (its errors, its timeout, its abandonment). Called by the peer thread.

        NIXL's WRITE is one-sided: the peer's NIXL lets any agent that loaded its descriptor write anywhere in its
        registered pool; nothing on the peer checks that the spans are slots it reserved for this node (kvx's TCP
        transport does). Here they are checked against the peer's pool's bounds only. An abandoned WRITE: the
        remade agent sends nothing more, but bytes already on their way (TCP: in the kernels' socket buffers, a few
        MiB at most; they land when the peer's UCX worker reads them) may still reach the peer's slots after
        ``write`` raised, so the peer should not hand those slots to anything else on the writer's word alone.
        ``sealed``: TransferError, as for :meth:`read`."""
        _not_sealed("write", sealed)
        self._transfer("WRITE", peer, spans, timeout)

    def _transfer(self, op: str, peer: str, spans: Sequence[Span], timeout: float) -> None:
        """One NIXL ``op`` (READ or WRITE) of ``spans`` with ``peer``, waited for (:meth:`read`)."""
        verb = op.lower()
        self._check_open(verb)
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(
                f"{verb}: peer {peer!r} is not connected (connect() it first; known: {sorted(self._peers)})"
            )
        if timeout <= 0:
            raise ValueError(f"timeout: expected > 0 seconds, got {timeout}")
        if not spans:
            return
        local, remote = self._descs(p, spans)
        nbytes = int(local[:, 1].sum())
        what = f"a {op} of {len(spans)} spans ({nbytes} bytes) {'from' if op == 'READ' else 'to'} peer {peer!r}"
        agent = self._initiator
        started = time.monotonic()
        try:
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), p.agent
            )
        except Exception as e:
            raise TransferError(f"{verb}: NIXL refused {what}: {e!r}") from e
        try:
            state = agent.transfer(handle)
        except Exception as e:
            state = f"ERR ({e!r})"
        state = self._wait(agent, handle, state, started + timeout)
        if state == "DONE":
            self._release(handle)
            return
        if state != "PROC":
            self._release(handle)
            raise TransferError(f"{verb}: {what} failed after {time.monotonic() - started:.3f} s: NIXL state {state}")
        state = self._wait(agent, handle, state, time.monotonic() + self.settle_s)
        if state != "PROC":
            self._release(handle)
            raise TransferError(
                f"{verb}: {what} timed out after {timeout} s (it ended, {state}, within the next {self.settle_s} s; "
                "nothing more will move)"
            )
        box = [handle]
        del handle, agent  # the remake must hold the last references to the old agent
        self._remake_initiator(box)
        raise TransferError(
            f"{verb}: {what} timed out after {timeout} s and was still in flight {self.settle_s} s later: abandoned "
            "(the initiating agent was remade, so this node moves nothing more of it)"
        )

    @_locked
    def close(self) -> None:
        """Release both agents and the pool's buffer export (the mapping may be closed after this). Idempotent.
        Called by the peer thread, once no read is in progress."""
        if self._closed:
            return
        self._closed = True
        self._peers.clear()
        initiator, reg = self._initiator, self._initiator_reg
        self._initiator = self._initiator_reg = None
        self._drop(initiator, reg)
        server, reg = self._server, self._server_reg
        self._server = self._server_reg = None
        self._drop(server, reg)
        self._region = None
        self._view = None  # ends the buffer export

    # ------------------------------------------------------------------------------------------ helpers
    @property
    def generation(self) -> int:
        """How many times the initiating agent was remade (an abandoned transfer each time)."""
        return self._generation

    def _initiator_name(self) -> str:
        return f"{self.node_id}/init{self._generation}"

    def _agent(self, name: str, progress_thread: bool):
        """A NIXL agent over :attr:`backends`, the whole pool registered with it as DRAM."""
        cfg = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(self.backends))
        try:
            with _progress_wakeup(self.progress_wakeup_us):
                agent = nixl_agent(name, cfg)
        except Exception as e:
            raise TransferError(f"NIXL could not make agent {name!r} with backends {self.backends}: {e!r}") from e
        missing = [b for b in self.backends if b not in agent.backends]
        if missing:  # NIXL only warns
            raise TransferError(
                f"backends: NIXL has no plugin for {missing} (available: {agent.get_plugin_list()}); agent {name!r}"
            )
        try:
            reg = agent.register_memory(self._region, "DRAM")
        except Exception as e:
            raise TransferError(
                f"NIXL could not register the pool ({self.length} bytes at 0x{self.base:x}) with agent {name!r}: {e!r}"
            ) from e
        return agent, reg

    @staticmethod
    def _drop(agent, reg) -> None:
        """Deregister the pool from ``agent``; the agent ends when its last reference goes (here)."""
        if agent is None:
            return
        try:
            agent.deregister_memory(reg)
        except Exception as e:  # the agent goes anyway
            log.warning("NIXL agent %s: deregistering the pool failed: %r", agent.name, e)

    def _load(self, d: Descriptor) -> None:
        """Load ``d``'s metadata into the initiating agent; TransferError if NIXL refuses it or names another agent."""
        try:
            agent = self._initiator.add_remote_agent(d.metadata)
        except Exception as e:
            raise TransferError(f"connect: NIXL could not load agent {d.agent!r}'s metadata: {e!r}") from e
        agent = agent.decode() if isinstance(agent, bytes) else str(agent)
        if agent != d.agent:
            self._remove_remote(agent)
            raise ValueError(f"descriptor: its header names agent {d.agent!r}, its NIXL metadata {agent!r}")

    def _remove_remote(self, agent: str) -> None:
        if self._initiator is None:  # a remake failed half-way: nothing is loaded
            return
        try:
            self._initiator.remove_remote_agent(agent)
        except Exception as e:
            log.warning("NIXL: removing remote agent %r failed: %r", agent, e)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise TransferError(f"{what}: the NIXL transport of node {self.node_id!r} is closed")
        self._ensure_initiator()

    def _descs(self, p: Descriptor, spans: Sequence[Span]) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 (address, length, device 0) arrays of the local and the remote side; ValueError naming the first
        span outside its pool."""
        a = np.array([(s.local, s.remote, s.nbytes) for s in spans])
        ok = a.dtype == np.int64 and a.shape == (len(spans), 3)  # ints that fit (else float, object: checked below)
        if ok:
            loc, rem, nb = a[:, 0], a[:, 1], a[:, 2]
            ok = not ((nb <= 0) | (loc < 0) | (rem < 0) | (loc > self.length - nb) | (rem > p.length - nb)).any()
        if not ok:
            self._reject(p, spans)
        local = np.zeros((len(spans), 3), dtype=np.uint64)
        remote = np.zeros((len(spans), 3), dtype=np.uint64)
        local[:, 0] = self.base + loc.astype(np.uint64)
        local[:, 1] = nb
        remote[:, 0] = np.uint64(p.base) + rem.astype(np.uint64)
        remote[:, 1] = nb
        return local, remote

    def _reject(self, p: Descriptor, spans: Sequence[Span]) -> None:
        """Raise the ValueError that names the first bad span."""
        for i, s in enumerate(spans):
            if not all(isinstance(v, int) for v in (s.remote, s.local, s.nbytes)):
                why = f"expected int offsets and length, got {type(s.remote).__name__}, {type(s.local).__name__}, "
                why += type(s.nbytes).__name__
            elif s.nbytes <= 0:
                why = f"nbytes: expected > 0, got {s.nbytes}"
            elif s.local < 0 or s.local + s.nbytes > self.length:
                why = f"local: expected [local, local + nbytes) within this pool's [0, {self.length}), got {s.local}"
            elif s.remote < 0 or s.remote + s.nbytes > p.length:
                why = (
                    f"remote: expected [remote, remote + nbytes) within the peer's pool [0, {p.length}), got {s.remote}"
                )
            else:
                continue
            raise ValueError(f"spans[{i}] = {s}: {why}")
        raise ValueError(f"spans: expected Spans of ints, got {list(spans)[:4]}...")

    @staticmethod
    def _wait(agent, handle, state: str, deadline: float) -> str:
        """Poll ``handle`` (each poll progresses the initiating agent's UCX worker) until it is not PROC or ``deadline``
        passes: :data:`POLL_SPINS` polls back to back, then sleeps from :data:`POLL_PAUSE_S` doubling up to
        :data:`POLL_PAUSE_MAX_S`. Its last state (DONE, PROC, ERR ...)."""
        spins = 0
        pause = POLL_PAUSE_S
        while state == "PROC":
            try:
                state = agent.check_xfer_state(handle)
            except Exception as e:
                return f"ERR ({e!r})"
            if state != "PROC" or time.monotonic() >= deadline:
                return state
            spins += 1
            if spins > POLL_SPINS:
                time.sleep(pause)
                pause = min(pause * 2, POLL_PAUSE_MAX_S)
        return state

    @staticmethod
    def _release(handle) -> None:
        try:
            handle.release()
        except Exception as e:  # an ended request releases; log and leave it to the agent
            log.warning("NIXL: releasing a transfer handle failed: %r", e)

    def _remake_initiator(self, box: list) -> None:
        """Destroy the initiating agent (and with it the UCX worker that would finish the transfer whose handle is
        ``box``'s only item, the last reference to it) and make a new one (:meth:`_ensure_initiator`)."""
        old, reg = self._initiator, self._initiator_reg
        self._initiator = self._initiator_reg = None
        handle = box.pop()
        self._release(handle)  # frees the request (not the UCX operation: that goes with the worker)
        del handle
        for p in self._peers.values():
            try:
                old.remove_remote_agent(p.agent)
            except Exception as e:
                log.warning("NIXL: removing remote agent %r failed: %r", p.agent, e)
        self._drop(old, reg)
        del old, reg  # the last references: the agent, its UCX worker and context end here
        self._generation += 1
        self._ensure_initiator()

    def _ensure_initiator(self) -> None:
        """Make the initiating agent if there is none (after a remake that failed half-way) and load every connected
        peer into it; peers that NIXL now refuses are forgotten (logged). TransferError if no agent can be made."""
        if self._initiator is not None:
            return
        self._initiator, self._initiator_reg = self._agent(self._initiator_name(), progress_thread=False)
        for peer, p in list(self._peers.items()):
            try:
                self._load(p)
            except Exception as e:
                log.warning("NIXL: peer %r could not be loaded again after a remake (forgotten): %r", peer, e)
                del self._peers[peer]
