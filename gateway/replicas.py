"""Which replicas a pool has: its configured URLs, plus the addresses its ``dns`` name resolves to now.

A pool (``settings.pools[name]``) lists replica base URLs and/or names ``dns = "name:port"``: a Kubernetes
headless Service (one address per *ready* pod), a compose service scaled to several replicas. The router
(``gateway.routing``) resolves every such name each ``replica_discovery_interval_s`` and applies the
difference: a URL that appears becomes a replica (probed at once, its KV index built from a snapshot on
first contact), a URL that vanished leaves routing and the index (its streams still running go on: they
hold their own connection).

Invariants:
- A replica's URL is ``http://<address>:<port>`` (IPv6 in brackets), so one pod is one replica however
  many names resolve to it, and a restarted pod with a new address is a new replica.
- Configured URLs are always part of the pool; discovery only adds and removes the resolved ones.
- A name that does not exist or has no address (every pod gone, a pool scaled to zero) is an answer: the
  pool's discovered replicas all leave. A resolution that *fails* (a timeout, a DNS server error) is not:
  the pool keeps the replicas it had, and the failure is logged, so a DNS hiccup never empties a pool.
- The resolver is a seam (``Resolver``): the real one, ``resolve_dns``, asks the event loop's
  ``getaddrinfo`` (it runs in the loop's executor and never blocks the loop); tests pass their own.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from tollgate.settings import PoolConfig

logger = logging.getLogger("tollgate.gateway.replicas")

# (host, port) -> the addresses the name has now ([] when it has none); ``ResolutionFailed`` when it
# could not be told.
Resolver = Callable[[str, int], Awaitable[list[str]]]
# getaddrinfo's answers that mean "no such name / no address", as opposed to "could not ask".
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class ResolutionFailed(Exception):
    """The name could not be resolved now (a timeout, a server failure): keep what was known."""


async def resolve_dns(host: str, port: int) -> list[str]:
    """The name's addresses (IPv4 and IPv6, de-duplicated, sorted) through the event loop's resolver."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESS:
            return []
        raise ResolutionFailed(f"{host}: {exc.strerror or exc}") from exc
    except OSError as exc:
        raise ResolutionFailed(f"{host}: {exc}") from exc
    return sorted({str(info[4][0]) for info in infos})


def replica_url(address: str, port: int) -> str:
    """``http://address:port``, an IPv6 address in brackets; ``ValueError`` for what is no address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    host = f"[{address}]" if ip.version == 6 else address
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class PoolChange:
    added: list[str]
    removed: list[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def diff(current: Iterable[str], wanted: Iterable[str]) -> PoolChange:
    """What turns ``current`` into ``wanted`` (both URL collections), in ``wanted``'s / ``current``'s
    order."""
    current, wanted = list(dict.fromkeys(current)), list(dict.fromkeys(wanted))
    now, then = set(wanted), set(current)
    return PoolChange(added=[u for u in wanted if u not in then],
                      removed=[u for u in current if u not in now])


def static_urls(pool: PoolConfig) -> list[str]:
    return list(dict.fromkeys(url.rstrip("/") for url in pool.replicas))


class PoolDiscovery:
    """Resolves the ``dns`` names of the given pools; ``resolve`` answers each pool's full URL list."""

    def __init__(self, pools: Mapping[str, PoolConfig], resolver: Resolver | None = None,
                 timeout_s: float = 5.0) -> None:
        self.pools = {name: pool for name, pool in pools.items() if pool.dns is not None}
        self._resolver = resolver or resolve_dns
        self._timeout_s = timeout_s
        self._failing: dict[str, str] = {}  # pool -> the error last logged

    def __bool__(self) -> bool:
        return bool(self.pools)

    async def resolve(self) -> dict[str, list[str]]:
        """Each dynamic pool's URLs now: configured ones first, then one per resolved address. A pool
        whose name could not be resolved is left out (its replicas stay as they are)."""
        names = list(self.pools)
        answers = await asyncio.gather(*(self.resolve_pool(name) for name in names), return_exceptions=True)
        out: dict[str, list[str]] = {}
        for name, answer in zip(names, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, ResolutionFailed | TimeoutError):
                    raise answer
                message = str(answer) or "no answer"
                if self._failing.get(name) != message:
                    logger.warning("pool %s: resolving %s failed (%s); keeping its replicas", name,
                                   self.pools[name].dns, message)
                self._failing[name] = message
                continue
            if self._failing.pop(name, None) is not None:
                logger.info("pool %s: %s resolves again", name, self.pools[name].dns)
            out[name] = answer
        return out

    async def resolve_pool(self, name: str) -> list[str]:
        """The pool's URLs (``ResolutionFailed`` / ``TimeoutError`` when its name cannot be resolved)."""
        pool = self.pools[name]
        target = pool.dns_target
        if target is None:  # only pools with a dns name are kept; never here
            return static_urls(pool)
        host, port = target
        async with asyncio.timeout(self._timeout_s):
            addresses = await self._resolver(host, port)
        resolved = []
        for address in addresses:
            try:
                resolved.append(replica_url(address, port))
            except ValueError:
                logger.warning("pool %s: %s resolved to %r, which is no address; ignored", name, pool.dns,
                               address)
        return list(dict.fromkeys([*static_urls(pool), *resolved]))


async def current_replica_urls(pools: Mapping[str, PoolConfig], resolver: Resolver | None = None,
                               timeout_s: float = 5.0) -> tuple[list[str], dict[str, str]]:
    """Every replica URL of every pool right now, once each (configured and resolved), and the ``dns``
    names that could not be resolved with why (for one-off callers: a cache purge)."""
    urls = [url for pool in pools.values() for url in static_urls(pool)]
    discovery = PoolDiscovery(pools, resolver, timeout_s)
    failed: dict[str, str] = {}
    for name, pool in discovery.pools.items():
        try:
            urls.extend(await discovery.resolve_pool(name))
        except (ResolutionFailed, TimeoutError) as exc:
            failed[str(pool.dns)] = str(exc) or f"no answer within {timeout_s:g} s"
    return list(dict.fromkeys(urls)), failed
