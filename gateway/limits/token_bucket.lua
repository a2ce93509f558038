-- Reserve: take `cost` tokens, one request and one concurrency lease for a tenant, all or none.
--
-- The algorithm of gateway/limits/bucket.py on Redis's clock. Each bucket is one string key
-- holding `full_at` (seconds since the epoch, from TIME) at which it is full again; an absent key
-- is a full bucket, so refill needs no write and an idle tenant's keys expire on their own.
-- Leases are a sorted set of request ids scored by expiry, so a crashed gateway's slots free
-- themselves after the lease TTL. Every key carries the tenant's {hash tag}: one cluster slot.
-- Idempotent per request id: if the id already holds a lease (the client retried a call whose
-- reply it lost), nothing more is taken and the answer is "allowed" with the current levels.
--
-- KEYS[1] tokens bucket   KEYS[2] requests bucket   KEYS[3] leases (zset)
-- ARGV[1] request id
-- ARGV[2] cost in tokens (>= 0)
-- ARGV[3] token refill rate, tokens/s (-1: unlimited)   ARGV[4] token capacity
-- ARGV[5] request refill rate, requests/s (-1: unlimited)   ARGV[6] request capacity
-- ARGV[7] max concurrent requests (-1: unlimited)
-- ARGV[8] lease TTL in seconds
--
-- Returns {allowed, blocked, token_level, request_level, in_flight}:
--   allowed     1 taken (or already held: see below), 0 refused
--   blocked     bit mask: 1 tokens, 2 requests, 4 concurrency, 8 cost exceeds token capacity
--   *_level     bucket level after the take (or now, when refused), as a string: Lua numbers
--               would come back truncated to integers; "inf" for an unlimited bucket
--   in_flight   unexpired leases, this one included when allowed

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local id = ARGV[1]
local cost = tonumber(ARGV[2])
local token_rate, token_capacity = tonumber(ARGV[3]), tonumber(ARGV[4])
local request_rate, request_capacity = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_concurrent = tonumber(ARGV[7])
local lease_ttl = tonumber(ARGV[8])

local function level(key, rate, capacity)
  if rate < 0 then return math.huge end
  local full_at = tonumber(redis.call('GET', key))
  if not full_at or full_at <= now then return capacity end
  return capacity - (full_at - now) * rate
end

local function store(key, lvl, rate, capacity)
  if rate < 0 then return end
  local deficit_s = (capacity - lvl) / rate
  local ttl_ms = math.ceil(deficit_s * 1000)
  if ttl_ms > 0 then
    redis.call('SET', key, string.format('%.17g', now + deficit_s), 'PX', ttl_ms)
  else
    redis.call('DEL', key)
  end
end

local function fmt(x)
  if x == math.huge then return 'inf' end
  return string.format('%.17g', x)
end

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local in_flight = redis.call('ZCARD', KEYS[3])
local tokens = level(KEYS[1], token_rate, token_capacity)
local requests = level(KEYS[2], request_rate, request_capacity)
if redis.call('ZSCORE', KEYS[3], id) then
  return {1, 0, fmt(tokens), fmt(requests), in_flight}
end
local blocked = 0
if token_rate >= 0 and cost > token_capacity then
  blocked = blocked + 8 + 1
elseif tokens < cost then
  blocked = blocked + 1
end
if requests < 1 then blocked = blocked + 2 end
if max_concurrent >= 0 and in_flight >= max_concurrent then blocked = blocked + 4 end

if blocked ~= 0 then
  return {0, blocked, fmt(tokens), fmt(requests), in_flight}
end

tokens = tokens - cost
requests = requests - 1
store(KEYS[1], tokens, token_rate, token_capacity)
store(KEYS[2], requests, request_rate, request_capacity)
redis.call('ZADD', KEYS[3], now + lease_ttl, id)
-- Leases are added in expiry order, so the newest one decides when the whole set may go.
redis.call('PEXPIRE', KEYS[3], math.ceil(lease_ttl * 1000))
return {1, 0, fmt(tokens), fmt(requests), in_flight + 1}
