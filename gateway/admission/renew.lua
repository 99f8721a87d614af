-- Extend a live lease. KEYS: 1 leases, 2 cost holds. ARGV: 1 lease id, 2 lease ttl ms.
-- Returns 1 if the lease was still held, 0 if it had already been released or pruned (not revived:
-- its cost hold is gone too, and reviving it after a settle would leak a slot).
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now_ms then return 0 end
redis.call('ZADD', KEYS[1], now_ms + ttl_ms, ARGV[1])
keep_alive(KEYS[1], ttl_ms + 1000)
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then keep_alive(KEYS[2], ttl_ms + 1000) end
return 1
