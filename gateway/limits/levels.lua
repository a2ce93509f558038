-- Levels: a tenant's buckets and unexpired leases now, on Redis's clock. Reads only: no key is
-- written, refreshed or deleted, so reading never changes a budget or keeps an idle key alive.
--
-- KEYS[1] tokens bucket   KEYS[2] requests bucket   KEYS[3] leases (zset)
-- ARGV[1] token refill rate, tokens/s (-1: unlimited)   ARGV[2] token capacity
-- ARGV[3] request refill rate, requests/s (-1: unlimited)   ARGV[4] request capacity
--
-- Returns {token_level, request_level, in_flight}; levels as strings ("inf": unlimited).

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local function level(key, rate, capacity)
  if rate < 0 then return math.huge end
  local full_at = tonumber(redis.call('GET', key))
  if not full_at or full_at <= now then return capacity end
  return capacity - (full_at - now) * rate
end

local function fmt(x)
  if x == math.huge then return 'inf' end
  return string.format('%.17g', x)
end

local tokens = level(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
local requests = level(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
local in_flight = redis.call('ZCOUNT', KEYS[3], '(' .. string.format('%.17g', now), '+inf')
return {fmt(tokens), fmt(requests), in_flight}
