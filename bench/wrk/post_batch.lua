-- POST a batch of BATCH small messages (env BATCH, default 10)
local n = tonumber(os.getenv("BATCH") or "10")
local parts = {}
for i = 1, n do parts[i] = '{"ttl":300,"body":{"event":"x","i":' .. i .. '}}' end
wrk.method = "POST"
wrk.body = '{"messages":[' .. table.concat(parts, ",") .. ']}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Client-ID"] = "3381af92-2b9e-11e3-b191-71861300734c"
wrk.headers["X-Project-ID"] = "bench"
