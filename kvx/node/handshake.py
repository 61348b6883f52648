"""Who may talk to a node over the network: members of its cluster, proven by an HMAC challenge-response both ways
before anything else crosses (no pool geometry, no transport metadata, no key).

A node that accepts a connection sends a 16-byte nonce; the dialer answers with its node id, the role of the
connection (``control``: requests about chunks; ``data``: :class:`kvx.node.tcp.TcpTransport`'s bytes), a nonce of its
own and ``HMAC-SHA256(secret, "kvx-join" | nonce_a | nonce_d | id | role)``. The acceptor checks it (in constant
time) and answers with its id and ``HMAC-SHA256(secret, "kvx-admit" | nonce_d | nonce_a | id)``, which the dialer
checks in turn, then whatever the acceptor tells members (its transport and the transport's descriptor). A node
without the secret learns nothing but the acceptor's nonce and one refusal; a node that answers without it is not
believed. The nonces make a recorded exchange useless to replay.

Both ends come out of it with a :class:`Keying` (:func:`dial_keyed`, :func:`admit_keyed`): the two nonces and the two
ids, from which each derives the connection's keys with the secret it holds (:mod:`.wire_seal`: a sealed namespace's
chunks cross encrypted; no key ever crosses).

Frames are :mod:`.protocol`'s (JSON bodies), on blocking sockets with a timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from .protocol import HEADER, body_length, decode, encode

ROLES = ("control", "data")
_MIN_SECRET = 16  # bytes: a shorter secret is guessable


@dataclass(frozen=True)
class Keying:
    """What a connection's two ends share after the handshake, to derive its keys with the secret
    (:func:`kvx.node.wire_seal.derive_keys`): the nonces and ids of both, and which end this is."""

    acceptor_nonce: bytes
    dialer_nonce: bytes
    acceptor: str  # the acceptor's node id
    dialer: str  # the dialer's node id
    side: str  # "dialer" or "acceptor": this end


class Denied(ConnectionError):
    """The other side is not a member (its MAC does not match), or refused us as one."""


def read_secret(path: str) -> bytes:
    """The cluster secret in ``path`` (surrounding whitespace stripped); ``ValueError`` naming ``--secret-file``
    if it cannot be read or is shorter than 16 bytes."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(
            f"--secret-file: expected a readable file holding the cluster secret, got {path!r} ({e.strerror})"
        ) from None
    if len(secret) < _MIN_SECRET:
        raise ValueError(
            f"--secret-file: expected a secret of at least {_MIN_SECRET} bytes (e.g. `head -c 32 /dev/urandom | "
            f"base64 > FILE`), got {len(secret)} bytes in {path!r}"
        )
    return secret


def _mac(secret: bytes, label: bytes, *parts: bytes) -> str:
    h = hmac.new(secret, label, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "little") + p)  # length-prefixed: no two part lists hash alike
    return h.hexdigest()


def send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(encode(msg))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the peer closed the connection")
        buf += part
    return bytes(buf)


def recv(sock: socket.socket) -> dict:
    """One frame's body; ``ConnectionError`` on EOF, ``ProtocolError`` (a ValueError) on a bad frame."""
    return decode(recv_exact(sock, body_length(recv_exact(sock, HEADER.size))))


def dial(
    address: tuple[str, int], secret: bytes, node_id: str, role: str, timeout: float
) -> tuple[socket.socket, dict]:
    """Connect to the node at ``address`` as member ``node_id`` for ``role``: the socket (blocking, ``timeout``
    per operation) and the acceptor's welcome (``node``: its id, and what it tells members). :class:`Denied` if it
    refused us or is no member; ``OSError`` if it cannot be reached."""
    sock, welcome, _ = dial_keyed(address, secret, node_id, role, timeout)
    return sock, welcome


def dial_keyed(
    address: tuple[str, int], secret: bytes, node_id: str, role: str, timeout: float
) -> tuple[socket.socket, dict, Keying]:
    """As :func:`dial`, and the connection's :class:`Keying` (this end the dialer)."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = recv(sock)
        theirs = bytes.fromhex(str(challenge.get("nonce", "")))
        ours = os.urandom(16)
        mac = _mac(secret, b"kvx-join", theirs, ours, node_id.encode(), role.encode())
        send(sock, {"op": "join", "node": node_id, "role": role, "nonce": ours.hex(), "mac": mac})
        welcome = recv(sock)
        if not welcome.get("ok"):
            raise Denied(f"the node at {address[0]}:{address[1]} refused this node: {welcome.get('error')}")
        peer = str(welcome.get("node", ""))
        want = _mac(secret, b"kvx-admit", ours, theirs, peer.encode())
        if not hmac.compare_digest(want, str(welcome.get("mac", ""))):
            raise Denied(f"the node at {address[0]}:{address[1]} does not hold this cluster's secret")
        return sock, welcome, Keying(theirs, ours, peer, node_id, "dialer")
    except BaseException:
        sock.close()
        raise


def admit(sock: socket.socket, secret: bytes, node_id: str, welcome: dict | None = None) -> tuple[str, str]:
    """Accept a dialer on ``sock`` if it proves the secret: its (node id, role), after ``welcome`` (what members are
    told) was sent with this node's proof. :class:`Denied` (after telling it so) otherwise."""
    peer, role, _ = admit_keyed(sock, secret, node_id, welcome)
    return peer, role


def admit_keyed(
    sock: socket.socket, secret: bytes, node_id: str, welcome: dict | None = None
) -> tuple[str, str, Keying]:
    """As :func:`admit`, and the connection's :class:`Keying` (this end the acceptor)."""
    ours = os.urandom(16)
    send(sock, {"nonce": ours.hex()})
    msg = recv(sock)
    peer, role = str(msg.get("node", "")), str(msg.get("role", ""))
    try:
        theirs = bytes.fromhex(str(msg.get("nonce", "")))
    except ValueError:
        theirs = b""
    want = _mac(secret, b"kvx-join", ours, theirs, peer.encode(), role.encode())
    if msg.get("op") != "join" or len(theirs) != 16 or not hmac.compare_digest(want, str(msg.get("mac", ""))):
        send(sock, {"ok": False, "error": "cluster secret: the join's MAC does not match this node's secret"})
        raise Denied(f"node {peer!r}: its MAC does not match this cluster's secret")
    if role not in ROLES:
        send(sock, {"ok": False, "error": f"role: expected one of {', '.join(ROLES)}, got {role!r}"})
        raise Denied(f"node {peer!r}: role {role!r}")
    mac = _mac(secret, b"kvx-admit", theirs, ours, node_id.encode())
    send(sock, {"ok": True, "node": node_id, "mac": mac, **(welcome or {})})
    return peer, role, Keying(ours, theirs, node_id, peer, "acceptor")
