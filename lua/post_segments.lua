-- Post messages in the segment layout (storage/segments.py): one call
-- takes one post or several to the queue (lua_segments.py's combiner: the
-- posts that arrived while the queue's previous call was in flight), checks
-- each as if it came alone, in order, and gives the messages of those it
-- accepts consecutive seqs, writing their records and slots together; all
-- or nothing.
-- KEYS: the 6 fixed keys, then (when a post holds room under its
--       project's quota, see quotas.py) the project's reservations.
-- ARGV: now_ms, idempotency window in ms, the feed's id tag
--       (segments.id_tag), '1' if the queue may start segments here (the
--       process writes segments) else '0', the number of posts; the queue's
--       default ttl and default delay the process built the records with
--       (its hash's fields as it last saw them, '' = unset; '-' = no message
--       took a default, nothing to check); the earliest and the latest
--       expiry (ms) of the call's messages, and the earliest time one of
--       them is due (ms, 0 = none is delayed); the number of messages with
--       an ordered group (indexed: a queue's, not a topic's); the number of
--       posts out of the common (more than one message, an idempotency
--       token, sealed bodies or a reservation); then per post its request
--       size in bytes; then per post out of the common: its place among the
--       posts (1 = the first), its number of messages, idempotency token
--       ('' = none), '1' if its bodies are sealed (encrypted) else '0', its
--       reservation ('' = none), every other post being one message, none,
--       '0', none (two arguments a common post, its size and its record:
--       Redis parses every argument of a call twice, into its own string and
--       into Lua's); then per message with a group: its
--       place among the call's messages (1 = the first post's first), its
--       group; then per message, the posts' in order, its whole record as
--       Python builds it (segments.encode_record): the script only indexes
--       them. The expiries and due time are the call's, not each segment's:
--       a segment's key lives at least as long as its latest record and is
--       reviewed no later than its earliest one asks (reviews.py), and a
--       refused post's messages only make both earlier or later than need be.
-- Returns {'records'} if the queue has no segments and may not start them
-- here (nothing changed, no reservation gone: post.lua is the one to call);
-- {'defaults', ttl, delay} if the queue's default ttl and delay are not
-- those the records were built with (nothing changed: the process builds
-- them again with these, its hash's fields, '' = unset).
-- Else {review, answer...}: review is the time (ms) of a segment's review
-- the call scheduled (storage/reviews.py: the process notes it in
-- fs:sweep), 0 if none; then one answer per post, in order: its first
-- message's seq, a number (the others follow it: the caller makes their
-- ids, segments.message_id; a seq is exact in a Lua number, below 2^53);
-- or, nothing of it written,
-- {'seal'}, {'toolarge', limit}, {'full', limit}, {'replay', id...} as
-- post.lua (a token used by an earlier post of the same call replays that
-- post). A post's reservation goes first thing, whatever its answer.
-- A post is full if the queue's live messages with those of the posts
-- accepted before it in the call and its own exceed _max_messages.
-- The first post in segments sets the queue's F_NEW_START to the first seq
-- it writes (the counter + 1): from there on every message of the queue is
-- in segments, every one before in the older layout.
-- Ordered groups and notifications as post.lua (one notification a call).
-- Redis runs all of this once a call (docs/design-compact-storage.md,
-- "What a post and a page cost, as built"): one HMGET of the queue hash,
-- the counter, then per segment touched one APPEND, one PEXPIREAT, one
-- SETRANGE; the older layout's clean-up only while it may still hold
-- messages (F_LEGACY_GONE unset: Q:exp never gains a member once the queue
-- writes segments, so once it is empty it stays so; expired claims are
-- trimmed by the claim and pop scripts, which run collect_garbage on every
-- call).
local now = tonumber(ARGV[1])
local FIXED, PER_SPECIAL = 12, 5
local posts, grouped, specials = tonumber(ARGV[5]), tonumber(ARGV[11]), tonumber(ARGV[12])
-- where the posts out of the common, the groups and the records begin
local special_at = FIXED + posts
local groups_at = special_at + specials * PER_SPECIAL
local records_at = groups_at + 2 * grouped
local q = redis.call('HMGET', KEYS[K_META], F_NEW_START, F_ENCRYPTED, F_DEFAULT_TTL,
  F_DEFAULT_DELAY, F_MAX_POST_SIZE, F_MAX_MESSAGES, F_GROUPS_SINCE, F_CREATED, F_REVIEW_FROM,
  F_LEGACY_GONE)
local ns = q[1]
if not ns and ARGV[4] ~= '1' then return {'records'} end
if ARGV[6] ~= '-' and ((q[3] or '') ~= ARGV[6] or (q[4] or '') ~= ARGV[7]) then
  return {'defaults', q[3] or '', q[4] or ''}
end
local groups_since, legacy_gone = q[7], q[10]
local max_size, max_messages = tonumber(q[5]), tonumber(q[6])
-- what the first post to get this far does for the call, once
local prepared, reviewed, reviews_ran, tidied = false, false, false, false
local live, unswept = nil, false
-- the reply (its first element: the review, set last); the accepted posts,
-- five entries each: answer index, first message's ARGV, messages, token,
-- seq offset; by token (made when a post has one) the accepted post's
-- entry, and the posts that replay one: answer index, that entry
local answers, accepted, added, known, replays = {0, false}, {}, 0, nil, nil
local special = nil
if specials > 0 then
  special = {}
  for i = special_at + 1, groups_at, PER_SPECIAL do special[tonumber(ARGV[i])] = i end
end
local a = records_at + 1
for p = 1, posts do
  local token, n, sealed, held = '', 1, '0', ''
  local own = special and special[p]
  if own then
    token, n, sealed, held = ARGV[own + 2], tonumber(ARGV[own + 1]), ARGV[own + 3], ARGV[own + 4]
  end
  local first_arg = a
  a = a + n
  if held ~= '' then redis.call('ZREM', KEYS[7], held) end
  local answer = nil
  if sealed ~= '1' and q[2] == '1' then
    answer = {'seal'}
  elseif token ~= '' then
    if known and known[token] then
      replays = replays or {}
      replays[#replays + 1] = p + 1
      replays[#replays + 1] = known[token]
      answer = true
    else
      answer = replayed(token, now, not tidied)
      tidied = tidied or not answer
    end
  end
  if not answer then
    if not prepared then
      prepared = true
      if not q[8] then redis.call('HSET', KEYS[K_META], F_CREATED, ARGV[1]) end
      -- the older layout's messages and claims, while it may have any
      if not legacy_gone then
        collect_garbage(ARGV[1], groups_since)
        if redis.call('EXISTS', KEYS[K_EXP]) == 0 then legacy_gone = '1' end
      end
    end
    if max_size and tonumber(ARGV[FIXED + p]) > max_size then
      answer = {'toolarge', q[5]}
    else
      if not reviewed then
        -- one due review of the queue's segments first (storage/reviews.py)
        reviewed = true
        reviews_ran = ns and review_due(now, 1) > 0
      end
      if max_messages then
        -- counted as posted less gone; near the limit, less the expired not yet swept too
        if not live then live = live_count(ARGV[1], KEYS[K_EXP], KEYS[K_META], KEYS[K_SEQ]) end
        if ns and not unswept and live + added + n > max_messages then
          unswept = true
          live = live - expired_unswept(now)
        end
        if live + added + n > max_messages then answer = {'full', q[6]} end
      end
    end
  end
  if answer then
    answers[p + 1] = answer
  else
    answers[p + 1] = true
    local at = #accepted + 1
    if at == 1 then
      -- made whole (a lone post's only entry: no table grown step by step)
      accepted = {p + 1, first_arg, n, token, added}
    else
      accepted[at], accepted[at + 1], accepted[at + 2] = p + 1, first_arg, n
      accepted[at + 3], accepted[at + 4] = token, added
    end
    added = added + n
    -- a later post of the call with the same token replays this one
    if token ~= '' then
      known = known or {}
      known[token] = at
    end
  end
end
if added == 0 then return answers end
local n = added

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
-- the open segment's earliest expiry, and the earliest review this call set
local review_from, review = tonumber(q[9]), nil
if reviews_ran then review_from = tonumber(redis.call('HGET', KEYS[K_META], F_REVIEW_FROM)) end

-- A call's records for one segment: one APPEND, one SETRANGE of their
-- (consecutive) slots, the segment's expiry raised to the call's latest.
local k, first_slot, records, offsets, pending = nil, 0, {}, {}, 0
local earliest, latest = tonumber(ARGV[8]), tonumber(ARGV[9])
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
  records, offsets, pending = {}, {}, 0
end

local tag, format = ARGV[3], string.format
-- the grouped messages' groups, by their place among the call's messages
local groups = nil
if grouped > 0 then
  groups = {}
  for i = groups_at + 1, records_at, 2 do groups[tonumber(ARGV[i])] = ARGV[i + 1] end
end
local seq = top
-- seqs are consecutive: the segment and slot are split once, then counted
local slot
k, slot = segment_of(top + 1)
first_slot = slot
for j = 1, #accepted, 5 do
  for m = accepted[j + 1], accepted[j + 1] + accepted[j + 2] - 1 do
    seq = seq + 1
    if slot == SEG_SLOTS then
      flush()
      k, slot = int(tonumber(k) + 1), 0
      first_slot = 0
    end
    slot = slot + 1
    local written = ARGV[m]
    offsets[#offsets + 1] = pending
    records[#records + 1] = written
    pending = pending + #written
    if groups_since or groups then
      local group = groups and groups[m - records_at] or ''
      groups_since = index_for_claims(seq, group, groups_since, nil, tag)
    end
  end
end
flush()
notify(seq, tonumber(ARGV[10]))
for j = 1, #accepted, 5 do
  local first, token = top + accepted[j + 4] + 1, accepted[j + 3]
  answers[accepted[j]] = first
  if token ~= '' then
    local ids = {}
    for i = 1, accepted[j + 2] do ids[i] = tag .. format(SEG_SEQ_FORMAT, first + i - 1) end
    remember_post(token, now + tonumber(ARGV[2]), ids)
    -- the answer of a post that replays this one
    accepted[j + 3] = {'replay', unpack(ids)}
  end
end
if replays then
  for j = 1, #replays, 2 do answers[replays[j]] = accepted[replays[j + 1] + 3] end
end
-- a number, not int()'s text: 0 (none) must read as 0
answers[1] = review or 0
return answers
