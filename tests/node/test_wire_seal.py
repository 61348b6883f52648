"""A data connection's keys (:mod:`kvx.node.wire_seal`): derived by both ends from the cluster secret and the
handshake's nonces and ids (:func:`kvx.node.handshake.dial_keyed` / ``admit_keyed``), one per direction, never sent;
a span's sealed pieces round-trip into the receiver's buffer with the plaintext's CRC32C, and fail on a changed byte,
another key, another place, or a nonce counter at its end."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvx.node import handshake
from kvx.node.handshake import Keying
from kvx.node.wire_seal import PIECE, SealError, WireSession, derive_keys
from kvx.store.codec import crc32c_update

SECRET = b"kvx-cluster-secret-0123456789"


def _left() -> float:
    return 10.0


def _keyed_pair() -> tuple[tuple[socket.socket, Keying], tuple[socket.socket, Keying]]:
    """Both ends of one admitted data connection, and their Keyings."""
    listener = socket.create_server(("127.0.0.1", 0))
    got = {}

    def accept() -> None:
        sock, _ = listener.accept()
        sock.settimeout(10)
        peer, role, keying = handshake.admit_keyed(sock, SECRET, "acceptor-node")
        got["acceptor"] = (sock, keying, peer, role)

    th = threading.Thread(target=accept)
    th.start()
    sock, welcome, keying = handshake.dial_keyed(listener.getsockname(), SECRET, "dialer-node", "data", 10)
    th.join(10)
    listener.close()
    a_sock, a_keying, peer, role = got["acceptor"]
    assert (peer, role, welcome["node"]) == ("dialer-node", "data", "acceptor-node")
    return (sock, keying), (a_sock, a_keying)


def test_both_ends_derive_the_same_keys_from_what_the_handshake_exchanged():
    (d_sock, d), (a_sock, a) = _keyed_pair()
    try:
        assert (d.side, a.side) == ("dialer", "acceptor")
        assert (d.acceptor_nonce, d.dialer_nonce, d.acceptor, d.dialer) == (
            a.acceptor_nonce,
            a.dialer_nonce,
            a.acceptor,
            a.dialer,
        )
        to_dialer, to_acceptor = derive_keys(SECRET, d)
        assert to_dialer != to_acceptor and len(to_dialer) == len(to_acceptor) == 32  # one key per direction
        assert derive_keys(SECRET, a) == (to_dialer, to_acceptor)
        other = Keying(os.urandom(16), d.dialer_nonce, d.acceptor, d.dialer, "dialer")
        assert derive_keys(SECRET, other)[0] != to_dialer  # fresh nonces: fresh keys
        assert derive_keys(b"another-secret-of-this-cluster", d)[0] != to_dialer

        dialer, acceptor = WireSession(SECRET, d), WireSession(SECRET, a)
        data = bytearray(os.urandom(2 * PIECE + 12345))  # pieces, the last one short
        got = bytearray(len(data))
        th = threading.Thread(target=acceptor.send_span, args=(a_sock, memoryview(data), 4096, _left))
        th.start()
        crc = dialer.recv_span(d_sock, memoryview(got), 4096, _left)
        th.join(10)
        assert got == data and crc == crc32c_update(memoryview(data))
        back = bytearray(len(data))  # the other direction, its own key and counter
        th = threading.Thread(target=dialer.send_span, args=(d_sock, memoryview(data), 0, _left))
        th.start()
        assert acceptor.recv_span(a_sock, memoryview(back), 0, _left) == crc
        th.join(10)
        assert back == data
    finally:
        d_sock.close()
        a_sock.close()


def _pair(secret_a: bytes = SECRET) -> tuple[WireSession, WireSession, socket.socket, socket.socket]:
    k = dict(acceptor_nonce=os.urandom(16), dialer_nonce=os.urandom(16), acceptor="a", dialer="d")
    s1, s2 = socket.socketpair()
    return WireSession(secret_a, Keying(**k, side="acceptor")), WireSession(SECRET, Keying(**k, side="dialer")), s1, s2


@pytest.mark.parametrize("case", ["byte", "secret", "offset"])
def test_a_changed_byte_another_key_or_another_place_fails_the_tag(case):
    sender, receiver, s1, s2 = _pair(b"another-secret-of-this-cluster" if case == "secret" else SECRET)
    data = bytearray(os.urandom(PIECE // 2))
    try:
        if case == "byte":  # the ciphertext as sent, with one byte changed on the way
            mirror, tap = socket.socketpair()
            sender.send_span(mirror, memoryview(data), 0, _left)
            wire = bytearray(tap.recv(len(data) + 16, socket.MSG_WAITALL))
            wire[1000] ^= 1
            s1.sendall(wire)
            mirror.close()
            tap.close()
        else:
            sender.send_span(s1, memoryview(data), 0, _left)
        with pytest.raises(SealError, match="failed its GCM tag"):
            receiver.recv_span(s2, memoryview(bytearray(len(data))), 4096 if case == "offset" else 0, _left)
    finally:
        s1.close()
        s2.close()


def test_a_connection_stops_before_its_nonce_counter_wraps():
    sender, _, s1, s2 = _pair()
    sender._sent = (1 << 96) - 1
    try:
        sender.send_span(s1, memoryview(bytearray(10)), 0, _left)  # the last nonce
        with pytest.raises(SealError, match="nonce counter is at its end"):
            sender.send_span(s1, memoryview(bytearray(10)), 0, _left)
    finally:
        s1.close()
        s2.close()
