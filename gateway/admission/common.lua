-- Helpers shared by the admission scripts (billing.spend.MONTH_OF_LUA is prepended before this).
-- Buckets are hashes {level, ts}: level in tokens (a float, negative while in debt), ts in Redis
-- microseconds. A missing key is a full bucket.

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function bucket_level(key, cap, window_us, now)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  local level = tonumber(v[1])
  local ts = tonumber(v[2])
  if now > ts then level = level + (now - ts) * cap / window_us end
  if level > cap then level = cap end
  return level
end

-- Milliseconds until a bucket at `level` is full again.
local function full_in_ms(level, cap, window_us)
  if level >= cap then return 0 end
  return math.ceil((cap - level) * window_us / cap / 1000)
end

local function bucket_store(key, level, cap, window_us, now)
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'ts', string.format('%d', now))
  -- Once full, the key says nothing a missing key would not: let it expire then.
  redis.call('PEXPIRE', key, full_in_ms(level, cap, window_us) + 1000)
end

-- Release one lease and its cost hold (hash id -> pico-USD, '_total'); returns what was held, if anything.
local function release_lease(leases, holds, id)
  redis.call('ZREM', leases, id)
  local held = redis.call('HGET', holds, id)
  if held then
    redis.call('HDEL', holds, id)
    redis.call('HINCRBY', holds, '_total', '-' .. held)
  end
  return held
end

-- Drop leases whose expiry has passed (their gateway died or stalled) and release their cost holds.
local function prune_leases(leases, holds, now_ms)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now_ms)) do
    release_lease(leases, holds, id)
  end
end

-- Keep the lease set and the holds hash alive as long as their longest lease.
local function keep_alive(key, ttl_ms)
  if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
end
