-- Take up to `want` requests from a project's rate bucket: GCRA (the generic
-- cell rate algorithm, as redis-cell), one number per project, no timer.
-- KEYS[1] the bucket (keys.rate_bucket_key): the theoretical arrival time in
--         ms, a decimal string; gone when the bucket is full
-- KEYS[2] the project's limits hash (keys.project_limits_key): optional
--         `rate` and `burst` fields override ARGV's defaults
-- ARGV    now ms (the service's clock), default rate per second, default
--         burst (0: one second's worth of the rate, at least 1), want
-- An override out of the settings' bounds (rate 0 or 0.001..1e6, burst
-- 1..1e7) is ignored, so TAT stays within 1e13 ms of now.
-- Returns {granted, retry after ms (0 when granted), rate, burst}: rate as a
-- string (a Lua number returned to Redis is truncated to an integer), and
-- granted = want, rate "0" when the project is not limited.
local now = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local override = redis.call('HMGET', KEYS[2], 'rate', 'burst')
local o_rate = tonumber(override[1])
if o_rate and (o_rate == 0 or (o_rate >= 0.001 and o_rate <= 1000000)) then
  rate = o_rate
end
local o_burst = tonumber(override[2])
if o_burst and o_burst >= 1 and o_burst <= 10000000 then
  burst = math.floor(o_burst)
end
if rate <= 0 then
  return {want, 0, '0', 0}
end
if burst < 1 then
  burst = math.max(1, math.ceil(rate))
end
local interval = 1000 / rate
local tolerance = burst * interval
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then
  tat = now
end
-- a request is allowed while tat + interval - tolerance <= now
local room = math.floor((now + tolerance - tat) / interval + 1e-9)
local granted = math.min(want, room)
if granted < 1 then
  return {0, math.ceil(tat + interval - tolerance - now), tostring(rate), burst}
end
tat = tat + granted * interval
redis.call('SET', KEYS[1], string.format('%.3f', tat), 'PX', string.format('%d', math.ceil(tat - now) + 1))
return {granted, 0, tostring(rate), burst}
