"""The engine's KV cache: block accounting, the hash-chain prefix cache, its host and disk tiers, cache
lifetimes, block events, and the copies between tiers.

- ``block_hash``: the salted SHA-256 chain over full blocks (torch-free; the gateway imports it).
- ``block_manager``: ``BlockManager``, ref-counted paged blocks and the device prefix cache.
- ``tiers``: ``HostTier`` / ``DiskIndex``, which hash lives where below the device, and ``TransferPlan``.
- ``pins``: ``CachePolicy`` (a request's prompt-cache lifetimes) and ``Pins``.
- ``events``: ``KVEventLog``, what every tier holds, published in order for the routing index.
- ``cache``: ``KVCache``, all of the above behind one object that the scheduler owns.
- ``transfer``: ``KVTransfer`` (torch), the copies a ``TransferPlan`` asks for; the model runner
  executes them in device order, around the forward passes.
- ``connector`` / ``tcp_transport`` / ``remote``: disaggregated serving, a prefill replica's leases and a
  decode replica's pulls (``KVConnector``), the bytes on the wire (TCP), and the device pool's side
  (``RemoteKVWorker``, torch).

Only ``transfer`` and ``remote`` import torch; nothing is imported here, so ``engine.kv.block_hash`` stays
torch-free.
"""
