"""The NIXL metadata exchange of the KV-path probe, modelled as the startup single point of failure it is in a
fleet: the document a decode-side agent publishes (its NIXL agent metadata plus where its KV buffers live), the
loopback HTTP service that serves it, and the initiator's fetch.

`GET /metadata` returns the document as JSON (404 while nothing is published); `GET /healthz` returns the
agent's own counters. A fetch that cannot reach the service raises `MetadataExchangeError` with
`unreachable=True`; one that reaches it and gets no usable document raises it with `unreachable=False`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["DOC_VERSION", "BufferDesc", "MetadataDoc", "MetadataExchangeError", "MetadataServer", "fetch_metadata"]

DOC_VERSION = 1
MAX_DOC_BYTES = 4 * 1024 * 1024


class MetadataExchangeError(Exception):
    """No usable metadata: the service was unreachable (`unreachable`), or answered with something unusable."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True, slots=True)
class BufferDesc:
    """A registered region of `slots` consecutive blocks of `block_bytes` at `addr` in the peer's DRAM."""

    block_bytes: int
    addr: int
    slots: int
    dev: int = 0

    def slot_addr(self, slot: int) -> int:
        """Address of block `slot` (taken modulo the slot count)."""
        return self.addr + (slot % self.slots) * self.block_bytes


@dataclass(frozen=True, slots=True)
class MetadataDoc:
    """What a decode-side agent publishes: its NIXL metadata blob and its KV buffers, per block size."""

    agent: str
    instance: str
    pid: int
    published_at: float
    nixl_metadata: bytes
    buffers: tuple[BufferDesc, ...]

    def buffer(self, block_bytes: int) -> BufferDesc | None:
        """The region holding blocks of `block_bytes`, if the peer registered one."""
        return next((b for b in self.buffers if b.block_bytes == block_bytes), None)

    def to_json(self) -> bytes:
        """The wire form; the blob travels base64-encoded with its SHA-256."""
        body = {
            "version": DOC_VERSION,
            "agent": self.agent,
            "instance": self.instance,
            "pid": self.pid,
            "published_at": self.published_at,
            "nixl_metadata": base64.b64encode(self.nixl_metadata).decode("ascii"),
            "sha256": hashlib.sha256(self.nixl_metadata).hexdigest(),
            "buffers": [{"block_bytes": b.block_bytes, "addr": b.addr, "slots": b.slots, "dev": b.dev}
                        for b in self.buffers],
        }
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> MetadataDoc:
        """Parse and check a document; MetadataExchangeError on anything malformed or corrupted."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MetadataExchangeError(f"metadata is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise MetadataExchangeError("metadata is not a JSON object")
        if body.get("version") != DOC_VERSION:
            raise MetadataExchangeError(f"metadata version {body.get('version')!r}, expected {DOC_VERSION}")
        try:
            blob = base64.b64decode(body["nixl_metadata"], validate=True)
            buffers = tuple(
                BufferDesc(int(b["block_bytes"]), int(b["addr"]), int(b["slots"]), int(b.get("dev", 0)))
                for b in body["buffers"]
            )
            doc = cls(str(body["agent"]), str(body["instance"]), int(body["pid"]), float(body["published_at"]),
                      blob, buffers)
            digest = str(body["sha256"])
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise MetadataExchangeError(f"metadata document malformed: {type(exc).__name__}: {exc}") from None
        if hashlib.sha256(blob).hexdigest() != digest:
            raise MetadataExchangeError("metadata blob does not match its checksum (truncated or corrupted)")
        if not blob:
            raise MetadataExchangeError("metadata blob is empty")
        if any(b.block_bytes <= 0 or b.slots <= 0 for b in buffers):
            raise MetadataExchangeError("metadata lists a buffer with no blocks")
        # NIXL takes unsigned 64-bit addresses and device ids: a pointer written as a signed integer is no address.
        for b in buffers:
            if b.addr < 0 or b.addr + b.slots * b.block_bytes > 2**64 or b.dev < 0:
                raise MetadataExchangeError(f"metadata lists a buffer NIXL cannot address: {b.slots} blocks of "
                                            f"{b.block_bytes} bytes at {b.addr:#x} on device {b.dev}")
        return doc


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metadata":
            body = self.server.document()
            if body is None:
                self._send(404, b'{"error": "no metadata published"}')
            else:
                self._send(200, body)
        elif path == "/healthz":
            self._send(200, json.dumps(self.server.health()).encode())
        else:
            self._send(404, b'{"error": "not found"}')

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A restarted agent rebinds the port its peers know while the old socket sits in TIME_WAIT.
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], document: Callable[[], bytes | None],
                 health: Callable[[], dict[str, Any]]) -> None:
        super().__init__(addr, _Handler)
        self.document = document
        self.health = health


class MetadataServer:
    """Serves a decode-side agent's metadata document and health on a loopback HTTP port."""

    def __init__(self, document: Callable[[], bytes | None], health: Callable[[], dict[str, Any]],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server((host, port), document, health)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvprobe-metadata", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The metadata document's URL."""
        host = self._server.server_address[0]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{self.port}/metadata"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def fetch_metadata(url: str, timeout_s: float = 1.0) -> MetadataDoc:
    """Fetch and check a peer's metadata document; MetadataExchangeError on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            raw = resp.read(MAX_DOC_BYTES + 1)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise MetadataExchangeError(f"metadata service answered HTTP {exc.code} for {url}") from None
    except urllib.error.URLError as exc:
        raise MetadataExchangeError(f"metadata service unreachable at {url}: {exc.reason}", unreachable=True) from None
    except (TimeoutError, ConnectionError) as exc:
        raise MetadataExchangeError(f"metadata service unreachable at {url}: {type(exc).__name__}: {exc}",
                                    unreachable=True) from None
    except http.client.HTTPException as exc:
        raise MetadataExchangeError(f"metadata service at {url} sent no valid HTTP response: {exc!r}") from None
    except OSError as exc:
        raise MetadataExchangeError(f"metadata fetch from {url} failed: {exc}", unreachable=True) from None
    except ValueError as exc:  # a URL that cannot be parsed (a peer listed with a typo)
        raise MetadataExchangeError(f"metadata URL {url!r} is not valid: {exc}") from None
    if len(raw) > MAX_DOC_BYTES:
        raise MetadataExchangeError(f"metadata document from {url} exceeds {MAX_DOC_BYTES} bytes")
    return MetadataDoc.from_json(raw)
