-- Post messages in the segment layout (storage/segments.py): one call gives
-- them their seqs and writes their records and slots, all or nothing.
-- KEYS: the 6 fixed keys, then (when the post holds room under its
--       project's quota, see quotas.py) the project's reservations.
-- ARGV: now_ms, default_ttl, default_delay, request size in bytes,
--       idempotency token ('' = none), idempotency window in ms, '1' if the
--       bodies are sealed (encrypted) else '0', the post's reservation
--       ('' = none), the feed's id tag (segments.id_tag), '1' if the queue
--       may start segments here (the process writes segments) else '0',
--       then per message: ttl, delay ('' = the queue's default, else the
--       service's), ordered group ('' = none, or not indexed: a topic's),
--       the record's tail as Python builds it (segments.record_tail: the
--       author, the extras with their length in front, the body): the
--       script puts the fixed-width times in front and appends it.
-- The reservation goes first thing, as in post.lua, unless the answer is
-- {'records'}: the queue has no segments and may not start them here
-- (nothing changed; post.lua is the one to call).
-- Returns {'posted', the first message's seq} (the others follow it: the
-- caller makes their ids, segments.message_id), after 'review' and its time
-- (ms) when the post scheduled a segment's review (storage/reviews.py: the
-- process notes it in fs:sweep); {'seal'}, {'toolarge', limit},
-- {'full', limit}, {'replay', id...} as post.lua (nothing written).
-- The first post in segments sets the queue's F_NEW_START to the first seq
-- it writes (the counter + 1): from there on every message of the queue is
-- in segments, every one before in the older layout.
-- Ordered groups and notifications as post.lua.
-- Redis runs all of this on every post (docs/design-compact-storage.md,
-- "What a post costs"): one HMGET of the queue hash, the counter, then per
-- segment touched one APPEND, one PEXPIREAT, one SETRANGE; the older
-- layout's clean-up only while it may still hold messages (F_LEGACY_GONE
-- unset: Q:exp never gains a member once the queue writes segments, so
-- once it is empty it stays so; expired claims are trimmed by the claim
-- and pop scripts, which run collect_garbage on every call).
local now = tonumber(ARGV[1])
local FIRST = 11
local PER = 4
local n = (#ARGV - 10) / PER
local q = redis.call('HMGET', KEYS[K_META], F_NEW_START, F_ENCRYPTED, F_DEFAULT_TTL,
  F_DEFAULT_DELAY, F_MAX_POST_SIZE, F_MAX_MESSAGES, F_GROUPS_SINCE, F_CREATED, F_REVIEW_FROM,
  F_LEGACY_GONE)
local ns = q[1]
if not ns and ARGV[10] ~= '1' then return {'records'} end
if ARGV[8] ~= '' then redis.call('ZREM', KEYS[7], ARGV[8]) end
if ARGV[7] ~= '1' and q[2] == '1' then return {'seal'} end
local token = ARGV[5]
local replay = replayed(token, now)
if replay then return replay end
if not q[8] then redis.call('HSET', KEYS[K_META], F_CREATED, ARGV[1]) end
local groups_since = q[7]
-- the older layout's messages and claims, while it may have any
local legacy_gone = q[10]
if not legacy_gone then
  collect_garbage(ARGV[1], groups_since)
  if redis.call('EXISTS', KEYS[K_EXP]) == 0 then legacy_gone = '1' end
end
if q[5] and tonumber(ARGV[4]) > tonumber(q[5]) then return {'toolarge', q[5]} end
-- one due review of the queue's segments first (storage/reviews.py)
local reviewed = ns and review_due(now, 1) > 0
if q[6] then
  -- counted as posted less gone; near the limit, less the expired not yet swept too
  local live = live_count(ARGV[1], KEYS[K_EXP], KEYS[K_META], KEYS[K_SEQ])
  if ns and live + n > tonumber(q[6]) then live = live - expired_unswept(now) end
  if live + n > tonumber(q[6]) then return {'full', q[6]} end
end
local default_ttl = tonumber(q[3] or ARGV[2])
local default_delay = tonumber(q[4] or ARGV[3])
-- the counter moves first (nothing is refused from here on): one call
local top = redis.call('INCRBY', KEYS[K_SEQ], n) - n
if top == 0 then
  -- a new counter: microseconds, so a re-created queue starts above every old marker
  top = now * 1000
  redis.call('SET', KEYS[K_SEQ], int(top + n))
  redis.call('HSET', KEYS[K_META], F_SEQ_BASE, int(top))
end
if not ns then
  if legacy_gone then
    redis.call('HSET', KEYS[K_META], F_NEW_START, int(top + 1), F_LEGACY_GONE, '1')
  else
    redis.call('HSET', KEYS[K_META], F_NEW_START, int(top + 1))
  end
elseif legacy_gone and not q[10] then
  redis.call('HSET', KEYS[K_META], F_LEGACY_GONE, '1')
end
-- the open segment's earliest expiry, and the earliest review this post set
local review_from, review = tonumber(q[9]), nil
if reviewed then review_from = tonumber(redis.call('HGET', KEYS[K_META], F_REVIEW_FROM)) end

-- A call's records for one segment: one APPEND, one SETRANGE of their
-- (consecutive) slots, the segment's expiry raised to the latest of them.
local k, first_slot, records, offsets, pending, latest, earliest = nil, 0, {}, {}, 0, 0, nil
local function flush()
  local key = SEGMENT_PREFIX .. k
  local data = table.concat(records)
  local at = redis.call('APPEND', key, data) - #data
  if at == 0 then
    -- a new segment (or one gone whole): its slot table first
    redis.call('SET', key, string.rep('\0', SEG_TABLE_BYTES) .. data)
    at = SEG_TABLE_BYTES
    redis.call('PEXPIREAT', key, int(latest))
    redis.call('ZADD', DIRECTORY, k, k)
    if first_slot == 0 then
      -- the segment before is closed: copied to fit (APPEND left it room to grow)
      local before = SEGMENT_PREFIX .. int(tonumber(k) - 1)
      local closed = redis.call('GET', before)
      if closed then redis.call('SET', before, closed, 'KEEPTTL') end
    end
  else
    redis.call('PEXPIREAT', key, int(latest), 'GT')
  end
  if at == SEG_TABLE_BYTES then
    -- opened: its count starts at minus the seqs of its range before it
    redis.call('HSETNX', SEGMENT_COUNTS, k, int(-first_slot))
  end
  if at == SEG_TABLE_BYTES or not review_from or earliest < review_from then
    -- reviewed at its earliest expiry + SEG_REVIEW_AFTER_MS (or earlier)
    review_from = earliest
    local when = earliest + SEG_REVIEW_AFTER_MS
    redis.call('ZADD', REVIEWS, 'LT', int(when), k)
    redis.call('HSET', KEYS[K_META], F_REVIEW_FROM, int(earliest))
    if not review or when < review then review = when end
  end
  for j = 1, #offsets do offsets[j] = struct.pack('>I4', at + offsets[j]) end
  redis.call('SETRANGE', key, first_slot * SEG_SLOT_BYTES, table.concat(offsets))
  records, offsets, pending, latest, earliest = {}, {}, 0, 0, nil
end

local tag, format = ARGV[9], string.format
local seq, first_due = top, 0
-- seqs are consecutive: the segment and slot are split once, then counted
local slot
k, slot = segment_of(top + 1)
first_slot = slot
for i = 1, n do
  local a = FIRST + (i - 1) * PER
  local ttl = tonumber(ARGV[a]) or default_ttl
  local delay = tonumber(ARGV[a + 1]) or default_delay
  local group = ARGV[a + 2]
  seq = seq + 1
  if slot == SEG_SLOTS then
    flush()
    k, slot = int(tonumber(k) + 1), 0
    first_slot = 0
  end
  slot = slot + 1
  local expires = now + ttl * 1000
  local due = 0
  if delay > 0 then due = now + delay * 1000 end
  local written = format(SEG_RECORD_FORMAT, expires, due, ttl) .. ARGV[a + 3]
  offsets[#offsets + 1] = pending
  records[#records + 1] = written
  pending = pending + #written
  if expires > latest then latest = expires end
  if not earliest or expires < earliest then earliest = expires end
  groups_since = index_for_claims(seq, group, groups_since, nil, tag)
  if due > 0 and (first_due == 0 or due < first_due) then first_due = due end
end
flush()
notify(seq, first_due)
if token ~= '' then
  local ids = {}
  for i = 1, n do ids[i] = tag .. format(SEG_SEQ_FORMAT, top + i) end
  remember_post(token, now + tonumber(ARGV[6]), ids)
end
if review then return {'review', int(review), 'posted', int(top + 1)} end
return {'posted', int(top + 1)}
