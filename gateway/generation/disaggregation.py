"""Prefill on one replica, decode on another: the gateway's half of disaggregated serving (#40).

A model is served disaggregated when its config lists a ``prefill`` pool (``--role prefill`` replicas)
beside its interactive pool of ``--role decode`` replicas. For each prompt:

1. The decode replica is chosen as for any request (prefix, load; ``Router.pick``).
2. ``remote_prefill_wanted``: the prompt is prefilled elsewhere only when that replica is a decode replica,
   a prefill replica is healthy, the request generates tokens (no embedding, no prompt logprobs), and at
   least ``disagg_min_prompt_tokens`` of the prompt are not already cached on the decode replica (the
   routing index's view). Anything else runs there alone, as on a colocated replica: a short prompt or
   one mostly cached on the decode side costs less to compute than to move.
3. ``prefill``: the prefill replica is chosen by the prompt's blocks among the prefill pool (so a shared
   prefix is computed once there), sent the request with ``n = 1`` and ``max_tokens = 1`` (its token is
   not used: the decode replica computes the prompt's last block and samples every token the client
   gets), and read to its final record: the lease on the prompt's blocks and its usage.
4. The decode request carries the lease (``kv_transfer``); the decode replica pulls the blocks it lacks
   and streams to the client exactly as a colocated replica does.

Invariants:
- Nothing of the prefill reaches the client and nothing of it is billed by itself: a prefill that fails
  (no replica, a refused connection, an error record, no lease) is logged, and the prompt runs on the
  decode replica alone; the request never fails because of it.
- The prompt is metered once (``merged_usage``): from the prefill replica's view of the prompt (what
  its cache already held, what it wrote) unless the decode replica's pull failed and it recomputed (its
  final record's ``kv_pull.error``): then from the decode replica's own view. The output, its
  predictions and the prompt-cache lifetimes held come from the decode replica, which holds the blocks
  afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from engine.protocol import ErrorRecord, FinalRecord, GenerateRequest, KVPullReport, KVTransferSpec
from engine.usage import TokenKind, Usage
from gateway.engine_client import EngineClient, EngineUnavailable
from gateway.errors import GatewayError
from gateway.routing import PREFILL_POOL, ModelRoute, Replica, Router
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.gateway.generation")

# The prompt-side counts the prefill replica's view decides once its blocks were pulled.
PREFILL_KINDS = (TokenKind.CACHED_INPUT, TokenKind.CACHED_HOST, TokenKind.CACHED_DISK, TokenKind.CACHE_WRITE)


@dataclass(frozen=True, slots=True)
class Prefill:
    """A prompt prefilled elsewhere: the lease the decode request carries, and the prefill's usage."""

    transfer: KVTransferSpec
    usage: Usage
    replica: str


def remote_prefill_wanted(settings: Settings, router: Router, route: ModelRoute, decode: Replica,
                          request: GenerateRequest, block_hashes: Sequence[bytes], block_size: int) -> bool:
    """Whether ``request``'s prompt should be prefilled on a prefill replica (see the module docstring)."""
    if decode.info is None or decode.info.role != "decode":
        return False
    if request.pooling is not None or request.prompt_logprobs is not None:
        return False
    if not any(r.healthy and r.pool == PREFILL_POOL for r in router.models[route.served].replicas):
        return False
    cached = router.cached_prefix_blocks(decode, block_hashes) * block_size
    return len(request.prompt_token_ids) - cached >= settings.disagg_min_prompt_tokens


async def prefill(client: EngineClient, router: Router, route: ModelRoute, request: GenerateRequest,
                  block_hashes: Sequence[bytes], on_failure: str | None) -> Prefill | None:
    """Prefill ``request``'s prompt on a prefill replica; None (logged) when that did not work."""
    adapter = route.adapter.store_id if route.adapter is not None else None
    try:
        replica = router.pick(route.served, block_hashes, adapter=adapter, prefill=True)
    except GatewayError:
        return None
    ask = request.model_copy(update={
        "request_id": f"{request.request_id}-prefill", "n": 1, "max_tokens": 1, "logprobs": False,
        "top_logprobs": 0, "response_format": None, "prediction_token_ids": None, "stop": [],
        "stop_token_ids": [], "kv_transfer": None})
    replica.inflight += 1
    try:
        stream = await client.generate(replica.url, ask)
        final: FinalRecord | None = None
        try:
            async for record in stream:
                if isinstance(record, FinalRecord):
                    final = record
                elif isinstance(record, ErrorRecord):
                    logger.warning("prefill of %s on %s failed: %s", request.request_id, replica.url,
                                   record.error.message)
                    return None
        finally:
            await stream.aclose()
    except EngineUnavailable as exc:
        if exc.refused:
            router.mark_failed(replica, exc.message)
        logger.warning("prefill of %s on %s failed: %s", request.request_id, replica.url, exc.message)
        return None
    except GatewayError as exc:
        logger.warning("prefill of %s on %s failed: %s", request.request_id, replica.url, exc.message)
        return None
    finally:
        replica.inflight -= 1
    if final is None or final.kv_transfer is None:
        logger.warning("prefill of %s on %s returned no lease", request.request_id, replica.url)
        return None
    router.remember(replica, block_hashes)
    if adapter is not None:
        router.remember_adapter(replica, adapter)
    transfer = final.kv_transfer if on_failure is None else final.kv_transfer.model_copy(
        update={"on_failure": on_failure})
    return Prefill(transfer, final.usage, replica.url)


def merged_usage(decode: Usage, pull: KVPullReport | None, prefilled: Prefill | None) -> Usage:
    """The request's usage, the prompt counted once (see the module invariants). ``pull`` None with a
    prefill: the decode replica's count after an abort, which does not say how its pull went; the lease
    was there to pull, so the prefill's view counts."""
    if prefilled is None:
        return decode
    if pull is not None and pull.error is not None:
        if pull.pulled_tokens:  # pulled some, then recomputed: those were not served from a cache
            return decode.replace(cached_tokens=max(0, decode.cached_tokens - pull.pulled_tokens))
        return decode
    counts = dict(decode.counts)
    for kind in PREFILL_KINDS:
        counts[kind] = prefilled.usage[kind]
    return Usage(counts)
