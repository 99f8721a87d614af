-- Settle one admitted request. KEYS: 1 token bucket, 2 leases, 3 cost holds, 4 spend.
-- ARGV: 1 tpm (-1 none), 2 window us, 3 reserved - used tokens (refund > 0, overshoot < 0),
-- 4 lease id, 5 cost (decimal integer string), 6 the month it was admitted in ('' : now's). Returns the
-- month the cost was charged to.
local tpm = tonumber(ARGV[1])
local window_us = tonumber(ARGV[2])
local delta = tonumber(ARGV[3])
local lease_id = ARGV[4]
local cost = ARGV[5]

local now = now_us()
if tpm > 0 and delta ~= 0 then
  local level = bucket_level(KEYS[1], tpm, window_us, now) + delta
  if level > tpm then level = tpm end
  bucket_store(KEYS[1], level, tpm, window_us, now)
end
release_lease(KEYS[2], KEYS[3], lease_id)
local month = ARGV[6]
if month == nil or month == '' then month = month_of(math.floor(now / 1000000)) end
if cost ~= '0' then redis.call('HINCRBY', KEYS[4], month, cost) end
return month
