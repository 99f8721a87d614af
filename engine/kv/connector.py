"""Disaggregated serving: a prefill replica leases a prompt's KV blocks, a decode replica pulls them.

Torch-free bookkeeping, shaped like vLLM's KV connector (v1), owned by the ``KVCache``:

- *Scheduler side* (the engine thread): ``start_pull`` (a decode request names where its prompt's blocks
  are), ``get_num_new_matched_tokens`` (how many tokens past the local prefix cache the pulled blocks
  add, and whether the pull is still under way: the request is not admitted until it is done),
  ``update_state_after_alloc`` (the blocks the admission gave the pulled payloads: copied in before the
  step's forward pass), ``request_finished`` (a prefill replica holds the prompt's blocks under a
  lease instead of freeing them; its final record says where they are).
- *Worker side* (``KVWorker``, ``engine.kv.remote``: the device pool): ``save_kv_layer`` reads one
  layer of leased blocks for the wire, ``start_load_kv`` / ``wait_for_layer_load`` write pulled blocks
  into the pool; ``get_finished`` here reports the leases delivered and the pulls that came back.
- *Transport* (``engine.kv.tcp_transport``): TCP on the CPU; the seam for RDMA.

Invariants:
- A leased block is referenced by the lease (``BlockManager.hold``): never evicted, freed or written
  while the lease lives. A lease ends when a pull of it was delivered and acknowledged, or when it
  expires (``kv_lease_s``) without one, so a lost decode replica strands nothing; a lease being sent
  never expires mid-send (the sockets' timeouts bound the send).
- The lease table is the only state the transfer threads share with the engine thread (under its lock);
  blocks are released, and pulls become visible, on the engine thread only (``begin_step``).
- A pull asks only for the chain blocks past the decode replica's own prefix (device, host, disk):
  they are what ``BlockManager._cache_hits`` would reach next. A block is used only if every block
  asked for arrived and verified, its chain hash equals the one the decode replica computed from the
  prompt and its own tenant salt (LoRA adapter folded in), and the model, KV layout and dtype match:
  anything else is refused on the prefill side, never decoded.
- A failed pull (refused, connection lost, prefill replica gone, expired lease) either leaves the
  request to compute its prompt itself (``recompute``, the default: same outputs, more work) or ends it
  with ``finish_reason`` ``error`` (``fail``); either way its ``kv_pull`` report says why.
- Pulled blocks enter the decode replica's prefix cache (registered like host-tier loads) and count as
  cached prompt tokens there (``seq.num_cached_remote_tokens`` of them): the prompt was computed, and
  is metered, by the prefill replica.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.kv.tcp_transport import (
    KVTransport,
    PullRequest,
    TCPServer,
    TCPTransport,
    TransferError,
    TransferRefused,
)
from engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from engine.kv.block_manager import BlockManager

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
FAILURE_MODES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """What a block's bytes mean: the weights (``model``: a digest of the checkpoint), the KV layout
    fingerprint (config, dtype and scales, block shape), the KV dtype and the block shape."""

    model: str
    fingerprint: str
    kv_dtype: str
    block_shape: tuple[int, ...]

    def expect(self, salt: str, lora: str | None) -> dict[str, Any]:
        return {"model": self.model, "fingerprint": self.fingerprint, "kv_dtype": self.kv_dtype,
                "block_shape": list(self.block_shape), "salt": salt, "lora": lora}


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """Where a decode request's prompt blocks are: a prefill replica's transfer address and lease;
    ``on_failure`` overrides the replica's ``kv_transfer_failure``."""

    host: str
    port: int
    lease_id: str
    on_failure: str | None = None


class KVWorker(Protocol):
    """The device side (``engine.kv.remote.RemoteKVWorker``)."""

    identity: KVIdentity
    block_bytes: int

    def read_blocks(self, blocks: list[int]) -> bytes: ...


@dataclass(eq=False)
class Lease:
    lease_id: str
    request_id: str
    blocks: list[int]
    hashes: list[bytes]
    salt: str
    lora: str | None
    expires_at: float
    state: str = "held"  # held -> sending -> done (or back to held: the pull failed)


class Leases:
    """The prefill side's leases (thread-safe): the ``BlockSource`` the transfer server reads."""

    def __init__(self, identity: KVIdentity, read_blocks: Callable[[list[int]], bytes],
                 notify: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = identity
        self._read_blocks = read_blocks
        self._notify = notify
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.delivered = 0
        self.expired = 0
        self.refused = 0

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.lease_id] = lease

    def counts(self) -> tuple[int, int]:
        """(leases, blocks they hold)."""
        with self._lock:
            return len(self._leases), sum(len(lease.blocks) for lease in self._leases.values())

    def sending(self) -> int:
        """How many leases a transfer is reading now (a cut one is back to held once its server thread
        has noticed)."""
        with self._lock:
            return sum(lease.state == "sending" for lease in self._leases.values())

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((lease.expires_at for lease in self._leases.values()), default=None)

    def sweep(self) -> list[Lease]:
        """The leases to end now: delivered, or expired while not being sent."""
        now = self._clock()
        with self._lock:
            ended = [lease for lease in self._leases.values()
                     if lease.state == "done" or (lease.state == "held" and now >= lease.expires_at)]
            for lease in ended:
                del self._leases[lease.lease_id]
                if lease.state == "done":
                    self.delivered += 1
                else:
                    self.expired += 1
        return ended

    def release_all(self) -> list[Lease]:
        with self._lock:
            ended, self._leases = list(self._leases.values()), {}
        return ended

    # ---- BlockSource (transfer threads) ---------------------------------------------------------------
    def open(self, request: PullRequest) -> object:
        with self._lock:
            try:
                lease = self._leases.get(request.lease_id)
                if lease is None or lease.state == "done":
                    raise TransferRefused(f"lease {request.lease_id} is unknown or was released")
                if lease.state == "sending":
                    raise TransferRefused(f"lease {request.lease_id} is being sent to another replica")
                if self._clock() >= lease.expires_at:
                    raise TransferRefused(f"lease {request.lease_id} expired")
                mine = self.identity.expect(lease.salt, lease.lora)
                for key in ("model", "fingerprint", "kv_dtype", "block_shape", "lora", "salt"):
                    if request.expect.get(key) != mine[key]:
                        raise TransferRefused(f"{key} does not match: the lease's is {mine[key]!r}, the "
                                              f"request's {request.expect.get(key)!r}")
                end = request.first + len(request.digests)
                if request.first < 0 or end > len(lease.hashes):
                    raise TransferRefused(f"blocks {request.first}..{end} asked, the lease holds "
                                          f"{len(lease.hashes)}")
                if list(request.digests) != lease.hashes[request.first:end]:
                    raise TransferRefused("the blocks' chain hashes do not match the request's prompt")
            except TransferRefused:
                self.refused += 1
                raise
            lease.state = "sending"
            return lease, lease.blocks[request.first:end]

    def read(self, handle: object, first: int, count: int) -> bytes:
        assert isinstance(handle, tuple)
        blocks: list[int] = handle[1]
        return self._read_blocks(blocks[first:first + count])

    def close(self, handle: object, delivered: bool) -> None:
        assert isinstance(handle, tuple)
        lease: Lease = handle[0]
        with self._lock:
            lease.state = "done" if delivered else "held"
        self._notify()


@dataclass(eq=False)
class Pull:
    """A decode request's pull: blocks ``first ..`` of its prompt chain (``digests``)."""

    request_id: str
    source: RemoteKV
    first: int
    digests: list[bytes]
    on_failure: str
    state: str = "pulling"  # pulling -> received | failed
    received: dict[bytes, bytes] = field(default_factory=dict)
    error: str | None = None


class KVConnector:
    """A prefill or decode replica's side of disaggregated serving (see the module docstring)."""

    def __init__(self, role: str, blocks: BlockManager, worker: KVWorker, *, lease_s: float = 30.0,
                 failure: str = "recompute", timeout_s: float = 10.0, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, chunk_blocks: int = 16,
                 transport: KVTransport | None = None, pull_threads: int = 2) -> None:
        if role not in ROLES[1:]:
            raise ValueError(f"a KV connector serves the prefill or decode role, not {role!r}")
        if failure not in FAILURE_MODES:
            raise ValueError(f"kv_transfer_failure must be one of {FAILURE_MODES}, got {failure!r}")
        self.role = role
        self.blocks = blocks
        self.worker = worker
        self.identity = worker.identity
        self.lease_s = lease_s
        self.failure = failure
        self.timeout_s = timeout_s
        self._changed = threading.Condition()
        self._on_change: list[Callable[[], None]] = []
        # Prefill: the leases and the server that sends them.
        self.leases = Leases(self.identity, worker.read_blocks, self._notify)
        self.server: TCPServer | None = None
        self.address: tuple[str, int] | None = None
        if role == "prefill":
            self.server = TCPServer(self.leases, worker.block_bytes, host, port, chunk_blocks, timeout_s)
            bound_host, bound_port = self.server.address
            self.address = (advertise_host or bound_host, bound_port)
        # Decode: pulls by request id (engine thread), their results from the pull threads.
        self.transport = transport or TCPTransport()
        self._pulls: dict[str, Pull] = {}
        self._results: list[tuple[Pull, list[bytes] | None, str | None]] = []
        self._pool = (ThreadPoolExecutor(pull_threads, thread_name_prefix="kv-pull") if role == "decode"
                      else None)
        self._loads: list[tuple[int, bytes]] = []
        self._failures: list[tuple[str, str]] = []
        self.counters = {"pulls": 0, "pulled_blocks": 0, "failed_pulls": 0, "leases": 0}

    def add_listener(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from any thread) when a pull came back or a lease was delivered."""
        self._on_change.append(wake)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
        for wake in self._on_change:
            wake()

    # ---- scheduler side: decode ---------------------------------------------------------------------
    def start_pull(self, seq: Sequence, source: RemoteKV) -> None:
        """Start pulling the blocks of ``seq``'s prompt chain that this replica does not hold."""
        if self._pool is None:
            raise ValueError("only a decode replica pulls KV blocks")
        chain = self.blocks.chain_hashes(seq)
        first = 0
        while first < len(chain) and self.blocks.holds(chain[first]):
            first += 1
        on_failure = source.on_failure or self.failure
        pull = Pull(seq.request_id, source, first, chain[first:], on_failure)
        if not pull.digests:  # every usable block is here already
            pull.state = "received"
        else:
            salt = self.blocks.salt_key(seq.cache_salt)
            lora = seq.lora.digest if seq.lora is not None else None
            expect = self.identity.expect(salt, lora)
            request = PullRequest(source.lease_id, first, tuple(pull.digests), expect)
            self._pool.submit(self._pull, pull, request)
            self.counters["pulls"] += 1
        self._pulls[seq.request_id] = pull

    def _pull(self, pull: Pull, request: PullRequest) -> None:
        source = pull.source
        try:
            payloads, _ = self.transport.pull(source.host, source.port, request, self.timeout_s)
            result: tuple[Pull, list[bytes] | None, str | None] = (pull, payloads, None)
        except TransferRefused as exc:
            result = (pull, None, f"refused: {exc}")
        except TransferError as exc:
            result = (pull, None, f"transfer failed: {exc}")
        except Exception as exc:  # the thread must report every pull
            logger.exception("KV pull of %s failed", pull.request_id)
            result = (pull, None, f"transfer failed: {exc!r}")
        with self._changed:
            self._results.append(result)
        self._notify()

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past ``num_computed_tokens`` the pulled blocks cover, whether the pull is still under
        way: then the request waits)."""
        pull = self._pulls.get(seq.request_id)
        if pull is None:
            return 0, False
        if pull.state == "pulling" or (pull.state == "failed" and pull.on_failure == "fail"):
            return 0, True  # (a failed one in ``fail`` mode waits for the engine to end it)
        bs = self.blocks.block_size
        end = (pull.first + len(pull.received)) * bs
        return max(0, end - num_computed_tokens), False

    def received(self, seq: Sequence) -> dict[bytes, bytes] | None:
        """The pulled payloads of ``seq``'s request by chain hash (None: none)."""
        pull = self._pulls.get(seq.request_id)
        return pull.received if pull is not None and pull.received else None

    def update_state_after_alloc(self, seq: Sequence, loads: list[tuple[int, bytes]]) -> None:
        """``seq`` was admitted with pulled blocks in device ``blocks``: they are copied in before the
        step's forward pass (``take_loads``), and the pull is done with."""
        self._loads.extend(loads)
        seq.num_cached_remote_tokens = len(loads) * self.blocks.block_size
        pull = self._pulls.get(seq.request_id)
        if pull is not None:
            pull.received = {}

    def take_loads(self) -> list[tuple[int, bytes]]:
        loads, self._loads = self._loads, []
        return loads

    def pulling(self) -> bool:
        return any(p.state == "pulling" for p in self._pulls.values())

    def wait(self, timeout_s: float) -> None:
        """Block until a pull comes back or ``timeout_s`` passes (every waiting request waits for one)."""
        with self._changed:
            if not self._results:
                self._changed.wait(timeout_s)

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the pulls that failed in ``fail`` mode since the last call."""
        failures, self._failures = self._failures, []
        return failures

    # ---- scheduler side: both -----------------------------------------------------------------------
    def request_finished(self, seq: Sequence, reason: FinishReason) -> None:
        """A prefill replica holds the prompt blocks of a finished stream 0 under a lease
        (``seq.kv_lease`` says where); a decode replica forgets the request's pull."""
        if self.role == "decode":
            pull = self._pulls.pop(seq.request_id, None)
            if pull is not None and pull.error is not None:
                seq.kv_pull_error = pull.error
            return
        if seq.index != 0 or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        if seq.pooling is not None:
            return
        chain = self.blocks.chain_hashes(seq, len(seq.prompt_token_ids))
        if not chain or len(seq.block_table) < len(chain):
            return
        held = self.blocks.hold(seq, len(chain))
        salt = self.blocks.salt_key(seq.cache_salt)
        lora = seq.lora.digest if seq.lora is not None else None
        lease = Lease(secrets.token_hex(16), seq.request_id, held, chain, salt, lora,
                      time.monotonic() + self.lease_s)
        self.leases.add(lease)
        self.counters["leases"] += 1
        assert self.address is not None
        seq.kv_lease = {"host": self.address[0], "port": self.address[1], "lease_id": lease.lease_id,
                        "num_tokens": len(chain) * self.blocks.block_size}

    def begin_step(self) -> None:
        """``get_finished`` applied: release the leases that ended, take in the pulls that came back."""
        finished_sending, finished_recving = self.get_finished()
        for lease in finished_sending:
            self.blocks.release(lease.blocks)
        del finished_recving  # their requests become admissible (``get_num_new_matched_tokens``)

    def get_finished(self) -> tuple[list[Lease], list[str]]:
        """The leases delivered or expired, and the requests whose pulls came back, since the last call."""
        with self._changed:
            results, self._results = self._results, []
        recving = []
        for pull, payloads, error in results:
            if self._pulls.get(pull.request_id) is not pull:
                continue  # the request ended meanwhile
            recving.append(pull.request_id)
            if payloads is None:
                pull.state, pull.error = "failed", error
                self.counters["failed_pulls"] += 1
                logger.warning("KV pull for %s failed (%s): %s", pull.request_id, pull.on_failure, error)
                if pull.on_failure == "fail":
                    self._failures.append((pull.request_id, error or "transfer failed"))
            else:
                pull.state = "received"
                pull.received = dict(zip(pull.digests, payloads, strict=True))
                self.counters["pulled_blocks"] += len(payloads)
        return self.leases.sweep(), recving

    def next_expiry_s(self) -> float | None:
        """Seconds until the next lease expires (None: no lease): an idle engine wakes then."""
        at = self.leases.next_expiry()
        return None if at is None else max(0.0, at - time.monotonic())

    # ---- gauges and shutdown -----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        leases, leased_blocks = self.leases.counts()
        return {**self.counters, "active_leases": leases, "leased_blocks": leased_blocks,
                "delivered_leases": self.leases.delivered, "expired_leases": self.leases.expired,
                "refused_pulls": self.leases.refused,
                "pulls_in_flight": sum(1 for p in self._pulls.values() if p.state == "pulling")}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for lease in self.leases.release_all():
            self.blocks.release(lease.blocks)
