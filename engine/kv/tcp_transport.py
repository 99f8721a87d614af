"""Moving KV blocks between replicas over TCP: framing, chunking, checksums. Torch-free (bytes only).

``engine.kv.connector`` decides what moves; this module moves bytes and nothing else. One pull is one
connection, in four steps:

1. the decode replica sends a *request* frame: the lease, the chain hashes of the blocks it wants (by
   index in the prompt's chain), and what the blocks must be (model, layout, KV dtype, tenant salt,
   LoRA adapter), as JSON;
2. the prefill replica answers a *header* frame: ``{"ok": true, "num_blocks", "block_bytes"}``, or
   ``{"ok": false, "error"}`` (a refusal: nothing follows);
3. the blocks in *chunks*: ``first index, count, payload length, CRC-32`` then the payload (``count``
   blocks of ``block_bytes`` each, in order), and an end frame (count 0) carrying the SHA-256 of every
   payload byte sent;
4. the decode replica checks each chunk's CRC, the total digest and the block count, and answers an
   *ack* frame ``{"ok": bool}``: only an ``ok`` ack lets the prefill replica release the lease.

Invariants:
- A pull either returns every block it asked for, verified, or raises ``TransferError`` (refused,
  refused connection, dropped connection, timeout, checksum or size mismatch): a partial pull is never
  used. ``TransferRefused`` is the subclass for the prefill side's "no" (unknown or expired lease,
  anything that does not match).
- Every socket operation has a timeout, so neither side waits forever on a peer that died.
- The server runs one thread per connection and never touches engine state: ``BlockSource`` (the
  connector's lease table) validates a request, pins the lease while it reads the blocks, and hears
  how the pull ended.

The seam for other transports (RDMA): ``KVTransport`` (``pull``) and ``BlockSource`` (``open`` / ``read`` /
``close``). An RDMA transport would exchange the same request and header over a side channel and read
the leased blocks straight out of the registered KV pool instead of the chunk loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_MAGIC = b"TGKVX1"
_FRAME = struct.Struct(">I")  # a JSON frame's length
_CHUNK = struct.Struct(">IIQI")  # first block index, block count, payload bytes, CRC-32 of the payload
_MAX_JSON = 16 << 20


class TransferError(RuntimeError):
    """A pull that did not bring back every block it asked for, verified."""


class TransferRefused(TransferError):
    """The prefill replica said no: unknown or expired lease, or blocks that do not match the request."""


@dataclass(frozen=True, slots=True)
class PullRequest:
    """What a decode replica asks for: ``digests[i]`` is the chain hash of block ``first + i`` of the
    leased prompt; ``expect`` is what the blocks must be (``engine.kv.connector.KVIdentity`` fields,
    the tenant's salt key and the LoRA adapter's digest)."""

    lease_id: str
    first: int
    digests: tuple[bytes, ...]
    expect: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "first": self.first, "digests": [d.hex() for d in self.digests],
                "expect": self.expect}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PullRequest:
        try:
            return cls(str(data["lease_id"]), int(data["first"]),
                       tuple(bytes.fromhex(d) for d in data["digests"]), dict(data["expect"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferRefused(f"malformed pull request: {exc!r}") from exc


class BlockSource(Protocol):
    """The prefill side of a pull (the connector's lease table and the device pool)."""

    def open(self, request: PullRequest) -> object:
        """Validate ``request`` and pin its lease (``TransferRefused`` if it cannot be served); returns a
        handle for ``read`` and ``close``."""
        ...

    def read(self, handle: object, first: int, count: int) -> bytes:
        """The payload of blocks ``first .. first + count`` of the request (in request order)."""
        ...

    def close(self, handle: object, delivered: bool) -> None:
        """The pull ended: every block was delivered and acknowledged, or not (the lease stays)."""
        ...


class KVTransport(Protocol):
    """How a decode replica pulls blocks (TCP here; the seam for RDMA)."""

    def pull(self, host: str, port: int, request: PullRequest, timeout_s: float) -> tuple[list[bytes], int]:
        """Every block asked for, in order, and their byte size; raises ``TransferError``."""
        ...


# ---- frames ----------------------------------------------------------------------------------------
def _send_json(sock: socket.socket, data: dict[str, Any]) -> None:
    body = json.dumps(data).encode()
    sock.sendall(_FRAME.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_json(sock: socket.socket) -> dict[str, Any]:
    (length,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if length > _MAX_JSON:
        raise TransferError(f"a frame of {length} bytes is not a KV transfer frame")
    data = json.loads(_recv_exact(sock, length))
    if not isinstance(data, dict):
        raise TransferError("a KV transfer frame must be a JSON object")
    return data


# ---- the client (decode replica) -------------------------------------------------------------------
class TCPTransport:
    """Pulls over one TCP connection per request (``KVTransport``)."""

    def pull(self, host: str, port: int, request: PullRequest, timeout_s: float) -> tuple[list[bytes], int]:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.settimeout(timeout_s)
                sock.sendall(_MAGIC)
                _send_json(sock, request.to_json())
                header = _recv_json(sock)
                if not header.get("ok"):
                    raise TransferRefused(str(header.get("error", "refused")))
                blocks, block_bytes = self._receive(sock, header, len(request.digests))
                _send_json(sock, {"ok": True})
                return blocks, block_bytes
        except TransferError:
            raise
        except (OSError, ValueError) as exc:  # refused, reset, timed out, garbage
            raise TransferError(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _receive(sock: socket.socket, header: dict[str, Any], wanted: int) -> tuple[list[bytes], int]:
        block_bytes = int(header["block_bytes"])
        if int(header["num_blocks"]) != wanted or block_bytes <= 0:
            raise TransferError(f"the prefill replica offers {header['num_blocks']} blocks, {wanted} asked")
        digest = hashlib.sha256()
        blocks: list[bytes] = []
        while True:
            first, count, nbytes, crc = _CHUNK.unpack(_recv_exact(sock, _CHUNK.size))
            if count == 0:
                end = _recv_exact(sock, nbytes)
                if end != digest.digest():
                    raise TransferError("the transfer's SHA-256 does not match its payload")
                break
            if first != len(blocks) or nbytes != count * block_bytes or first + count > wanted:
                raise TransferError(f"unexpected chunk: blocks {first}+{count}, {nbytes} bytes")
            payload = _recv_exact(sock, nbytes)
            if zlib.crc32(payload) != crc:
                raise TransferError(f"CRC-32 mismatch in the chunk of blocks {first}..{first + count}")
            digest.update(payload)
            blocks.extend(payload[i * block_bytes:(i + 1) * block_bytes] for i in range(count))
        if len(blocks) != wanted:
            raise TransferError(f"{len(blocks)} blocks received, {wanted} asked")
        return blocks, block_bytes


# ---- the server (prefill replica) ------------------------------------------------------------------
class TCPServer:
    """Serves pulls of leased blocks on ``host:port`` (0: a free port; ``address`` says which), one
    thread per connection, ``chunk_blocks`` blocks per chunk."""

    def __init__(self, source: BlockSource, block_bytes: int, host: str = "127.0.0.1", port: int = 0,
                 chunk_blocks: int = 16, timeout_s: float = 10.0) -> None:
        self.source = source
        self.block_bytes = block_bytes
        self.chunk_blocks = max(1, chunk_blocks)
        self.timeout_s = timeout_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.5)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-transfer-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-transfer-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        handle = None
        delivered = False
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                if _recv_exact(conn, len(_MAGIC)) != _MAGIC:
                    return
                request = PullRequest.from_json(_recv_json(conn))
                try:
                    handle = self.source.open(request)
                except TransferRefused as exc:
                    _send_json(conn, {"ok": False, "error": str(exc)})
                    return
                total = len(request.digests)
                _send_json(conn, {"ok": True, "num_blocks": total, "block_bytes": self.block_bytes})
                digest = hashlib.sha256()
                for first in range(0, total, self.chunk_blocks):
                    count = min(self.chunk_blocks, total - first)
                    payload = self.source.read(handle, first, count)
                    digest.update(payload)
                    conn.sendall(_CHUNK.pack(first, count, len(payload), zlib.crc32(payload)) + payload)
                end = digest.digest()
                conn.sendall(_CHUNK.pack(total, 0, len(end), 0) + end)
                delivered = bool(_recv_json(conn).get("ok"))
            except (OSError, TransferError, ValueError) as exc:
                logger.info("KV transfer to %s ended early: %r", _peer(conn), exc)
            except Exception:  # the blocks could not be read (a tensor-parallel rank did not answer)
                logger.exception("KV transfer to %s failed", _peer(conn))
            finally:
                if handle is not None:
                    self.source.close(handle, delivered)


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed peer"

