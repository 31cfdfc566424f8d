-- Paced requests: with env KIND=post, POST one message to one of 1000 queues
-- (as post_spread.lua); else GET the URL given to wrk (the hello baseline:
-- what wrk and the machine add at the same pace). The threads together offer
-- RATE requests/s (env RATE and THREADS, the -t given to wrk), whatever the
-- number of connections. Each thread hands out send times spaced
-- THREADS/RATE apart, one per request, to whichever connection is ready;
-- a connection waits for its time (wrk's delay()). Times already past are
-- dropped rather than caught up with (a burst of late requests would make
-- the tail it measures), so when the service, or wrk itself, falls behind
-- the rate achieved falls short of the rate offered and says so. Latency is counted from the send, as wrk does. The first
-- send is START_MS after the first connection (env, default 0): wrk opens
-- every connection at once, and the service's work of accepting thousands
-- of them should not count in the latencies of a steady load.
local ffi = require("ffi")
ffi.cdef [[
  typedef struct { long tv_sec; long tv_nsec; } feedsvc_timespec;
  int clock_gettime(int clock, feedsvc_timespec *ts);
]]
local now_ts = ffi.new("feedsvc_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, now_ts) -- CLOCK_MONOTONIC
  return tonumber(now_ts.tv_sec) * 1000 + tonumber(now_ts.tv_nsec) / 1e6
end

local interval = tonumber(os.getenv("THREADS") or "1") * 1000 / tonumber(os.getenv("RATE") or "1000")
local start = tonumber(os.getenv("START_MS") or "0")
local due = nil

local post = os.getenv("KIND") == "post"
if post then
  wrk.method = "POST"
  wrk.body = '{"messages":[{"ttl":300,"body":{"event":"x"}}]}'
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Client-ID"] = "3381af92-2b9e-11e3-b191-71861300734c"
  wrk.headers["X-Project-ID"] = "bench"
end

function delay()
  local now = now_ms()
  if due == nil then due = now + start end
  due = due + interval
  if due < now then due = now end
  return due - now
end

if post then
  request = function()
    return wrk.format(nil, "/v2/queues/spread" .. math.random(1000) .. "/messages")
  end
end
