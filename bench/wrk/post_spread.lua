-- POST one message to one of 1000 queues (no contention on a queue)
wrk.method = "POST"
wrk.body = '{"messages":[{"ttl":300,"body":{"event":"x"}}]}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Client-ID"] = "3381af92-2b9e-11e3-b191-71861300734c"
wrk.headers["X-Project-ID"] = "bench"
request = function()
  return wrk.format(nil, "/v2/queues/spread" .. math.random(1000) .. "/messages")
end
