-- Claimers that delete what they claimed (the groups part, bench/groups.py):
-- each connection claims up to LIMIT messages of QUEUE (env), and the next
-- request of the thread deletes the ones a claim returned (DELETE
-- .../messages?ids=...) before anyone claims again. Each thread counts the
-- claims that returned messages, the messages they returned, and every 204
-- (a delete's, or an empty claim's: 204s beyond the deletes sent mean the
-- queue had nothing left to claim); done() prints them on one line.
local queue = os.getenv("QUEUE") or "bclaim"
local limit = os.getenv("LIMIT") or "10"
local claim_path = "/v2/queues/" .. queue .. "/claims?limit=" .. limit
local delete_path = "/v2/queues/" .. queue .. "/messages?ids="
local claim_body = '{"ttl":60,"grace":60}'
local headers = {
  ["Content-Type"] = "application/json",
  ["Client-ID"] = "3381af92-2b9e-11e3-b191-71861300734c",
  ["X-Project-ID"] = "bench",
}
local threads = {}
local pending = {}

claims, messages, no_content, deletes, failures = 0, 0, 0, 0, 0

function setup(thread)
  table.insert(threads, thread)
end

function request()
  local ids = table.remove(pending)
  if ids then
    deletes = deletes + 1
    return wrk.format("DELETE", delete_path .. ids, headers)
  end
  return wrk.format("POST", claim_path, headers, claim_body)
end

function response(status, _, body)
  if status == 201 then
    local ids = {}
    for id in body:gmatch('"id":"([^"]+)","href"') do
      table.insert(ids, id)
    end
    claims = claims + 1
    messages = messages + #ids
    table.insert(pending, table.concat(ids, ","))
  elseif status == 204 then
    no_content = no_content + 1
  else
    failures = failures + 1
  end
end

function done()
  local total = {claims = 0, messages = 0, no_content = 0, deletes = 0, failures = 0}
  for _, thread in ipairs(threads) do
    for name, _ in pairs(total) do
      total[name] = total[name] + thread:get(name)
    end
  end
  io.write(string.format("claimers: claims %d messages %d no_content %d deletes %d failures %d\n",
    total.claims, total.messages, total.no_content, total.deletes, total.failures))
end
