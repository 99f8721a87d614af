"""Paged KV-cache block accounting with a hash-chain prefix cache. Pure Python, no torch.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence's ``block_table`` maps
its token positions to blocks (position ``p`` lives in ``block_table[p // block_size]``).

Invariants:

- Every block is in exactly one of three states: *in use* (``ref_count > 0``, listed in the block
  tables of ``ref_count`` sequences), *free* (``ref_count == 0``, no hash) or *evictable*
  (``ref_count == 0``, still registered in the prefix cache under its chain hash).
- A hash maps to at most one block and a block carries at most one hash. Only *full* blocks whose K/V
  have been computed are registered (``commit_computed``), so a cache hit always serves valid K/V.
- Allocation takes free blocks first and evicts evictable blocks in LRU order (least recently
  released first) only when no free block is left; eviction drops the hash.
- Blocks are released in reverse table order, so a sequence's tail is evicted before its prefix,
  which is the part other requests are likely to share.
- A prefix hit never covers the block that holds a sequence's last token: at least one token is always
  computed to produce logits, so a prompt of exactly N full blocks reuses N - 1.
- ``allocate_for_prefill`` reserves blocks for all of the sequence's known tokens at once: a sequence is
  admitted only when its whole prompt fits, so partially prefilled prompts never thrash each other.
  Decode growth goes through ``ensure_slots``.

n > 1 requests share the prompt's full blocks: with prefix caching, through the cache (the scheduler
admits siblings once the first stream has computed its prompt); without it, through :meth:`fork`,
which shares the parent's full prompt blocks by reference count. Only full blocks are ever shared and
the partial last block is recomputed by each sibling, so no copy-on-write is needed: a shared block is
never written again.

Lower tiers (``engine.kv.tiers``, optional): an evicted cached block is offloaded to the host tier
instead of dropped, and a prompt's chain of hashes continues past its device hits into the host tier,
whose blocks are copied into fresh device blocks before the step runs (``tiers.take_plan()``; the
engine executes it). Those are prefix hits like device hits: ``num_cached_tokens`` counts them, and
``hit_tokens_by_tier`` says where each came from (a host block read from disk counts as ``disk``), and
``seq.num_cached_host_tokens`` / ``num_cached_disk_tokens`` say it of the request's own cached tokens.
``disk_reads`` names the files a queued prompt needs read first; ``waiting_for_disk`` holds it back
until they are on the host.

Pulled blocks (``engine.kv.connector``, disaggregated serving): with ``remote`` set, a prompt's chain
continues past its device and host hits into the blocks its request pulled from a prefill replica;
they get fresh device blocks, are registered in the prefix cache like host loads, count as cached
tokens (``remote_hit_tokens``), and their payloads go to ``remote.update_state_after_alloc`` to be
copied in before the step runs. ``hold`` / ``release`` let a prefill replica's lease keep blocks
referenced after their sequence is freed.

With an event log (``engine.kv.events``), every hash registered in or dropped from any tier is published
in order, for the gateways' routing index.

``commit_computed`` counts the prompt blocks a sequence registers (``seq.num_cache_write_tokens``: what
the request wrote to the cache, first admission only).

Cache lifetimes (``engine.kv.pins``): a sequence's ``cache_policy`` limits what it looks up and registers
to its cacheable prefix (explicit mode), marks the blocks it registers ``in_memory`` ones (never on disk),
and once its cacheable prompt blocks are committed pins them in the host tier (``ttl``) and retains them
on disk (``retention``); ``seq.num_cache_pinned_tokens`` / ``num_cache_retained_tokens`` say how much
was applied (within the tenant's quotas; 0 without the tier).

``num_cached_tokens`` is set on the first allocation only: recompute after a preemption is the
platform's cost and is never reported as cached. The query/hit counters count every allocation
(including re-admissions after preemption): they describe the cache, not billing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from engine.kv.block_hash import hash_block, salt_digest
from engine.kv.events import KVEventLog
from engine.kv.tiers import NO_SALT, HostTier, salt_key
from engine.sequence import Sequence
from engine.usage import CACHE_TIERS

TIERS = CACHE_TIERS  # the prompt-cache tiers, named once (engine.usage)


class RemoteBlocks(Protocol):
    """Blocks pulled from a prefill replica (``engine.kv.connector.KVConnector``, decode role)."""

    def received(self, seq: Sequence) -> dict[bytes, bytes] | None: ...

    def update_state_after_alloc(self, seq: Sequence, loads: list[tuple[int, bytes]]) -> None: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 tiers: HostTier | None = None, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_salt: list[str] = [NO_SALT] * num_blocks
        self._block_persist: list[bool] = [True] * num_blocks
        self.tiers = tiers if enable_prefix_caching else None
        self.events = events
        self._salt_keys: dict[str | None, tuple[bytes, str]] = {}
        self._hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        # Evictable blocks in LRU order: the first key is the least recently released.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Per sequence (by seq_id): chain hashes of its full blocks computed so far, and how many of its
        # blocks have been offered to the cache by commit_computed.
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._seq_committed: dict[int, int] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        self.hit_tokens_by_tier = dict.fromkeys(TIERS, 0)
        # Disaggregated serving (decode role): the connector whose pulled blocks continue prompt chains.
        self.remote: RemoteBlocks | None = None
        self.remote_hit_tokens = 0

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused_blocks(self) -> int:
        """Blocks nobody holds and no cache entry needs (taking them evicts nothing)."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (evictable cache blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_for_prefill(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached full blocks.

        Sets ``seq.num_computed_tokens`` to the reused tokens and ``seq.num_cached_tokens`` if it is
        still None. Returns False, changing nothing, when blocks are short.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks; free it before re-allocating")
        num_tokens = len(seq.token_ids)
        if num_tokens == 0:
            raise ValueError(f"sequence {seq.seq_id} has no tokens")
        # A request scoring its prompt needs every prompt position's logits: it reads nothing cached.
        scoring = seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done
        reuse = self.enable_prefix_caching and not scoring
        hits, host_hits, remote_hits = self._cache_hits(seq) if reuse else ([], [], [])
        num_new = self.blocks_needed(num_tokens) - len(hits)
        hits_evictable = sum(1 for b in hits if self._ref_counts[b] == 0)
        if num_new > self.num_free_blocks - hits_evictable:
            return False
        for block in hits:
            self._take(block)
        tiers = self.tiers
        if host_hits:
            assert tiers is not None
            tiers.lock(host_hits)  # no eviction below may reuse the slots this step reads
        table = hits + [self._pop_free_block() for _ in range(num_new)]
        seq.block_table = table
        salt = self._salt(seq.cache_salt)[1]
        by_tier = {"host": 0, "disk": 0}
        for digest, block in zip(host_hits, table[len(hits):], strict=False):
            persist = tiers.persists(digest)  # type: ignore[union-attr]
            origin = tiers.load(digest, block)  # type: ignore[union-attr]
            self._register(block, digest, salt, persist)
            self.hit_tokens_by_tier[origin] += self.block_size
            by_tier[origin] += self.block_size
        if remote_hits:
            assert self.remote is not None
            received = self.remote.received(seq) or {}
            first = len(hits) + len(host_hits)
            loads = list(zip(table[first:first + len(remote_hits)], [received[d] for d in remote_hits],
                             strict=True))
            for (block, _), digest in zip(loads, remote_hits, strict=True):
                self._register(block, digest, salt)
            self.remote.update_state_after_alloc(seq, loads)
            self.remote_hit_tokens += len(remote_hits) * self.block_size
        num_hit_tokens = (len(hits) + len(host_hits) + len(remote_hits)) * self.block_size
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
            seq.num_cached_host_tokens, seq.num_cached_disk_tokens = by_tier["host"], by_tier["disk"]
        self._seq_committed[seq.seq_id] = len(hits) + len(host_hits) + len(remote_hits)
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += num_tokens
            self.prefix_hit_tokens += num_hit_tokens
            self.hit_tokens_by_tier["device"] += len(hits) * self.block_size
        return True

    def disk_reads(self, seq: Sequence) -> list[tuple[bytes, str]]:
        """The block files to read for ``seq``'s prompt (its chain continues on disk past what the device
        and host hold); they are marked being read."""
        if self.tiers is None or self.tiers.disk is None:
            return []
        digests = self._hit_candidates(seq)
        start = 0
        while start < len(digests) and digests[start] in self._hash_to_block:
            start += 1
        return self.tiers.disk_run(digests[start:])

    def waiting_for_disk(self, seq: Sequence) -> bool:
        """Whether a block of ``seq``'s prompt chain (past its device and host hits) is still being read."""
        if self.tiers is None or self.tiers.disk is None or seq.block_table:
            return False
        for digest in self._hit_candidates(seq):
            if digest in self._hash_to_block or self.tiers.on_host(digest):
                continue
            return self.tiers.reading(digest)
        return False

    def reclaimable(self, victims: list[Sequence]) -> int:
        """Blocks available once every sequence of ``victims`` is freed: the free ones plus those only
        victims hold (a block shared with a sequence that stays is not counted)."""
        refs: dict[int, int] = {}
        for victim in victims:
            for block in victim.block_table:
                refs[block] = refs.get(block, 0) + 1
        only_victims = sum(1 for block, count in refs.items() if self._ref_counts[block] == count)
        return self.num_free_blocks + only_victims

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Admit ``child`` (a waiting sibling of ``parent``) sharing the parent's computed full prompt blocks.

        Shares only blocks lying wholly inside the common prompt and already computed by the parent,
        never the block holding the child's last token; the rest of the child's tokens get fresh blocks.
        Sets the child's ``num_computed_tokens`` (and ``num_cached_tokens`` if None) to the shared
        tokens. Returns False, changing nothing, when blocks are short.
        """
        if child.block_table:
            raise ValueError(f"sequence {child.seq_id} already holds blocks; free it before forking")
        if parent.prompt_token_ids != child.prompt_token_ids:
            raise ValueError("fork needs sequences with the same prompt")
        shareable = (
            min(parent.num_computed_tokens, parent.num_prompt_tokens, len(child.token_ids) - 1)
            // self.block_size
        )
        shareable = min(shareable, len(parent.block_table))
        shared = parent.block_table[:shareable]
        num_new = self.blocks_needed(len(child.token_ids)) - len(shared)
        if num_new > self.num_free_blocks:
            return False
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = shared + [self._pop_free_block() for _ in range(num_new)]
        child.num_computed_tokens = shareable * self.block_size
        if child.num_cached_tokens is None:
            child.num_cached_tokens = child.num_computed_tokens
        parent_hashes = self._seq_hashes.get(parent.seq_id, [])
        self._seq_hashes[child.seq_id] = parent_hashes[:shareable]
        self._seq_committed[child.seq_id] = shareable
        return True

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to cover positions below ``num_computed_tokens + num_new_tokens``.

        Returns False, changing nothing, when not enough blocks are free (the caller preempts).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        missing = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        seq.block_table.extend(self._pop_free_block() for _ in range(missing))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first ``blocks_needed(num_tokens)`` of ``seq`` (taken for draft
        tokens that were rejected: they hold no cached block)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def commit_computed(self, seq: Sequence) -> None:
        """Register the chain hashes of the sequence's blocks that became full and computed (within its
        cacheable prefix), then apply its cache lifetimes once its cacheable prompt blocks are in."""
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        num_full = min(num_full, len(seq.block_table))
        committed = self._seq_committed.get(seq.seq_id, 0)
        if num_full <= committed and (seq.cache_lifetimes_applied or not self.enable_prefix_caching):
            return  # nothing new (every decode step but one in block_size)
        if not self.enable_prefix_caching:
            self._seq_committed[seq.seq_id] = max(num_full, committed)
            return
        policy = seq.cache_policy
        salt = self._salt(seq.cache_salt)[1]
        if num_full > committed:
            self._seq_committed[seq.seq_id] = num_full
            cacheable = min(num_full, policy.cacheable_tokens(len(seq.token_ids)) // self.block_size)
            hashes = self._hashes_upto(seq, cacheable)
            prompt_blocks = seq.num_prompt_tokens // self.block_size if not seq.num_preemptions else 0
            for i in range(committed, cacheable):
                block = seq.block_table[i]
                digest = hashes[i]
                if self._block_hash[block] is None and digest not in self._hash_to_block:
                    self._register(block, digest, salt, policy.persist)
                    if i < prompt_blocks:
                        seq.num_cache_write_tokens += self.block_size
        # Once the prompt's cacheable blocks are all in (newly committed, or prefix hits already: a
        # returning turn refreshes its pins), its lifetimes apply.
        pinned_blocks = policy.cacheable_tokens(seq.num_prompt_tokens) // self.block_size
        if not seq.cache_lifetimes_applied and max(num_full, committed) >= pinned_blocks:
            seq.cache_lifetimes_applied = True
            self._apply_lifetimes(seq, self._hashes_upto(seq, pinned_blocks)[:pinned_blocks], salt)

    def _apply_lifetimes(self, seq: Sequence, digests: list[bytes], salt: str) -> None:
        policy, tiers = seq.cache_policy, self.tiers
        if tiers is None or not digests:
            return
        if policy.ttl_s:
            seq.num_cache_pinned_tokens = tiers.pin_host(digests, salt, policy.ttl_s) * self.block_size
        if policy.retention_s:
            blocks = [(d, self._hash_to_block.get(d)) for d in digests]
            seq.num_cache_retained_tokens = tiers.retain(blocks, salt, policy.retention_s) * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks become evictable, others free."""
        self.release(seq.block_table)
        seq.block_table = []
        self._seq_committed.pop(seq.seq_id, None)
        self._seq_hashes.pop(seq.seq_id, None)

    def purge(self, cache_salt: str | None) -> int:
        """Forget every cached block of one tenant's salt, in every tier (a deleted tenant); blocks in
        use keep their contents but are no longer shared. Returns the blocks dropped."""
        key = self._salt(cache_salt)[1]
        gone = [(d, block) for d, block in self._hash_to_block.items() if self._block_salt[block] == key]
        for digest, block in gone:
            del self._hash_to_block[digest]
            self._block_hash[block] = None
            if self.events is not None:
                self.events.removed(digest, "device")
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)
        return len(gone) + (self.tiers.purge(key) if self.tiers is not None else 0)

    # ---- internals ------------------------------------------------------------------------------
    def _hashes_upto(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        if len(hashes) < num_blocks:
            salt = self._salt(seq.cache_salt)[0]
            bs = self.block_size
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], salt)
                hashes.append(parent)
        return hashes

    def _hit_candidates(self, seq: Sequence) -> list[bytes]:
        """The chain hashes of the prompt's blocks that may be prefix hits: every full block of its
        cacheable prefix but the one holding the last token (at least one token is always computed)."""
        num_tokens = len(seq.token_ids)
        max_blocks = min(num_tokens - 1, seq.cache_policy.cacheable_tokens(num_tokens)) // self.block_size
        return self._hashes_upto(seq, max_blocks)[:max_blocks] if max_blocks else []

    def _cache_hits(self, seq: Sequence) -> tuple[list[int], list[bytes], list[bytes]]:
        """The device blocks of the prompt's longest cached prefix, then the hashes continuing it on the
        host tier, then those continuing it in the blocks its request pulled (never the block of the
        last token)."""
        hits: list[int] = []
        host: list[bytes] = []
        remote: list[bytes] = []
        received = self.remote.received(seq) if self.remote is not None else None
        for digest in self._hit_candidates(seq):
            block = self._hash_to_block.get(digest)
            if block is not None and not host and not remote:
                hits.append(block)
            elif self.tiers is not None and block is None and not remote and self.tiers.on_host(digest):
                host.append(digest)
            elif received is not None and block is None and digest in received:
                remote.append(digest)
            else:
                break
        return hits, host, remote

    # ---- disaggregated serving ------------------------------------------------------------------
    def chain_hashes(self, seq: Sequence, num_tokens: int | None = None) -> list[bytes]:
        """The chain hashes of the full blocks a prompt hit may cover: of ``seq``'s cacheable prefix
        (``_hit_candidates``), or with ``num_tokens``, of its first ``num_tokens`` tokens (a finished
        prefill's prompt: every full block but the one holding the last prompt token)."""
        if num_tokens is None:
            return self._hit_candidates(seq)
        max_blocks = (num_tokens - 1) // self.block_size
        return self._hashes_upto(seq, max_blocks)[:max_blocks] if max_blocks > 0 else []

    def holds(self, digest: bytes) -> bool:
        """Whether this replica has the block of ``digest`` in any tier (device, host, disk)."""
        if digest in self._hash_to_block:
            return True
        tiers = self.tiers
        if tiers is None:
            return False
        return tiers.on_host(digest) or (tiers.disk is not None and digest in tiers.disk)

    def hold(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Take one more reference on ``seq``'s first ``num_blocks`` blocks (a lease): they outlive the
        sequence until ``release``."""
        blocks = seq.block_table[:num_blocks]
        for block in blocks:
            self._ref_counts[block] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each of ``blocks``, tail first (a lease's ``hold``, or a sequence's table:
        ``free``); cached blocks left unreferenced become evictable, others free."""
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} released more often than it was taken")
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def salt_key(self, salt: str | None) -> str:
        return self._salt(salt)[1]

    def _salt(self, salt: str | None) -> tuple[bytes, str]:
        """(salt digest, salt key) of a tenant's ``cache_salt``, computed once per salt."""
        known = self._salt_keys.get(salt)
        if known is None:
            digest = salt_digest(salt)
            known = self._salt_keys[salt] = (digest, salt_key(digest))
        return known

    def _register(self, block: int, digest: bytes, salt: str, persist: bool = True) -> None:
        self._block_hash[block] = digest
        self._block_salt[block] = salt
        self._block_persist[block] = persist
        self._hash_to_block[digest] = block
        if self.events is not None:
            self.events.stored(digest, "device")

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            self._evictable.pop(block, None)
        self._ref_counts[block] += 1

    def _pop_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            digest = self._block_hash[block]
            if digest is not None:
                del self._hash_to_block[digest]
                self._block_hash[block] = None
                if self.events is not None:
                    self.events.removed(digest, "device")
                if self.tiers is not None:
                    self.tiers.offload(digest, block, self._block_salt[block], self._block_persist[block])
        self._ref_counts[block] = 1
        return block
