-- Remove and return up to `limit` messages nobody has claimed, atomically.
-- KEYS: the 6 fixed keys. ARGV: now_ms, limit, scan_limit, sealed (the
-- prefix of a sealed body), then pairs (id, SHA1 of the body the caller
-- opened, or '' if it cannot) for sealed bodies (see verdict).
-- Returns the segment review it moved earlier (ms; 0: none; see
-- segment_gone), then per message: id, seq, body, ttl, created_ms, author
-- line (the author and the message's headers, see record.py); or, when a sealed
-- body it would take was not opened by the caller yet, {'open', then per
-- such message: id, body}, having removed nothing: a message the caller
-- cannot open is never removed (it is skipped).
-- In a queue with ordered groups a group's messages are popped from its
-- head only, in order, and not while a claim holds its head (choose_messages).
local now = tonumber(ARGV[1])
local limit, scan_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local sealed, checked = ARGV[4], verdicts(5)
local groups_since = redis.call('HGET', KEYS[K_META], F_GROUPS_SINCE)
collect_garbage(ARGV[1], groups_since)
local unopened = {'open'}
local function judge(id, seq, m)
  if may_take(checked, sealed, id, m, unopened) then return 'take' end
  return 'skip'
end
local chosen, _, tidy = choose_messages(now, limit, scan_limit, groups_since, judge, true)
if #unopened > 1 then return unopened end
local out, review = {0}, nil
for _, c in ipairs(chosen) do
  local id, seq, m, group = c[1], c[2], c[3], c[5]
  if m.segment then review = earlier(review, segment_gone(m.seq, now)) else forget(id) end
  if group ~= '' then
    redis.call('ZREM', GROUP_PREFIX .. group, id)
  elseif groups_since then
    redis.call('ZREM', CLAIM_INDEX, id)
  end
  out[#out + 1] = id
  out[#out + 1] = seq
  out[#out + 1] = m.body
  out[#out + 1] = int(m.ttl)
  out[#out + 1] = int(m.created)
  out[#out + 1] = m.author
end
tidy_after(tidy)
out[1] = review or 0
return out
