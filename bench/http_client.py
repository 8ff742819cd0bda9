"""A small asyncio HTTP/1.1 client for OpenAI-style JSON and SSE streams (bench use).

Keep-alive connections, chunked transfer decoding and `data:` event parsing,
with the standard library only, so the gateway bench adds no dependency.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["HttpConnection", "http_json", "read_all", "sse_events"]


class HttpConnection:
    """One keep-alive connection to smg."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None

    async def request(self, method: str, path: str, body: Any = None
                      ) -> tuple[int, AsyncIterator[bytes]]:
        """Send a request; (status, an iterator over the body's bytes)."""
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.streams
        data = b"" if body is None else json.dumps(body).encode()
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Accept: text/event-stream, application/json\r\n\r\n".encode() + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        return status, self._body(reader, headers)

    async def _body(self, reader: asyncio.StreamReader,
                    headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding") == "chunked":
            while size := int((await reader.readline()).split(b";")[0], 16):
                yield (await reader.readexactly(size + 2))[:-2]
            while await reader.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:  # delimited by the connection's end
            yield await reader.read()
            await self.close()
        if headers.get("connection") == "close":
            await self.close()


async def read_all(body: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in body])


async def http_json(port: int, method: str, path: str, body: Any = None,
                    timeout: float = 120.0) -> tuple[int, Any]:
    """One request on its own connection; (status, decoded JSON reply)."""
    conn = HttpConnection(port)
    try:
        status, reply = await asyncio.wait_for(conn.request(method, path, body), 30)
        data = await asyncio.wait_for(read_all(reply), timeout)
        return status, json.loads(data) if data else None
    finally:
        await conn.close()


async def sse_events(body: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON data events of an SSE body (without `[DONE]`), as they arrive."""
    pending = b""
    async for chunk in body:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                yield json.loads(line[5:])


# --- the two paths ---------------------------------------------------------------------
