-- Admit one batch line against the tenant's monthly budget, atomically, counting what every request
-- admitted before may still cost (interactive and batch holds alike), and hold the line's own estimate.
-- KEYS: 1 spend (hash month -> pico-USD), 2 interactive leases, 3 interactive holds, 4 batch leases
-- (zset line id -> expiry ms), 5 batch holds (hash line id -> estimated pico-USD, '_total').
-- ARGV: 1 budget (-1: none), 2 line request id, 3 hold ttl ms, 4 estimated cost (decimal integer string).
-- Returns 1 (admitted, held) or 0 (over the budget: nothing held).
local budget = tonumber(ARGV[1])
local line_id = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local est_cost = ARGV[4]

local now_ms = math.floor(now_us() / 1000)
prune_leases(KEYS[2], KEYS[3], now_ms)
prune_leases(KEYS[4], KEYS[5], now_ms)
-- A line admitted again (a retry) replaces its own hold rather than adding to it.
release_lease(KEYS[4], KEYS[5], line_id)
if budget >= 0 then
  local spent = tonumber(redis.call('HGET', KEYS[1], redis_month()) or '0')
  local held = tonumber(redis.call('HGET', KEYS[3], '_total') or '0')
    + tonumber(redis.call('HGET', KEYS[5], '_total') or '0')
  if spent + held + tonumber(est_cost) > budget then return 0 end
end
if est_cost ~= '0' then
  redis.call('HSET', KEYS[5], line_id, est_cost)
  redis.call('HINCRBY', KEYS[5], '_total', est_cost)
  redis.call('ZADD', KEYS[4], now_ms + ttl_ms, line_id)
  keep_alive(KEYS[4], ttl_ms + 1000)
  keep_alive(KEYS[5], ttl_ms + 1000)
end
return 1
