-- In flight: the tenant's unexpired concurrency leases, counted on Redis's clock (read only).
--
-- KEYS[1] leases (zset of request id -> expiry, seconds since the epoch)
-- Returns an integer.

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%.17g', now), '+inf')
