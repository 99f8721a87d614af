-- Release one lease and its cost hold. KEYS: 1 leases (zset id -> expiry ms), 2 cost holds (hash id ->
-- pico-USD, '_total'). ARGV: 1 lease id. Returns what was held (nil: nothing).
return release_lease(KEYS[1], KEYS[2], ARGV[1])
