"""The step channel between a leader and its followers: TCP, length-prefixed pickles.

The leader listens on the coordinator's port + 1; each follower connects,
says hello with its rank and fingerprint, and is welcomed or refused (with
every differing entry named). After that the leader sends step messages in
the order it runs them, and each follower answers every collected step with
the digest of its sampled tokens. The leader's reader threads compare those
digests with its own and notice a follower that hangs up; either fails the
link, which the engine turns into an engine failure.

The channel carries pickles: it is for the hosts of one job, on a network
they trust (the same one jax.distributed's coordinator runs on).
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from esurge.engine.multihost.fingerprint import Fingerprint, differences

__all__ = ["FollowerLink", "HandshakeError", "LeaderLink", "LinkError", "step_address"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")


class LinkError(RuntimeError):
    """The step channel broke: a host left, diverged or never came."""


class HandshakeError(LinkError):
    """A follower was refused: its fingerprint differs (`differences` names how)."""

    def __init__(self, rank: int, diffs: list[str]) -> None:
        super().__init__(f"host {rank} does not match the leader (leader vs follower): "
                         + "; ".join(diffs))
        self.rank = rank
        self.differences = diffs


def step_address(coordinator_address: str) -> tuple[str, int]:
    """The step channel's (host, port): the coordinator's host, its port + 1."""
    host, _, port = coordinator_address.rpartition(":")
    return host, int(port) + 1


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise LinkError("the other host closed the step channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    return pickle.loads(_read_exactly(sock, size))


class LeaderLink:
    """The leader's end: one connection per follower."""

    def __init__(self, address: tuple[str, int], num_followers: int, own: Fingerprint,
                 timeout_s: float = 300.0) -> None:
        self.failure: LinkError | None = None
        self.on_failure: Callable[[LinkError], None] | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._digests: dict[int, str] = {}  # step -> the leader's digest
        self._theirs: dict[int, dict[int, str]] = {}  # step -> rank -> digest
        self._server = socket.create_server(address, reuse_port=False)
        self._server.settimeout(timeout_s)
        self._peers: dict[int, socket.socket] = {}
        try:
            while len(self._peers) < num_followers:
                self._welcome(self._server.accept()[0], own)
        except TimeoutError as err:
            raise LinkError(f"{num_followers - len(self._peers)} follower(s) did not connect "
                            f"to {address[0]}:{address[1]} within {timeout_s:.0f} s") from err
        for rank, sock in self._peers.items():
            threading.Thread(target=self._read, args=(rank, sock), daemon=True,
                             name=f"esurge-follower-{rank}").start()

    def _welcome(self, sock: socket.socket, own: Fingerprint) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _, rank, theirs = _recv(sock)
        diffs = differences(own, theirs)
        if diffs:
            _send(sock, ("refused", diffs))
            sock.close()
            raise HandshakeError(rank, diffs)
        _send(sock, ("welcome",))
        self._peers[rank] = sock
        log.info("host %d joined the step channel", rank)

    def _read(self, rank: int, sock: socket.socket) -> None:
        try:
            while True:
                _, step, digest = _recv(sock)
                self._compare(step, rank, digest)
        except (LinkError, OSError, EOFError) as err:
            if self.failure is None and not self._closing:  # not the leader's own close
                self.fail(LinkError(f"host {rank} left the job ({err})"))

    def _compare(self, step: int, rank: int, digest: str) -> None:
        with self._lock:
            self._theirs.setdefault(step, {})[rank] = digest
            self._settle(step)

    def _settle(self, step: int) -> None:
        mine, theirs = self._digests.get(step), self._theirs.get(step, {})
        if mine is None:
            return
        for rank, digest in theirs.items():
            if digest != mine:
                self.fail(LinkError(f"host {rank} diverged at step {step}: its sampled "
                                    "tokens differ from the leader's"))
        if len(theirs) == len(self._peers):
            self._digests.pop(step, None)
            self._theirs.pop(step, None)

    def record(self, step: int, digest: str) -> None:
        """The leader's digest of a collected step, checked against the followers'."""
        with self._lock:
            self._digests[step] = digest
            self._settle(step)

    def send(self, message: Any) -> None:
        """Send a step message to every follower (LinkError once the link failed)."""
        if self.failure is not None:
            raise self.failure
        try:
            for sock in self._peers.values():
                _send(sock, message)
        except OSError as err:
            self.fail(LinkError(f"a follower left the job ({err})"))
            raise self.failure from err  # type: ignore[misc]

    def fail(self, error: LinkError) -> None:
        """Mark the link failed (once) and tell on_failure."""
        if self.failure is not None:
            return
        self.failure = error
        log.error("multi-host: %s", error)
        if self.on_failure is not None:
            self.on_failure(error)

    def close(self) -> None:
        """Tell the followers to stop, and close every connection."""
        self._closing = True
        for sock in self._peers.values():
            try:
                _send(sock, ("stop",))
                sock.close()
            except OSError:
                pass
        self._server.close()


class FollowerLink:
    """A follower's end: connects (retrying until the leader listens), handshakes."""

    def __init__(self, address: tuple[str, int], rank: int, own: Fingerprint,
                 timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock = socket.create_connection(address, timeout=5)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise LinkError(f"no leader listening on {address[0]}:{address[1]} "
                                    f"after {timeout_s:.0f} s") from err
                time.sleep(0.2)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self._sock, ("hello", rank, own))
        reply = _recv(self._sock)
        if reply[0] == "refused":
            raise HandshakeError(rank, reply[1])
        self.rank = rank

    def receive(self) -> Any:
        """The leader's next step message."""
        return _recv(self._sock)

    def send_digest(self, step: int, digest: str) -> None:
        """Answer a collected step with its digest."""
        _send(self._sock, ("digest", step, digest))

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()
