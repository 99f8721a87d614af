-- Admit one request, atomically. KEYS: 1 request bucket, 2 token bucket, 3 leases (zset lease id ->
-- expiry ms), 4 cost holds (hash lease id -> estimated pico-USD, '_total'), 5 spend (hash month -> pico-USD),
-- 6 batch leases and 7 batch holds (the batch lines in flight: ``batch_admit.lua``).
-- ARGV: 1 rpm, 2 tpm, 3 max concurrency, 4 budget (each -1 for no limit), 5 window us,
-- 6 reserved tokens, 7 lease id, 8 lease ttl ms, 9 estimated cost (decimal integer string).
-- Returns {verdict, requests left, requests reset ms, tokens left, tokens reset ms, retry ms}.
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local max_conc = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local window_us = tonumber(ARGV[5])
local reserved = tonumber(ARGV[6])
local lease_id = ARGV[7]
local ttl_ms = tonumber(ARGV[8])
local est_cost = ARGV[9]

local now = now_us()
local now_ms = math.floor(now / 1000)
prune_leases(KEYS[3], KEYS[4], now_ms)
prune_leases(KEYS[6], KEYS[7], now_ms)

local req_level, req_reset, tok_level, tok_reset = 0, 0, 0, 0
if rpm > 0 then
  req_level = bucket_level(KEYS[1], rpm, window_us, now)
  req_reset = full_in_ms(req_level, rpm, window_us)
end
if tpm > 0 then
  tok_level = bucket_level(KEYS[2], tpm, window_us, now)
  tok_reset = full_in_ms(tok_level, tpm, window_us)
end

local function answer(verdict, retry_ms)
  return {verdict, math.floor(req_level), req_reset, math.floor(tok_level), tok_reset, retry_ms}
end

-- Not retryable soon: the month's budget is spent (counting what admitted requests may still cost),
-- a limit of zero, or a request larger than the whole token bucket.
if budget >= 0 then
  local spent = tonumber(redis.call('HGET', KEYS[5], redis_month()) or '0')
  local held = tonumber(redis.call('HGET', KEYS[4], '_total') or '0')
    + tonumber(redis.call('HGET', KEYS[7], '_total') or '0')
  if spent + held >= budget then return answer('quota', -1) end
end
if rpm == 0 or tpm == 0 or max_conc == 0 then return answer('blocked', -1) end
if tpm > 0 and reserved > tpm then return answer('too_large', -1) end

local verdict, retry_ms = 'ok', 0
if rpm > 0 and req_level < 1 then
  verdict = 'requests'
  retry_ms = math.ceil((1 - req_level) * window_us / rpm / 1000)
end
if tpm > 0 and tok_level < reserved then
  if verdict == 'ok' then verdict = 'tokens' end
  retry_ms = math.max(retry_ms, math.ceil((reserved - tok_level) * window_us / tpm / 1000))
end
if max_conc > 0 and redis.call('ZCARD', KEYS[3]) >= max_conc then
  if verdict == 'ok' then verdict = 'concurrency' end
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  retry_ms = math.max(retry_ms, math.min(1000, tonumber(first[2]) - now_ms))
end
if verdict ~= 'ok' then return answer(verdict, retry_ms) end

if rpm > 0 then
  req_level = req_level - 1
  bucket_store(KEYS[1], req_level, rpm, window_us, now)
  req_reset = full_in_ms(req_level, rpm, window_us)
end
if tpm > 0 then
  tok_level = tok_level - reserved
  bucket_store(KEYS[2], tok_level, tpm, window_us, now)
  tok_reset = full_in_ms(tok_level, tpm, window_us)
end
redis.call('ZADD', KEYS[3], now_ms + ttl_ms, lease_id)
keep_alive(KEYS[3], ttl_ms + 1000)
if est_cost ~= '0' then
  redis.call('HSET', KEYS[4], lease_id, est_cost)
  redis.call('HINCRBY', KEYS[4], '_total', est_cost)
  keep_alive(KEYS[4], ttl_ms + 1000)
end
return answer('ok', 0)
