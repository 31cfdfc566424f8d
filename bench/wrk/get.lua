-- GET a page of 10 messages posted by another client (so echo does not hide them)
wrk.method = "GET"
wrk.headers["Client-ID"] = "d1d3e5c2-86a6-4a5e-9c7b-3c8a4d1f0b11"
wrk.headers["X-Project-ID"] = "bench"
-- the auth part sends a bearer token (bench/auth.py)
local authorization = os.getenv("BENCH_AUTHORIZATION")
if authorization then wrk.headers["Authorization"] = authorization end
-- ... or a Keystone token (X-Auth-Token)
local keystone_token = os.getenv("BENCH_X_AUTH_TOKEN")
if keystone_token then wrk.headers["X-Auth-Token"] = keystone_token end
