-- Admit a post (or a feed's creation) under its project's quotas.
-- KEYS: the project's limits hash, queue registry, topic registry and
-- reservations, then (one server; on a cluster the caller counts) the
-- expiry index, hash and counter (Q:exp, Q:q, Q:seq) of every feed the
-- registries list, queues first.
-- ARGV: now_ms, the service's max_messages and max_queues (0: none), the
-- feed's kind ('queue' or 'topic') and name, n (messages posted; 0: only
-- create the feed), this post's reservation ("<id> <n>"), held until (ms),
-- the project's live messages as the caller counted them ('': count here),
-- the expired segment messages not yet counted gone as the caller counted
-- them at now_ms ('' or "<count> <gone>...", gone: each feed's gone field in
-- KEYS order, '-' if none, as it read them), how many queue names follow,
-- then the queue names and the topic names the caller believes the
-- registries hold, in their order.
-- Returns {'ok' or 'held', max_messages, max_queues} ('held': the
-- reservation was made; the post script or the caller removes it),
-- {'queues', limit} / {'messages', limit}: over that quota, nothing changed,
-- {'stale', m, names...}: the registries hold other names (send those),
-- {'count'}: count the live messages first (a cluster), nothing changed,
-- {'expired'}: over the quota as counted here, but segment messages count
-- until their segment's review (_lib.lua's live_count): count those that
-- expired (the caller, ProjectQuotas) and ask again, nothing changed. The
-- count holds while no feed's gone field moved (a review or a delete moves
-- it), so a stale one gets {'expired'} again: the count stays exact.
local limits = redis.call('HMGET', KEYS[1], 'max_messages', 'max_queues')
local max_messages = tonumber(limits[1] or ARGV[2])
local max_queues = tonumber(limits[2] or ARGV[3])
local registry = KEYS[2]
if ARGV[4] == 'topic' then registry = KEYS[3] end
local n = tonumber(ARGV[6])
local listed = redis.call('ZSCORE', registry, ARGV[5])
if not listed and max_queues > 0
    and redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3]) >= max_queues then
  return {'queues', max_queues}
end
local outcome = 'ok'
if n > 0 and max_messages > 0 then
  -- the live count covers exactly the feeds the registries list now
  local queues = redis.call('ZRANGE', KEYS[2], 0, -1)
  local topics = redis.call('ZRANGE', KEYS[3], 0, -1)
  local m = tonumber(ARGV[11])
  local same = #queues == m and #topics == #ARGV - 11 - m
  for i = 1, #queues do same = same and ARGV[11 + i] == queues[i] end
  for i = 1, #topics do same = same and ARGV[11 + m + i] == topics[i] end
  if not same then
    local out = {'stale', #queues}
    for _, name in ipairs(queues) do out[#out + 1] = name end
    for _, name in ipairs(topics) do out[#out + 1] = name end
    return out
  end
  local live = tonumber(ARGV[9])
  local segmented, gone = false, {}
  if not live then
    if #KEYS == 4 and #queues + #topics > 0 then return {'count'} end
    live = 0
    for i = 5, #KEYS, 3 do
      live = live + live_count(ARGV[1], KEYS[i], KEYS[i + 1], KEYS[i + 2])
      local q = redis.call('HMGET', KEYS[i + 1], F_NEW_START, F_GONE)
      if q[1] then segmented = true end
      gone[#gone + 1] = q[2] or '-'
    end
  end
  -- room held by posts in flight; a holder that crashed lets go at its deadline
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[1])
  local held = 0
  for _, entry in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
    held = held + tonumber(string.match(entry, ' (%d+)$'))
  end
  if live + held + n > max_messages and segmented then
    local expired, seen = string.match(ARGV[10], '^(%d+) (.*)$')
    if not expired or seen ~= table.concat(gone, ' ') then return {'expired'} end
    live = live - tonumber(expired)
  end
  if live + held + n > max_messages then return {'messages', max_messages} end
  redis.call('ZADD', KEYS[4], ARGV[8], ARGV[7])
  redis.call('PEXPIREAT', KEYS[4], ARGV[8])
  outcome = 'held'
end
if not listed then redis.call('ZADD', registry, 0, ARGV[5]) end
return {outcome, max_messages, max_queues}
