-- POST one small message (the Zaqar write-up's request)
wrk.method = "POST"
wrk.body = '{"messages":[{"ttl":300,"body":{"event":"x"}}]}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Client-ID"] = "3381af92-2b9e-11e3-b191-71861300734c"
wrk.headers["X-Project-ID"] = "bench"
-- the auth part sends a bearer token (bench/auth.py)
local authorization = os.getenv("BENCH_AUTHORIZATION")
if authorization then wrk.headers["Authorization"] = authorization end
-- ... or a Keystone token (X-Auth-Token)
local keystone_token = os.getenv("BENCH_X_AUTH_TOKEN")
if keystone_token then wrk.headers["X-Auth-Token"] = keystone_token end
