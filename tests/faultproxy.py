"""A fault-injecting HTTP proxy on loopback, in front of the tests' S3 server.

:class:`FaultProxy` forwards each HTTP request to the upstream endpoint (one request per
connection: it answers ``Connection: close``, so every request is framed by its own
connection) and, while a fault is set, answers requests that match it wrongly:

- ``"error"``: ``503 Service Unavailable`` with an S3 error body, never forwarded;
- ``"stall"``: the request is read and never answered (until the client gives up or the
  proxy closes);
- ``"truncate"``: the upstream answer's headers and half its body, then the connection
  closes (the ``Content-Length`` still promises all of it);
- ``"flip"``: the upstream answer with one byte of its body flipped: the byte at object
  offset ``offset`` when the answer holds it (a ranged GET starting at its ``Range``), else
  the middle one;
- ``"down"``: the connection is closed at once, as a server that was killed (nothing
  reaches the upstream until the fault is cleared: a "restart");
- ``"cut"``: this request's connection is closed before it reaches the upstream (the next
  request is served: a network fault, not a dead server);
- ``"lost"``: the request reaches the upstream, which does it; its answer never comes back
  (the connection is closed instead).

Everything is bounded: it listens on ``127.0.0.1`` only, on a free port; each connection
has its own daemon thread with socket timeouts; a stalled request waits at most until
:meth:`FaultProxy.close`, which closes every socket and joins the threads.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "Request", "MUTATING", "send"]

#: The methods of requests that change what the store holds (a GET or a HEAD never does).
MUTATING = ("PUT", "POST", "DELETE")

_TIMEOUT = 30.0  # any socket operation of the proxy
_MAX_HEAD = 64 << 10


@dataclass(frozen=True)
class Request:
    """What a fault's predicate sees of a request."""

    method: str
    target: str  # the path and query, e.g. /bucket?list-type=2&prefix=...
    headers: dict[str, str]  # lower-case names

    @property
    def ranged(self) -> bool:
        return "range" in self.headers

    @property
    def listing(self) -> bool:
        return self.method == "GET" and "list-type=" in self.target


class FaultProxy:
    """A proxy to ``upstream`` (``http://127.0.0.1:PORT``); its own URL is :attr:`endpoint`."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._mode: str | None = None
        self._modes: tuple[str | None, ...] = (None,)
        self._when: Callable[[Request], bool] = lambda _r: True
        self._times: int | None = None
        self._skip = 0
        self._offset: int | None = None
        self._then: Callable[[], None] | None = None
        self.faulted = 0  # requests answered wrongly so far
        self.seen: list[tuple[Request, str | None]] = []  # every request and its fault
        self.forwarded = 0  # requests passed through
        #: While not None, every request that changes the store (:data:`MUTATING`) as it is
        #: sent upstream, head and body, in that order: what tests/s3crash.py replays.
        #: Each is ``[head, body, answer]``, the answer filled in once it came.
        self.recorded: list[list[bytes]] | None = None
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    # -- control -----------------------------------------------------------------------------
    def fault(
        self,
        mode: str | tuple[str, ...] | None,
        *,
        when: Callable[[Request], bool] | None = None,
        times: int | None = None,
        after: int = 0,
        offset: int | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Answer requests matching ``when`` (all by default) with ``mode``: the first
        ``after`` matching requests pass, then ``times`` of them (all by default) are
        faulted. ``then`` runs once, before the first faulted request is answered (e.g.
        killing the upstream server). ``None`` clears the fault; a tuple of modes: each
        faulted request gets the next in turn."""
        modes = (mode,) if mode is None or isinstance(mode, str) else tuple(mode)
        assert modes and all(m in (None, "error", "stall", "truncate", "flip", "down", "cut",
                                    "lost") for m in modes), mode
        with self._lock:
            self._mode, self._modes = modes[0], modes
            self._when = when or (lambda _r: True)
            self._times, self._skip, self.faulted = times, after, 0
            self._offset, self._then = offset, then

    def storage_options(self, **extra: object) -> dict:
        """Options (as users write them) that reach the upstream through this proxy."""
        return {"key": "any", "secret": "any", "endpoint_url": self.endpoint, **extra}

    def close(self) -> None:
        """Stop: close the listener and every open connection, join the threads."""
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in list(self._sockets):
                _close(sock)
        self._acceptor.join(5)
        for thread in list(self._threads):
            thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving -----------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(_TIMEOUT)
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            with self._lock:
                self._sockets.add(client)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _choose(self, request: Request) -> str | None:
        mode = self._pick(request)
        with self._lock:
            self.seen.append((request, mode))
            then, self._then = (self._then, None) if mode else (None, self._then)
        if then is not None:
            then()
        return mode

    def _pick(self, request: Request) -> str | None:
        with self._lock:
            if self._mode == "down" and self.faulted:  # down once: down for everything
                self.faulted += 1
                return "down"
            if self._mode is None or not self._when(request):
                return None
            if self._skip > 0:
                self._skip -= 1
                return None
            if self._times is not None and self.faulted >= self._times:
                return None
            self.faulted += 1
            return self._modes[(self.faulted - 1) % len(self._modes)]

    def _serve(self, client: socket.socket) -> None:
        try:
            head, body = _read_request(client)
            if head is None:
                return
            request = _parse(head)
            mode = self._choose(request)
            if mode in ("down", "cut"):
                return
            if mode == "stall":
                self._closed.wait(_TIMEOUT * 4)
                return
            if mode == "error":
                client.sendall(_ERROR_503)
                return
            record = [head, body, b""]
            with self._lock:
                if self.recorded is not None and request.method in MUTATING:
                    self.recorded.append(record)
            answer = record[2] = self._forward(head, body)
            with self._lock:
                self.forwarded += 1
            if mode == "lost":
                return
            split = answer.find(b"\r\n\r\n") + 4
            if mode == "truncate":
                answer = answer[: split + max(0, (len(answer) - split) // 2)]
            elif mode == "flip" and len(answer) > split:
                at = split + self._flip_index(request, len(answer) - split)
                answer = answer[:at] + bytes([answer[at] ^ 0xFF]) + answer[at + 1 :]
            client.sendall(answer)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(client)
            _close(client)

    def _flip_index(self, request: Request, size: int) -> int:
        """Where in an answer's body of ``size`` bytes the flipped byte is."""
        if self._offset is None:
            return size // 2
        start = request.headers.get("range", "bytes=0-").removeprefix("bytes=").split("-")[0]
        index = self._offset - int(start or 0)
        return index if 0 <= index < size else size // 2

    def _forward(self, head: bytes, body: bytes) -> bytes:
        """The upstream's whole answer to the request (its connection closed after it)."""
        with socket.create_connection(self._upstream, timeout=_TIMEOUT) as upstream:
            with self._lock:
                self._sockets.add(upstream)
            try:
                answer = _exchange(upstream, head, body)
            finally:
                with self._lock:
                    self._sockets.discard(upstream)
        split = answer.find(b"\r\n\r\n")
        if split < 0:
            return answer
        # Tell the client this connection ends after the answer (it reconnects).
        status, *headers = answer[:split].split(b"\r\n")
        headers = [h for h in headers if not h.lower().startswith((b"connection:", b"keep-alive:"))]
        return b"\r\n".join([status, *headers, b"Connection: close"]) + answer[split:]


def _exchange(upstream: socket.socket, head: bytes, body: bytes) -> bytes:
    """Send the request (head and body) on its own connection; the whole answer."""
    lines = head.split(b"\r\n")
    kept = [
        line
        for line in lines[1:]
        if line and not line.lower().startswith((b"connection:", b"keep-alive:", b"expect:"))
    ]
    upstream.sendall(b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""]) + body)
    chunks = []
    while chunk := upstream.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def send(endpoint: str, head: bytes, body: bytes) -> bytes:
    """Send a request (as :attr:`FaultProxy.recorded` holds it) to ``endpoint``; the answer."""
    parts = urlsplit(endpoint)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80),
                                  timeout=_TIMEOUT) as upstream:
        return _exchange(upstream, head, body)


_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable'
    b"</Code><Message>injected by faultproxy</Message></Error>"
)
_ERROR_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
    b"Content-Length: " + str(len(_ERROR_BODY)).encode() + b"\r\n"
    b"Connection: close\r\n\r\n" + _ERROR_BODY
)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _read_request(client: socket.socket) -> tuple[bytes | None, bytes]:
    """The request's head (through the blank line) and its body; ``None`` at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = client.recv(1 << 16)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > _MAX_HEAD:
            return None, b""
    split = data.index(b"\r\n\r\n") + 4
    head, rest = data[:split], data[split:]
    headers = _parse(head).headers
    if headers.get("expect", "").lower() == "100-continue":
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = client.recv(1 << 16)
            if not chunk:
                break
            rest += chunk
        return head, rest
    length = int(headers.get("content-length", "0") or 0)
    while len(rest) < length:
        chunk = client.recv(min(1 << 20, length - len(rest)))
        if not chunk:
            break
        rest += chunk
    return head, rest


def _parse(head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    method, target, *_ = (lines[0].split(" ") + ["", ""])[:3]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Request(method, target, headers)
