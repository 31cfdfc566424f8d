-- Claim up to `limit` messages for a new claim, atomically.
-- KEYS: the 6 fixed keys.
-- ARGV: now_ms, claim_id, ttl, grace, limit, scan_limit, max_claim_count
--       ('' = none), dead-letter ttl ('' = keep the message's ttl),
--       dead-letter queue name ('' = none; must equal the queue's setting),
--       whether to dead-letter ('1') or not ('0'), sealed (the prefix of a
--       sealed body), then pairs (id, SHA1 of the body the caller opened, or
--       '' if it cannot) for sealed bodies (see verdict).
-- Returns {'retry'} when the queue's dead-letter settings changed since the
-- caller read them; {'open', then per message: id, body} when a sealed body
-- it would claim was not opened by the caller yet (nothing claimed: a
-- message the caller cannot open is never claimed, it is skipped);
-- else {claim_id or '', number of messages parked,
--   the earliest time (ms) a message looked at and not free becomes free by
--   itself (falls due, its claim expires; '' = none): when nothing was
--   claimed, a claim wait sleeps until then at most,
--   then per parked message: id, body, author line (the author and the
--   message's headers, see record.py), dead-letter ttl, claim count,
--   then per claimed message: id, seq, body, ttl, created_ms, claim count,
--   author line}.
-- A message claimed max_claim_count times already is *parked* instead of
-- claimed: held under claim_id but not listed in the claim, for the caller
-- to copy into the dead-letter queue (another slot) and then forget; see
-- RedisStore._dead_letter.
-- Every candidate is checked on its own: its claim, delay and expiry (no
-- "claimed messages form a prefix" shortcut); in a queue with ordered
-- groups a group's messages are taken from its head only (choose_messages).
local now = tonumber(ARGV[1])
local claim_id = ARGV[2]
local ttl, grace = tonumber(ARGV[3]), tonumber(ARGV[4])
local limit, scan_limit = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_claims = tonumber(ARGV[7])
local dlq_ttl = tonumber(ARGV[8])
local dlq = ARGV[9]
local dead_letters = ARGV[10] == '1'
local sealed, checked = ARGV[11], verdicts(12)
local q = redis.call('HMGET', KEYS[K_META], F_MAX_CLAIMS, F_DEAD_LETTER_QUEUE,
  F_DEAD_LETTER_TTL, F_GROUPS_SINCE)
if (q[1] or '') ~= ARGV[7] or (q[2] or '') ~= dlq or (q[3] or '') ~= ARGV[8] then
  return {'retry'}
end
local groups_since = q[4]
collect_garbage(ARGV[1], groups_since)
local claim_expires = now + ttl * 1000
local out = {}
local parked = {}
local claimed_ids = {}
-- first choose (parked ones are copied as stored: they need no opening),
-- then write, only if the caller has opened every body it would get
local unopened = {'open'}
local function judge(id, seq, m)
  if dead_letters and max_claims and m.count >= max_claims then return 'park' end
  if may_take(checked, sealed, id, m, unopened) then return 'take' end
  return 'skip'
end
local chosen, next_free, tidy = choose_messages(now, limit, scan_limit, groups_since, judge)
if #unopened > 1 then return unopened end
-- segment messages' claim states, and the claimed index, written at once
local states, claimed = {fields = {}, longest = {}}, {}
for _, c in ipairs(chosen) do
  local id, seq, m, park = c[1], c[2], c[3], c[4]
  local key = record_key(id)
  local count = m.count
  if park then
    m.claim, m.claim_expires = claim_id, claim_expires
    write_header(id, m, states)
    claimed[#claimed + 1] = int(claim_expires)
    claimed[#claimed + 1] = id
    if c[5] ~= '' then
      -- it leaves its group (whose next message is now its head), and stays
      -- claimable alone until the dead-letter queue has its copy
      redis.call('ZREM', GROUP_PREFIX .. c[5], id)
      redis.call('ZADD', CLAIM_INDEX, seq, id)
    end
    parked[#parked + 1] = id
    parked[#parked + 1] = m.body
    parked[#parked + 1] = m.segment and segment_author_line(m) or m.author
    parked[#parked + 1] = int(dlq_ttl or m.ttl)
    parked[#parked + 1] = int(count)
  else
    local new_expires, new_ttl = extend_for_claim(m.expires, m.created, claim_expires, grace)
    m.claim, m.claim_expires, m.count = claim_id, claim_expires, count + 1
    m.expires, m.ttl = new_expires, new_ttl
    write_header(id, m, states)
    if not m.segment then
      redis.call('PEXPIREAT', key, int(new_expires))
      redis.call('ZADD', KEYS[K_EXP], int(new_expires), id)
    end
    claimed[#claimed + 1] = int(claim_expires)
    claimed[#claimed + 1] = id
    claimed_ids[#claimed_ids + 1] = id
    out[#out + 1] = id
    out[#out + 1] = seq
    out[#out + 1] = m.body
    out[#out + 1] = int(new_ttl)
    out[#out + 1] = int(m.created)
    out[#out + 1] = int(count + 1)
    out[#out + 1] = m.author  -- the author line: the message's headers ride on it
  end
end
write_states(states)
if #claimed > 0 then redis.call('ZADD', KEYS[K_CLAIMED], unpack(claimed)) end
tidy_after(tidy)
if #claimed_ids > 0 then
  local ckey = claim_key(claim_id)
  redis.call('HSET', ckey, F_TTL, int(ttl), F_GRACE, int(grace), F_CREATED, ARGV[1],
    F_CLAIM_EXPIRES, int(claim_expires), F_HELD, table.concat(claimed_ids, ' '))
  redis.call('PEXPIREAT', ckey, int(claim_expires))
  redis.call('ZADD', KEYS[K_CLAIMS], int(claim_expires), claim_id)
end
local reply = {'', math.floor(#parked / 5), next_free and int(next_free) or ''}
if #claimed_ids > 0 then reply[1] = claim_id end
for _, v in ipairs(parked) do reply[#reply + 1] = v end
for _, v in ipairs(out) do reply[#reply + 1] = v end
return reply
