-- Settle: release a reservation's lease and charge (or refund) the difference in tokens, once.
--
-- The lease entry in the sorted set is the per-request idempotency key: ZREM removes it exactly
-- once, so a second settle (or one after the lease expired) changes nothing and returns 0.
-- Same `full_at` encoding as token_bucket.lua; a refund never fills the bucket past capacity.
--
-- KEYS[1] tokens bucket   KEYS[2] leases (zset)
-- ARGV[1] request id
-- ARGV[2] actual cost minus reserved cost, in tokens (negative: refund)
-- ARGV[3] token refill rate, tokens/s (-1: unlimited)   ARGV[4] token capacity
--
-- Returns 1 when applied, 0 for a no-op.

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local expiry = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not expiry then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
if tonumber(expiry) <= now then return 0 end

local diff, rate, capacity = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rate < 0 or diff == 0 then return 1 end

local full_at = tonumber(redis.call('GET', KEYS[1]))
local lvl = capacity
if full_at and full_at > now then lvl = capacity - (full_at - now) * rate end
lvl = math.min(lvl - diff, capacity)
local deficit_s = (capacity - lvl) / rate
local ttl_ms = math.ceil(deficit_s * 1000)
if ttl_ms > 0 then
  redis.call('SET', KEYS[1], string.format('%.17g', now + deficit_s), 'PX', ttl_ms)
else
  redis.call('DEL', KEYS[1])
end
return 1
