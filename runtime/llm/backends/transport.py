"""A lean HTTP/1.1 transport for httpx on asyncio streams, with a keep-alive pool.

The official ``ollama.AsyncClient`` sends through httpx, and httpx through httpcore and
anyio by default. With a thousand model calls in flight on one event loop, that default
path costs about 3 ms of Python per call (pool scans on every response, anyio's socket
attribute lookups, an address parse per connect): measured on the makespan bench, 3 of
the worker's 4.5 CPU seconds. :class:`StreamTransport` is what a loopback model server
needs and no more: HTTP/1.1 over :func:`asyncio.open_connection` (TLS when the URL says
``https``), ``Content-Length``, chunked and read-until-close bodies, streamed to httpx
as they arrive, idle connections kept per host for ``keepalive_expiry`` seconds.

Limits: at most ``max_connections`` requests in flight (a semaphore; a wait longer than
the pool timeout is :class:`httpx.PoolTimeout`, saying it waited for a free connection).
Timeouts follow httpx's per-request ``connect``/``read``/``write`` values. Failures are
httpx's own exceptions (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``WriteError``, ``RemoteProtocolError``...), so callers classify them as before.

Strict where httpx (h11) is strict: a response head (interim ``1xx`` heads included) over
:data:`MAX_HEAD_BYTES` is refused; a chunk size must be hex digits, and a chunk's data must
be followed by CRLF. A connection is reused only when its response was read to the end
and neither side asked to close it; a cancelled or failed exchange closes its connection.
A kept-alive connection the server closed while it sat idle (it answers the next request
with EOF or a reset, before a byte of response) is replaced by a new one and the request
sent again, once.

:class:`LeanAsyncClient` reads ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/``NO_PROXY``
as httpx would without a custom transport (httpx itself ignores them when a transport is
given): a proxied URL goes through httpx's own proxy transport, the others through this
one. It follows redirects when the client asks for them (the ``ollama`` client does).
:meth:`LeanAsyncClient.open_stream` sends a JSON request on the same lean path and hands
the response over with its body unread, for replies streamed as they are generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx

from runtime.llm.gate import request_sent

#: The largest response head (status line and headers, interim 1xx heads included).
MAX_HEAD_BYTES = 64 * 1024
#: A chunk size line: hex digits (at most 16), then optional ``;extensions``.
_HEX = frozenset(b"0123456789abcdefABCDEF")
#: Body bytes handed to httpx at a time.
READ_CHUNK = 64 * 1024

_Key = tuple[str, str, int]


class _Connection:
    """One open socket and when it was last returned to the pool."""

    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry: float) -> bool:
        """Still open, nothing unread from the server, not idle too long."""
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and now - self.idle_since < expiry)

    def close(self) -> None:
        """Close the socket (no wait)."""
        self.writer.close()


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Turn the failures of reading ``what`` from a connection into httpx's errors."""
    try:
        yield
    except TimeoutError as exc:
        raise httpx.ReadTimeout(f"timed out reading {what}") from exc
    except asyncio.IncompleteReadError as exc:
        raise httpx.RemoteProtocolError(
            f"the server closed the connection before the end of {what}") from exc
    except asyncio.LimitOverrunError as exc:
        raise httpx.RemoteProtocolError(
            f"a line of {what} is longer than {MAX_HEAD_BYTES // 1024} KiB") from exc
    except OSError as exc:
        raise httpx.ReadError(f"reading {what} failed: {exc}") from exc


async def _read_within(call: Any, timeout: float | None, what: str) -> bytes:
    """Await one read of ``what`` for at most ``timeout`` s, failing as httpx does."""
    with _reading(what):
        async with asyncio.timeout(timeout):
            data: bytes = await call
    return data


class _ClosedUnanswered(httpx.RemoteProtocolError):
    """The server closed (or reset) the connection before a byte of the response."""


def _chunk_size(line: bytes) -> int:
    """The size on a chunk's first line (``line`` ends with CRLF), strictly hex."""
    digits = line[:-2].split(b";", 1)[0].strip(b" \t")
    if not digits or len(digits) > 16 or not _HEX.issuperset(digits):
        raise httpx.RemoteProtocolError(f"bad chunk size line {line[:40]!r}")
    return int(digits, 16)


def _deadline(timeouts: dict[str, Any], name: str) -> float | None:
    value = timeouts.get(name)
    return None if value is None else float(value)


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection as httpx asks for it."""

    def __init__(self, transport: StreamTransport, key: _Key, conn: _Connection,
                 length: int | None, chunked: bool, keep_alive: bool,
                 read_timeout: float | None) -> None:
        self._transport = transport
        self._key = key
        self._conn = conn
        self._length = length
        self._chunked = chunked
        self._keep_alive = keep_alive
        self._timeout = read_timeout
        self._complete = False
        self._closed = False

    async def _read(self, call: Any) -> bytes:
        return await _read_within(call, self._timeout, "the response body")

    def __aiter__(self) -> AsyncIterator[bytes]:
        # A chunked body is its own generator, not one more layer around it (every layer
        # costs each piece of a streamed reply a step).
        return self._chunks(self._conn.reader) if self._chunked else self._unchunked()

    async def _unchunked(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        if self._length is not None:
            remaining = self._length
            while remaining:
                data = await self._read(reader.readexactly(min(remaining, READ_CHUNK)))
                remaining -= len(data)
                yield data
        else:
            self._keep_alive = False
            while data := await self._read(reader.read(READ_CHUNK)):
                yield data
        self._complete = True

    async def _chunks(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """A chunked body's data, read in as few reads as its bytes arrive in.

        One read (up to :data:`READ_CHUNK`) per arrival, and every chunk complete in the
        buffer then handed over at once: a streamed reply (Ollama's NDJSON, a line a
        chunk) cost two reads, each under its own timeout, per line. Strict as before: a
        size line of hex digits (at most :data:`MAX_HEAD_BYTES`), CRLF after each chunk's
        data, trailers (bounded) up to the blank line after the last chunk.
        """
        buf = bytearray()
        while True:
            out: list[bytes] = []
            done = False
            while (eol := buf.find(b"\r\n")) >= 0:
                size = _chunk_size(bytes(buf[:eol + 2]))
                if size == 0:  # the last chunk: trailers up to the blank line
                    end = 0 if buf.startswith(b"\r\n", eol + 2) else buf.find(
                        b"\r\n\r\n", eol + 2) - eol
                    if end >= 0:
                        done = True
                    elif len(buf) > MAX_HEAD_BYTES:
                        raise httpx.RemoteProtocolError(
                            f"the trailers are larger than {MAX_HEAD_BYTES // 1024} KiB")
                    break
                start = eol + 2
                if len(buf) < start + size + 2:
                    break  # the rest of this chunk is still to come
                if buf[start + size:start + size + 2] != b"\r\n":
                    raise httpx.RemoteProtocolError(
                        f"a chunk of {size} bytes is not followed by CRLF: "
                        f"{bytes(buf[start + size:start + size + 2])!r}")
                out.append(bytes(buf[start:start + size]))
                del buf[:start + size + 2]
            else:
                if len(buf) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError(
                        f"a line of the response body is longer than "
                        f"{MAX_HEAD_BYTES // 1024} KiB")
            if out:
                yield b"".join(out)
            if done:
                self._complete = True
                return
            data = await self._read(reader.read(READ_CHUNK))
            if not data:
                raise httpx.RemoteProtocolError(
                    "the server closed the connection before the end of the response body")
            buf += data

    async def aclose(self) -> None:
        """Give the connection back (read to the end, keep-alive) or close it."""
        if not self._closed:
            self._closed = True
            self._transport._release(self._key, self._conn,
                                     reusable=self._complete and self._keep_alive)

    def abandon(self) -> None:
        """Close the connection (the exchange failed part way) unless already given back."""
        if not self._closed:
            self._closed = True
            self._transport._release(self._key, self._conn, reusable=False)


class StreamTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with keep-alive on asyncio streams; one pool per (scheme, host, port)."""

    def __init__(self, max_connections: int, keepalive_expiry: float = 5.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self._ssl = ssl_context
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[_Key, list[_Connection]] = {}

    @property
    def idle_connections(self) -> int:
        """How many kept-alive connections wait for a request now (every server)."""
        return sum(len(idle) for idle in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and return its response with the body still to be read."""
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        url = request.url
        scheme = url.scheme
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"the URL scheme {scheme!r} is not supported")
        key = (scheme, url.host, url.port or (443 if scheme == "https" else 80))
        body = await request.aread()
        data = self._request_head(request, len(body)) + body
        return await self.exchange(key, data, timeouts, request, read_body=False)

    async def exchange(self, key: _Key, data: bytes, timeouts: dict[str, Any],
                       request: httpx.Request, read_body: bool = True) -> httpx.Response:
        """Send ``data`` (a whole request) on a pooled connection; return the response.

        With ``read_body`` the body is read to the end here (the lean path); otherwise
        httpx reads it, and closing the response gives the connection back.
        """
        try:
            if self._slots.locked():  # wait for a free connection, up to the pool timeout
                async with asyncio.timeout(_deadline(timeouts, "pool")):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()  # free: returns at once (no timer to arm)
        except TimeoutError as exc:
            raise httpx.PoolTimeout(
                f"waited {_deadline(timeouts, 'pool')} s for a free connection "
                f"(all {self.max_connections} in use)") from exc
        conn: _Connection | None = None
        response: httpx.Response | None = None
        released = False
        try:
            read = _deadline(timeouts, "read")
            conn, (status, reason, headers, version) = await self._start(key, data, timeouts)
            length, chunked, keep_alive = self._framing(request.method, status, version,
                                                          headers)
            extensions = {"http_version": version, "reason_phrase": reason}
            if read_body and length is not None:  # (None when chunked)
                # A body of known length (every Ollama reply): read it here and build the
                # response from it, without httpx's streaming machinery.
                content = await _read_within(conn.reader.readexactly(length), read,
                                             "the response body")
                released = True
                self._release(key, conn, reusable=keep_alive)
                return httpx.Response(status, headers=headers, content=content,
                                      request=request, extensions=extensions)
            stream = _Body(self, key, conn, length, chunked, keep_alive, read)
            response = httpx.Response(status, headers=headers, stream=stream,
                                      request=request, extensions=extensions)
            if read_body:
                await response.aread()  # to the end; closing gives the connection back
        except BaseException:
            stream_ = response.stream if response is not None else None
            if isinstance(stream_, _Body):
                stream_.abandon()
            elif not released:
                if conn is not None:
                    conn.close()
                self._slots.release()
            raise
        return response

    # ------------------------------------------------------------------ the exchange
    async def _start(self, key: _Key, data: bytes, timeouts: dict[str, Any]
                     ) -> tuple[_Connection, tuple[int, bytes, list[tuple[bytes, bytes]], bytes]]:
        """Send ``data`` and read the response head, on a pooled or a new connection.

        A pooled connection the server closed while it sat idle fails before a byte of
        response (EOF, a reset): it is dropped and the request goes once more on a new
        connection (the server never saw it answered, as httpcore and aiohttp do). A new
        connection that fails is closed here.
        """
        write, read = _deadline(timeouts, "write"), _deadline(timeouts, "read")
        conn = self._checkout(key)
        if conn is not None:
            try:
                await self._send(conn, data, write)
                return conn, await self._read_head(conn, read)
            except (_ClosedUnanswered, httpx.WriteError):
                conn.close()  # stale: the server had closed it (nothing was answered)
        conn = await self._connect(key, timeouts)
        try:
            await self._send(conn, data, write)
            return conn, await self._read_head(conn, read)
        except BaseException:
            conn.close()
            raise

    @staticmethod
    def _request_head(request: httpx.Request, size: int) -> bytes:
        lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
        has_length = False
        for name, value in request.headers.raw:
            lower = name.lower()
            if lower == b"content-length":
                has_length = True
            elif lower == b"transfer-encoding":
                continue  # the body was read whole: it goes with a length
            lines.append(name + b": " + value)
        if not has_length and (size or request.method in ("POST", "PUT", "PATCH")):
            lines.append(b"Content-Length: %d" % size)
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _checkout(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self.keepalive_expiry):
                return conn
            conn.close()
        return None

    async def _connect(self, key: _Key, timeouts: dict[str, Any]) -> _Connection:
        scheme, host, port = key
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(_deadline(timeouts, "connect")):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None,
                    limit=MAX_HEAD_BYTES)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return _Connection(reader, writer)

    @staticmethod
    async def _send(conn: _Connection, data: bytes, timeout: float | None) -> None:
        try:
            conn.writer.write(data)
            if conn.writer.transport.get_write_buffer_size():  # not all sent: wait, bounded
                async with asyncio.timeout(timeout):
                    await conn.writer.drain()
            else:
                await conn.writer.drain()  # all sent: returns at once (no timer to arm)
            request_sent()  # the model-call gate may release its steering locks
        except TimeoutError as exc:
            raise httpx.WriteTimeout("timed out sending the request") from exc
        except OSError as exc:
            raise httpx.WriteError(f"sending the request failed: {exc}") from exc

    @staticmethod
    async def _read_head(conn: _Connection, timeout: float | None
                         ) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes]:
        total = 0
        with _reading("the response head"):
            async with asyncio.timeout(timeout):
                while True:
                    raw = await StreamTransport._head(conn.reader, total)
                    total += len(raw)
                    if total > MAX_HEAD_BYTES:  # interim heads count too
                        raise httpx.RemoteProtocolError(
                            f"the response head is larger than {MAX_HEAD_BYTES // 1024} KiB")
                    status_line, _, rest = raw.partition(b"\r\n")
                    parts = status_line.split(b" ", 2)
                    try:
                        status = int(parts[1])
                    except (ValueError, IndexError) as exc:
                        raise httpx.RemoteProtocolError(
                            f"bad status line {status_line[:80]!r}") from exc
                    if status >= 200 or status == 101:
                        break  # 1xx interim responses are skipped
        headers: list[tuple[bytes, bytes]] = []
        for line in rest.split(b"\r\n"):
            if line:
                name, _, value = line.partition(b":")
                headers.append((name.strip(), value.strip()))
        reason = parts[2] if len(parts) > 2 else b""
        return status, reason, headers, parts[0]

    @staticmethod
    async def _head(reader: asyncio.StreamReader, before: int) -> bytes:
        """One head, up to its blank line; ``before`` bytes of heads were read already."""
        try:
            return await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError(
                f"the response head is larger than {MAX_HEAD_BYTES // 1024} KiB") from exc
        except asyncio.IncompleteReadError as exc:
            if before == 0 and not exc.partial:
                raise _ClosedUnanswered(
                    "the server closed the connection without answering") from exc
            raise
        except ConnectionResetError as exc:
            if before == 0:
                raise _ClosedUnanswered(f"the server reset the connection: {exc}") from exc
            raise

    @staticmethod
    def _framing(method: str, status: int, version: bytes,
                 headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool, bool]:
        """How the body is framed: ``(length or None, chunked, keep_alive)``."""
        length: int | None = None
        chunked = False
        connection = b""
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                if not value.isdigit() or (length is not None and length != int(value)):
                    raise httpx.RemoteProtocolError(f"bad Content-Length {value!r}")
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif lower == b"connection":
                connection = value.lower()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length, chunked = 0, False
        keep_alive = (b"close" not in connection and not (chunked and length)
                      and (version == b"HTTP/1.1" or b"keep-alive" in connection))
        return (None if chunked else length), chunked, keep_alive

    def _release(self, key: _Key, conn: _Connection, reusable: bool) -> None:
        if reusable and not conn.writer.is_closing():
            conn.idle_since = time.monotonic()
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()
        self._slots.release()

    async def aclose(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


#: What ``mounts`` maps a URL pattern to: a proxy's transport, or None (go straight).
Mounts = dict[str, httpx.AsyncBaseTransport | None]


def environment_mounts(proxies: Mapping[str, str], limits: httpx.Limits,
                       verify: ssl.SSLContext | bool = True) -> Mounts:
    """``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/``NO_PROXY`` as httpx ``mounts``.

    What httpx does by itself only when no transport is given (``trust_env``): a proxy
    per scheme (``http://``, ``https://``, ``all://``), and each ``NO_PROXY`` entry
    mounted to None (straight to the server): an IP address or ``localhost`` as it is,
    a name as itself and its subdomains, ``*`` as no proxy at all. ``proxies`` is
    :func:`urllib.request.getproxies`' answer (scheme to URL, ``no`` for NO_PROXY).
    """
    mounts: Mounts = {}
    for scheme in ("http", "https", "all"):
        if url := proxies.get(scheme):
            proxy = url if "://" in url else f"http://{url}"
            mounts[f"{scheme}://"] = httpx.AsyncHTTPTransport(proxy=proxy, limits=limits,
                                                              verify=verify)
    for entry in (e.strip() for e in proxies.get("no", "").split(",")):
        if entry == "*":
            return {}
        if not entry:
            continue
        if "://" in entry:
            mounts[entry] = None
        elif entry.lower() == "localhost" or _is_ip(entry):
            mounts[f"all://[{entry}]" if ":" in entry else f"all://{entry}"] = None
        else:
            mounts[f"all://*{entry}"] = None
    return mounts


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def goes_straight(url: httpx.URL, mounts: Mounts) -> bool:
    """Whether ``mounts`` (:func:`environment_mounts`) send ``url`` to no proxy."""
    host = url.host.lower()
    proxied = False
    for pattern, transport in mounts.items():
        scheme, _, where = pattern.partition("://")
        if scheme not in ("all", url.scheme):
            continue
        if transport is not None:  # a scheme's proxy (its pattern names no host)
            proxied = True
            continue
        name = (where[1:where.index("]")] if where.startswith("[")  # an IPv6 address
                else where.split(":")[0]).lower()
        if name.startswith("*"):  # a name and its subdomains
            name = name[1:].lstrip(".")
            if host == name or host.endswith("." + name):
                return True
        elif host == name:
            return True
    return not proxied


class LeanAsyncClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` whose plain JSON requests skip httpx's per-request plumbing.

    ``request(method, path, json=...)`` with nothing else (what ``ollama.AsyncClient``
    sends for a non-streaming call) is written straight to a :class:`StreamTransport`
    connection: the client's headers are encoded once, the URL is the base URL's host
    plus the path, no cookies are read or kept, and the response hooks are called as
    httpx would. A redirect is followed through httpx (when ``follow_redirects``). httpx's
    per-request URL merging, header and cookie handling cost about 0.3 ms of Python a
    call, a third of a thousand-call fan-out's CPU. Any other request (streaming,
    query parameters, other bodies) goes the ordinary httpx way, through the same
    transport. With ``trust_env`` (the default) the proxy variables are read as httpx
    reads them without a custom transport: a URL they proxy goes through httpx's proxy
    transport (with the same connection limit: :func:`environment_mounts`), never the
    lean path.
    """

    def __init__(self, *, max_connections: int, ssl_context: ssl.SSLContext | None = None,
                 **kwargs: Any) -> None:
        self._lean = StreamTransport(max_connections, ssl_context=ssl_context)
        kwargs.setdefault("limits", httpx.Limits(max_connections=max_connections,
                                                 max_keepalive_connections=max_connections))
        if ssl_context is not None:
            kwargs.setdefault("verify", ssl_context)
        # httpx reads the environment's proxies only when no transport is given: read
        # them here, as it would, into mounts of its own public kind.
        self._proxies: Mounts = {}
        if kwargs.get("trust_env", True) and "mounts" not in kwargs:
            self._proxies = environment_mounts(urllib.request.getproxies(), kwargs["limits"],
                                               kwargs.get("verify", True))
            kwargs["mounts"] = self._proxies
        super().__init__(transport=self._lean, **kwargs)
        self._heads: dict[tuple[str, str], tuple[bytes, httpx.Request, _Key, bool]] = {}

    @property
    def pool(self) -> StreamTransport:
        """Its connections: ``max_connections``, ``idle_connections``."""
        return self._lean

    def _lean_head(self, method: str, path: str) -> tuple[bytes, httpx.Request, _Key, bool]:
        cached = self._heads.get((method, path))
        if cached is None:
            request = self.build_request(method, path, content=b"")
            url = request.url
            key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
            lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), url.raw_path)]
            lines += [name + b": " + value for name, value in request.headers.raw
                      if name.lower() not in (b"content-length", b"content-type",
                                              b"transfer-encoding")]
            lines.append(b"Content-Type: application/json")
            head = b"\r\n".join(lines) + b"\r\nContent-Length: "
            direct = goes_straight(url, self._proxies)
            cached = self._heads[(method, path)] = (head, request, key, direct)
        return cached

    async def request(self, method: str, url: httpx.URL | str, **kwargs: Any
                      ) -> httpx.Response:
        """Send one request; a plain JSON request to a path takes the lean path."""
        if set(kwargs) - {"json"} or not isinstance(url, str) or not url.startswith("/"):
            return await super().request(method, url, **kwargs)
        head, request, key, direct = self._lean_head(method, url)
        if not direct:
            return await super().request(method, url, **kwargs)
        body = json.dumps(kwargs.get("json"), ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode("utf-8")
        data = head + str(len(body)).encode("ascii") + b"\r\n\r\n" + body
        response = await self._lean.exchange(key, data, self.timeout.as_dict(), request)
        for hook in self.event_hooks["response"]:
            await hook(response)
        if self.follow_redirects and response.has_redirect_location:
            # Made again the ordinary httpx way, which follows the redirect as httpx
            # does (the method and body per status); the redirecting server sees the
            # request twice, having answered it only with a redirect.
            return await self.send(self._json_request(method, url, body),
                                   follow_redirects=True)
        return response

    def _json_request(self, method: str, url: str, body: bytes) -> httpx.Request:
        return self.build_request(method, url, content=body,
                                  headers={"Content-Type": "application/json"})

    async def open_stream(self, method: str, url: str, json_body: Any) -> httpx.Response:
        """Send a JSON request and return its response with the body still to be read.

        The lean path of :meth:`request` (a streamed reply: Ollama's NDJSON chat), the
        body handed over as its bytes arrive (``aiter_lines``); the caller closes the
        response (``aclose``), which gives the connection back when the body was read to
        the end and closes it otherwise. A proxied URL or a redirect goes the ordinary
        httpx way (``send(..., stream=True)``).
        """
        head, request, key, direct = self._lean_head(method, url)
        body = json.dumps(json_body, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode("utf-8")
        if not direct:
            return await self.send(self._json_request(method, url, body), stream=True)
        data = head + str(len(body)).encode("ascii") + b"\r\n\r\n" + body
        response = await self._lean.exchange(key, data, self.timeout.as_dict(), request,
                                             read_body=False)
        for hook in self.event_hooks["response"]:
            await hook(response)
        if self.follow_redirects and response.has_redirect_location:
            await response.aclose()  # made again the ordinary way, as in request()
            return await self.send(self._json_request(method, url, body),
                                   follow_redirects=True, stream=True)
        return response

    async def aclose(self) -> None:
        """Close the client and its connections."""
        await super().aclose()
        await self._lean.aclose()
