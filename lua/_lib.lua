-- Shared by every feedsvc script (prepended by feedsvc/storage/scripts.py, the
-- functions a script uses only). The generated names (F_* the record's
-- fields, S_* the key suffixes, H_* the message header's positions, SEG_*
-- the segment layout's) and every local in capitals set to literals here
-- are constants: scripts.py writes their values in where a script names them.
-- KEYS[1..6] are always the queue's fixed keys, in the order of
-- QueueKeys.fixed(): meta, seq, idx, exp, claimed, claims. Per-message and
-- per-claim keys live under the same hash tag: prefix .. S_MESSAGE .. id.
local K_META, K_SEQ, K_IDX, K_EXP, K_CLAIMED, K_CLAIMS = 1, 2, 3, 4, 5, 6

-- (a block each: a script gets those it names, and a string built costs
-- every call, scripts.py)
local PREFIX = string.sub(KEYS[K_META], 1, -1 - #S_META)

local GC_BATCH = 100

local IDEMPOTENCY = PREFIX .. S_IDEMPOTENCY

-- Numbers handed to redis.call must be formatted by hand: Lua's own
-- conversion would print a 16-digit seq in exponent notation.
local function int(x)
  return string.format('%d', x)
end

-- A message's record (record.py), and where the release before kept it.
local RECORD_PREFIX = PREFIX .. S_RECORD
local LEGACY_PREFIX = PREFIX .. S_MESSAGE

local function record_key(id)
  return RECORD_PREFIX .. id
end

local function legacy_key(id)
  return LEGACY_PREFIX .. id
end

local function claim_key(id)
  return PREFIX .. S_CLAIM .. id
end

-- Ordered groups (record.py, keys.py): the claim index (ungrouped ids and
-- one GROUP_ENTRY .. group entry per group with messages, scored by seq)
-- and each group's zset of ids, under GROUP_PREFIX .. group.
local CLAIM_INDEX = PREFIX .. S_CLAIM_INDEX
local GROUP_PREFIX = PREFIX .. S_GROUP
-- a group on an author line (record.py's author_line): after H_GROUP_MARK
local GROUP_PATTERN = '^[^ \n]*' .. H_GROUP_MARK .. '([^ \n]+)'

-- A claimed message's new expiry (ms) and ttl (s): it lives at least until
-- the claim expires plus grace, never shorter than it would have
-- (record.claim_extension in Python is the same rule).
local function extend_for_claim(expires, created, claim_expires, grace)
  local keep = math.max(expires, claim_expires + grace * 1000)
  return keep, math.floor((keep - created) / 1000 + 0.5)
end

-- A message record: its header, fixed-width fields laid out by record.py's
-- HEADER_FIELDS (the generated H_* positions and HEADER_FORMAT), zero-padded
-- numbers so that two of one width compare as strings, the claim id padded
-- with spaces (all spaces: none), seq 0 until the message is indexed; then
-- the author, a newline, the body.
local sub, byte, find = string.sub, string.byte, string.find
local NEWLINE = '\n'

-- The fixed-width part of m's header (what a write rewrites: SETRANGE 0).
local function header(m)
  return string.format(HEADER_FORMAT, m.seq, m.ttl, m.created, m.expires, m.due,
    m.claim_expires, m.count, m.claim)
end

local function record(m)
  return header(m) .. m.author .. NEWLINE .. m.body
end

-- A time (ms) as the header writes it, to compare with its fields as strings.
local function ms_text(ms)
  return string.format(H_MS_FORMAT, ms)
end

-- A legacy message (a hash, see record.py) as a record (nil: gone).
local function legacy_record(id)
  local o = redis.call('HMGET', LEGACY_PREFIX .. id, F_BODY, F_TTL, F_CREATED, F_EXPIRES, F_SEQ,
    F_DUE, F_CLAIM_EXPIRES, F_CLAIM_COUNT, F_CLAIM, F_AUTHOR)
  if not o[1] or not o[4] then return nil end
  return string.format(HEADER_FORMAT, tonumber(o[5]) or 0, tonumber(o[2]) or 0,
    tonumber(o[3]) or 0, tonumber(o[4]), tonumber(o[6]) or 0, tonumber(o[7]) or 0,
    tonumber(o[8]) or 0, o[9] or '') .. (o[10] or '') .. NEWLINE .. o[1]
end

-- A message as a table (nil: gone) from its record r, or else (r is false)
-- its legacy hash.
local function parse_message(id, r)
  local legacy = nil
  if not r then
    r = legacy_record(id)
    if not r then return nil end
    legacy = true
  end
  local author_end = find(r, NEWLINE, H_AUTHOR, true)
  return {seq = tonumber(sub(r, H_SEQ, H_SEQ_END)), ttl = tonumber(sub(r, H_TTL, H_TTL_END)),
    created = tonumber(sub(r, H_CREATED, H_CREATED_END)),
    expires = tonumber(sub(r, H_EXPIRES, H_EXPIRES_END)), due = tonumber(sub(r, H_DUE, H_DUE_END)),
    claim_expires = tonumber(sub(r, H_CLAIM_EXPIRES, H_CLAIM_EXPIRES_END)),
    count = tonumber(sub(r, H_COUNT, H_COUNT_END)),
    claim = string.match(sub(r, H_CLAIM, H_CLAIM_END), '^(%S*)'),
    author = sub(r, H_AUTHOR, author_end - 1), body = sub(r, author_end + 1), legacy = legacy}
end

-- The segment layout (storage/segments.py): the queue's segments (a string
-- each, SEGMENT_PREFIX .. k), their directory (zset k -> k) and the claim
-- states of their messages (hash seq -> state).
local SEGMENT_PREFIX = PREFIX .. S_SEGMENT
local DIRECTORY = PREFIX .. S_DIRECTORY
local CLAIM_STATES = PREFIX .. S_CLAIM_STATES

-- A seq's segment number (as text: the key's suffix) and slot, split as
-- text: a 16-digit seq / 100 is not exact in a double.
local function segment_of(seq)
  local s = int(seq)
  if #s <= 2 then return '0', tonumber(s) end
  return string.sub(s, 1, -3), tonumber(string.sub(s, -2))
end

-- A slot's value (a record's offset; 0 = none) at slot j (from 0) of a
-- slot table read from its start t, and whether the message is gone (its
-- record stays until the segment's review: its offset still ends the one
-- before).
local function slot_at(t, j)
  local v = struct.unpack('>I4', t, j * SEG_SLOT_BYTES + 1)
  if v >= SEG_GONE_BIT then return v - SEG_GONE_BIT, true end
  return v, false
end

-- A segment message's id (segments.py's message_id): the feed's tag (the
-- first digits of the SHA1 of its key prefix, so an id names a message of
-- this feed only; made once a call), then its seq in hex. segment_seq is
-- the other way: the seq an id names here (nil: none of this feed's
-- segment ids).
local seg_tag = nil
local function segment_tag()
  if not seg_tag then seg_tag = string.sub(redis.sha1hex(PREFIX), 1, SEG_ID_TAG_DIGITS) end
  return seg_tag
end
local function segment_id(seq)
  return segment_tag() .. string.format(SEG_SEQ_FORMAT, seq)
end
local function segment_seq(id)
  if #id ~= SEG_ID_DIGITS or string.sub(id, 1, SEG_ID_TAG_DIGITS) ~= segment_tag() then
    return nil
  end
  return tonumber(string.sub(id, SEG_ID_TAG_DIGITS + 1), 16)
end

-- Segment messages by id (storage/segments.py): a segment id names its
-- seq; the message is read from its slot, its record and its claim state
-- (Q:cl), only if the seq is the queue's F_NEW_START or later. Rule: an id
-- is looked up in the older layout first while that has messages (Q:idx).
-- The queue's F_NEW_START and whether Q:idx exists, read once a call.
local seg_layout = nil

local function segment_layout()
  if not seg_layout then
    seg_layout = {ns = tonumber(redis.call('HGET', KEYS[K_META], F_NEW_START)),
      legacy = redis.call('EXISTS', KEYS[K_IDX]) == 1}
  end
  return seg_layout
end

-- The seq a segment id of this queue names (nil: not one, or below the
-- queue's segments).
local function segment_message_seq(id)
  local seq = segment_seq(id)
  local ns = segment_layout().ns
  if not seq or not ns or seq < ns or segment_id(seq) ~= id then return nil end
  return seq
end

-- A segment message as a table (read_message's fields; author is its author
-- line's tail only: '-', then its extras) from its record r and its claim
-- state (nil: none). A state without a claim whose claim expiry is set was
-- released with a delay: the message is due then (segments.ClaimState).
local function segment_record(seq, r, state)
  local expires = tonumber(sub(r, 1, SEG_EXPIRES_END))
  local ttl = tonumber(sub(r, SEG_DUE_END + 1, SEG_AUTHOR_AT - 1))
  local n = struct.unpack(SEG_EXTRAS_LENGTH_FORMAT, r, SEG_EXTRAS_LENGTH_AT)
  local extras = sub(r, SEG_EXTRAS_AT, SEG_EXTRAS_AT + n - 1)
  local m = {seq = seq, ttl = ttl, created = expires - ttl * 1000, expires = expires,
    posted_expires = expires, due = tonumber(sub(r, SEG_EXPIRES_END + 1, SEG_DUE_END)),
    claim_expires = 0, count = 0, claim = '', extras = extras,
    author = (n > 0) and ('- ' .. extras) or '-', body = sub(r, SEG_EXTRAS_AT + n), segment = true,
    author_bytes = sub(r, SEG_AUTHOR_AT, SEG_EXTRAS_LENGTH_AT - 1)}
  if state then
    local claim, claim_expires, count, extended = string.match(state, '^(%S+) (%d+) (%d+) (%d+)$')
    m.claim_expires, m.count = tonumber(claim_expires), tonumber(count)
    if claim == '-' then
      if m.claim_expires > m.due then m.due = m.claim_expires end
      m.claim_expires = 0
    else
      m.claim = claim
    end
    extended = tonumber(extended)
    if extended > expires then
      m.expires = extended
      m.ttl = math.floor((extended - m.created) / 1000 + 0.5)
    end
  end
  return m
end

-- The records of the first n slots of a slot table t read from segment
-- key (from some slot on): {slot index in t (from 0), record} of each
-- present one, in slot order; one GETRANGE.
local function segment_records(key, t, n)
  local next_at = nil  -- where the record after the n slots starts (nil: the string's end)
  for j = n, #t / SEG_SLOT_BYTES - 1 do
    local at = slot_at(t, j)
    if at > 0 then
      next_at = at
      break
    end
  end
  local spans = {}  -- {slot, offset, where it ends (nil: the string's end)}, last first
  for j = n - 1, 0, -1 do
    local at, gone = slot_at(t, j)
    if at > 0 then
      if not gone then spans[#spans + 1] = {j, at, next_at} end
      next_at = at
    end
  end
  local found = {}
  if #spans == 0 then return found end
  local base, stop = spans[#spans][2], spans[1][3]
  local data = redis.call('GETRANGE', key, base, stop and stop - 1 or -1)
  for i = #spans, 1, -1 do
    local span = spans[i]
    local last = span[3] and span[3] - base or #data
    found[#found + 1] = {span[1], sub(data, span[2] - base + 1, last)}
  end
  return found
end

-- The segment message of this id as a table (nil: gone, or not one).
local function segment_message(id)
  local seq = segment_message_seq(id)
  if not seq then return nil end
  local k, slot = segment_of(seq)
  local key = SEGMENT_PREFIX .. k
  local t = redis.call('GETRANGE', key, slot * SEG_SLOT_BYTES, SEG_TABLE_BYTES - 1)
  if #t == 0 then return nil end
  local found = segment_records(key, t, 1)
  if #found == 0 then return nil end
  return segment_record(seq, found[1][2], redis.call('HGET', CLAIM_STATES, int(seq)))
end

-- A message as a table (nil: gone), in either layout (see record.py), or in
-- the queue's segments.
local function read_message(id)
  if segment_message_seq(id) and not segment_layout().legacy then return segment_message(id) end
  return parse_message(id, redis.call('GET', record_key(id))) or segment_message(id)
end

-- A segment message's author line (record.py's author_line): its author's
-- client id as text (from its 16 bytes, segments.author_text), its extras.
local function segment_author_line(m)
  local h = string.gsub(m.author_bytes, '.', function(c) return string.format('%02x', byte(c)) end)
  local line = sub(h, 1, 8) .. '-' .. sub(h, 9, 12) .. '-' .. sub(h, 13, 16) .. '-'
    .. sub(h, 17, 20) .. '-' .. sub(h, 21, 32)
  if m.extras ~= '' then line = line .. ' ' .. m.extras end
  return line
end

-- Store a segment message's claim state (m: a read_message table): its
-- claim, count, and its expiry if a claim extended it, which its segment
-- then lives until too (a segment lives as long as its longest-lived message).
-- states: nil to write at once, or a table gathering the writes for
-- write_states (one HSET, one PEXPIREAT per segment for a whole claim).
local function write_state(m, states)
  local extended = 0
  local k = segment_of(m.seq)
  if m.expires > m.posted_expires then extended = m.expires end
  local claim = m.claim ~= '' and m.claim or '-'
  local value = claim .. ' ' .. int(m.claim_expires) .. ' ' .. int(m.count) .. ' ' .. int(extended)
  if states then
    states.fields[#states.fields + 1] = int(m.seq)
    states.fields[#states.fields + 1] = value
    if extended > (states.longest[k] or 0) then states.longest[k] = extended end
    return
  end
  if extended > 0 then redis.call('PEXPIREAT', SEGMENT_PREFIX .. k, int(extended), 'GT') end
  redis.call('HSET', CLAIM_STATES, int(m.seq), value)
end

-- The writes write_state gathered in states.
local function write_states(states)
  if #states.fields > 0 then redis.call('HSET', CLAIM_STATES, unpack(states.fields)) end
  for k, extended in pairs(states.longest) do
    redis.call('PEXPIREAT', SEGMENT_PREFIX .. k, int(extended), 'GT')
  end
end

-- Store m's header; a legacy message moves to its record, atomically; a
-- segment message's claim state.
local function write_header(id, m, states)
  if m.segment then
    write_state(m, states)
  elseif m.legacy then
    redis.call('SET', record_key(id), record(m))
    redis.call('PEXPIREAT', record_key(id), int(m.expires))
    redis.call('DEL', legacy_key(id))
    m.legacy = nil
  else
    redis.call('SETRANGE', record_key(id), 0, header(m))
  end
end

-- When a message (a read_message table) not free now becomes free by itself
-- (it falls due, its claim expires), if it is still alive then; nil: never,
-- or it is free already. record.py's Row.free_at is the same rule.
local function free_at(m, now)
  if not m or m.seq == 0 or m.expires <= now then return nil end
  local at = m.due
  if m.claim ~= '' and m.claim_expires > at then at = m.claim_expires end
  if at > now and at < m.expires then return at end
  return nil
end

-- Whether a message (a read_message table) can be claimed or popped: it must
-- exist, be indexed, alive and due, and be held by no live claim.
local function is_free(m, now)
  return m and m.seq > 0 and m.expires > now and m.due <= now
    and not (m.claim ~= '' and m.claim_expires > now)
end

-- May the caller take message id, whose body is body? A sealed body (it
-- starts with sealed, sealing.MAGIC) only once the caller has opened it:
-- checked maps an id to the SHA1 of the body the caller opened, or to ''
-- for one it could not open (see LuaStore._opening). 'take', 'skip' (it
-- cannot be opened: leave it where it is) or 'open' (ask the caller first).
local function verdict(checked, sealed, id, body)
  if string.sub(body, 1, #sealed) ~= sealed then return 'take' end
  local seen = checked[id]
  if seen == '' then return 'skip' end
  if seen and seen == redis.sha1hex(body) then return 'take' end
  return 'open'
end

-- verdict for pop and claim, noting in unopened (id, body pairs) a body to
-- ask the caller about; true if the message is to be taken (or would be,
-- once opened), false if it is to be left where it is.
local function may_take(checked, sealed, id, m, unopened)
  local v = verdict(checked, sealed, id, m.body)
  if v == 'open' then
    unopened[#unopened + 1] = id
    unopened[#unopened + 1] = m.body
  end
  return v ~= 'skip'
end

-- The verdicts a caller sends: ARGV pairs (id, SHA1 or '') from first on.
local function verdicts(first)
  local checked = {}
  for i = first, #ARGV, 2 do checked[ARGV[i]] = ARGV[i + 1] end
  return checked
end

-- Tell the queue's followers (every feedsvc process subscribed to the queue's
-- shard channel) that messages up to seq were indexed; due is the earliest
-- time (ms) one of them, posted with a delay, becomes visible (0: none).
-- record.py's Notification reads the same format.
local function notify(seq, due)
  redis.call('SPUBLISH', PREFIX .. S_FEED, int(seq) .. ' ' .. int(due))
end

-- Tell the queue's followers that the queue was deleted.
local function notify_end()
  redis.call('SPUBLISH', PREFIX .. S_FEED, 'end')
end

-- Remove one message and its index entries.
local function forget(id)
  redis.call('DEL', record_key(id), legacy_key(id))
  redis.call('ZREM', KEYS[K_IDX], id)
  redis.call('ZREM', KEYS[K_EXP], id)
  redis.call('ZREM', KEYS[K_CLAIMED], id)
end

-- The group of the message stored under id ('' = none, or gone), read from
-- the start of its author line only (a legacy message has none).
local function stored_group(id)
  local line = redis.call('GETRANGE', record_key(id), H_AUTHOR - 1, H_AUTHOR + 299)
  return string.match(line, GROUP_PATTERN) or ''
end

-- Make group's claim index entry follow its zset: scored by the seq of its
-- first id, or removed once the group has no message left.
-- Returns its first id (nil: none).
local function settle_group(group)
  local first = redis.call('ZRANGE', GROUP_PREFIX .. group, 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('ZREM', CLAIM_INDEX, GROUP_ENTRY .. group)
    return nil
  end
  redis.call('ZADD', CLAIM_INDEX, 'XX', first[2], GROUP_ENTRY .. group)
  return first[1]
end

-- Index a posted message for claims (docs/consumers.md): a grouped one in
-- its group's zset (and its group's entry in the claim index, if the group
-- had none), an ungrouped one in the claim index itself once the queue has
-- had a grouped message (groups_since: its F_GROUPS_SINCE, nil = none; the
-- first grouped message sets it to its seq). id: the message's id, or nil
-- in segments: made from tag (segments.id_tag) only when it is needed.
-- Returns groups_since as it is now.
local function index_for_claims(seq, group, groups_since, id, tag)
  if group == '' and not groups_since then return nil end
  id = id or tag .. string.format(SEG_SEQ_FORMAT, seq)
  if group == '' then
    redis.call('ZADD', CLAIM_INDEX, int(seq), id)
    return groups_since
  end
  if not groups_since then
    groups_since = int(seq)
    redis.call('HSET', KEYS[K_META], F_GROUPS_SINCE, groups_since)
  end
  redis.call('ZADD', GROUP_PREFIX .. group, int(seq), id)
  redis.call('ZADD', CLAIM_INDEX, 'NX', int(seq), GROUP_ENTRY .. group)
  return groups_since
end

-- Whether a message (a read_message table) is live: indexed and not expired.
local function is_live(m, now)
  return m and m.seq > 0 and m.expires > now
end

-- Drop the ids at the front of a group whose messages are gone or expired
-- (up to 5 looked at), and settle its entry if it changed: expiry cannot
-- tell which group an expired id was in (its record is gone), so groups
-- are tidied from their fronts, by the claims that walk them and here. It
-- reads a message's header only (a grouped message is never legacy).
local function tidy_group(group, now_text)
  local gkey = GROUP_PREFIX .. group
  local now = ms_text(tonumber(now_text))
  local stale, front = {}, redis.call('ZRANGE', gkey, 0, 4)
  if #front == 0 then settle_group(group) end  -- emptied by a copy's forget
  for _, id in ipairs(front) do
    if segment_message_seq(id) then
      -- a segment message (its slot, its record, its claim state)
      local m = segment_message(id)
      if m and m.expires > tonumber(now_text) then break end
    else
      local h = redis.call('GETRANGE', record_key(id), 0, H_EXPIRES_END - 1)
      if #h == H_EXPIRES_END and tonumber(sub(h, H_SEQ, H_SEQ_END)) > 0
        and sub(h, H_EXPIRES, H_EXPIRES_END) > now then break end
    end
    stale[#stale + 1] = id
  end
  if #stale > 0 then
    redis.call('ZREM', gkey, unpack(stale))
    settle_group(group)
  end
end

-- Walk a queue's segment messages with seqs from low up to below high (nil:
-- to the counter), in order, a batch of slots at a time (first batch
-- slots, then doubling up to a segment): visit(id, seq, m) for each present
-- one (m: its read_message table) and visit(nil) for each slot table read,
-- until a visit answers true. Returns the first seq walked that held a
-- message not gone and not expired (or where the walk stopped): every seq
-- from low up to it is gone for good (deleted, popped, expired); the claim
-- states of those it met go (a message expired keeps no state past the
-- claims' head).
local function walk_segments(now, low, high, batch, visit)
  local top = tonumber(redis.call('GET', KEYS[K_SEQ]))
  local from, head, dead = low, low, true
  if not top then return head end
  if high and high - 1 < top then top = high - 1 end
  local states = redis.call('EXISTS', CLAIM_STATES) == 1
  local stale = {}
  while from <= top do
    local k, slot = segment_of(from)
    local key = SEGMENT_PREFIX .. k
    local t = redis.call('GETRANGE', key, slot * SEG_SLOT_BYTES, SEG_TABLE_BYTES - 1)
    if visit(nil) then break end
    if #t == 0 then
      -- gone whole: on to the next segment there is
      local nxt = redis.call('ZRANGE', DIRECTORY, '(' .. k, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
      if dead and states then
        for j = slot, SEG_SLOTS - 1 do stale[#stale + 1] = int(tonumber(k) * SEG_SLOTS + j) end
      end
      from = nxt and math.max(from, tonumber(nxt) * SEG_SLOTS) or top + 1
      if dead then head = math.min(from, top + 1) end
    else
      local n = math.min(batch, #t / SEG_SLOT_BYTES, top - from + 1)
      local found = segment_records(key, t, n)
      local got = {}
      if states and #found > 0 then
        local seqs = {}
        for i, f in ipairs(found) do seqs[i] = int(from + f[1]) end
        got = redis.call('HMGET', CLAIM_STATES, unpack(seqs))
      end
      local stop = false
      for i, f in ipairs(found) do
        local seq = from + f[1]
        local m = segment_record(seq, f[2], got[i])
        if dead then
          if m.expires > now then dead = false end
          head = dead and seq + 1 or seq
          if dead and got[i] then stale[#stale + 1] = int(seq) end
        end
        if visit(segment_id(seq), seq, m) then
          stop = true
          break
        end
      end
      if stop then break end
      from = from + n
      if dead then head = from end
      batch = math.min(batch * 2, SEG_SLOTS)
    end
  end
  if #stale > 0 then redis.call('HDEL', CLAIM_STATES, unpack(stale)) end
  return head
end

-- Choose the messages a claim or a pop takes, up to limit, in the order
-- they are to be handed out, looking at scan_limit index entries at most.
-- judge(id, seq, m) is asked about each free message (is_free) and answers
-- 'take', 'park' (chosen, not counted towards limit: the claim sets it
-- aside for the dead-letter queue, and it leaves its group) or 'skip' (left
-- where it is). Returns the chosen, each {id, seq, m, parked, group ('' =
-- none)}; the earliest time a message looked at and not free becomes free
-- by itself (nil: none), for a claim wait; and the tidying to do once the
-- chosen are written (tidy_after).
-- A queue without ordered groups (groups_since nil) is scanned in index
-- order. With them, the index below groups_since (its messages from before
-- the first group), then the claim index in order: an ungrouped id as
-- ever; a group from its head, consecutively: its first live message must
-- be free (else the group is blocked: claimed, or not due), and each next
-- one taken only while the ones before it were. So the claimed messages of a
-- group are always a prefix of its live messages, held by one claim, and a
-- group costs the scan one message while blocked, however long its backlog.
-- removing: the chosen leave their groups (a pop), so those are settled after.
local function choose_messages(now, limit, scan_limit, groups_since, judge, removing)
  local chosen, taking, scanned, next_free = {}, 0, 0, nil
  local tidy = {stale = {}, gone = {}, groups = {}}
  local function blocked(m)
    local at = free_at(m, now)
    if at and (not next_free or at < next_free) then next_free = at end
  end
  local function single(id, seq, m)
    scanned = scanned + 1
    if m == nil then m = read_message(id) end
    if not m or (groups_since and m.expires <= now) then
      if groups_since then tidy.gone[#tidy.gone + 1] = id end
    elseif is_free(m, now) then
      local v = judge(id, seq, m)
      if v ~= 'skip' then
        chosen[#chosen + 1] = {id, seq, m, v == 'park', ''}
        if v == 'take' then taking = taking + 1 end
      end
    else
      blocked(m)
    end
  end
  local function group(name)
    local gkey, pos, stale = GROUP_PREFIX .. name, 0, {}
    local settle = removing
    while taking < limit and scanned < scan_limit do
      local ids = redis.call('ZRANGE', gkey, pos, pos + limit - taking, 'WITHSCORES')
      if #ids == 0 then
        if pos == #stale then settle = true end  -- nothing live: the group is empty
        break
      end
      pos = pos + #ids / 2
      local stop = false
      for j = 1, #ids, 2 do
        local id, seq = ids[j], ids[j + 1]
        scanned = scanned + 1
        local m = read_message(id)
        if not is_live(m, now) then
          stale[#stale + 1] = id
        elseif not is_free(m, now) then
          blocked(m)
          stop = true
        else
          local v = judge(id, seq, m)
          if v == 'skip' then
            stop = true
          else
            chosen[#chosen + 1] = {id, seq, m, v == 'park', name}
            if v == 'park' then settle = true else taking = taking + 1 end
            stop = taking >= limit
          end
        end
        if stop then break end
      end
      if stop then break end
    end
    if #stale > 0 then
      tidy.stale[name] = stale
      settle = true
    end
    if settle then tidy.groups[name] = true end
  end
  local function scan(key, low, high)
    local offset = 0
    while taking < limit and scanned < scan_limit do
      local entries = redis.call('ZRANGE', key, low, high, 'BYSCORE', 'LIMIT', offset, 100,
        'WITHSCORES')
      if #entries == 0 then break end
      offset = offset + #entries / 2
      for j = 1, #entries, 2 do
        local entry = entries[j]
        if sub(entry, 1, #GROUP_ENTRY) == GROUP_ENTRY then
          group(sub(entry, #GROUP_ENTRY + 1))
        else
          single(entry, entries[j + 1])
        end
        if taking >= limit or scanned >= scan_limit then break end
      end
    end
  end
  -- the segments' messages not in the claim index, from the first that may be live
  local function segments(high)
    local layout = segment_layout()
    if not layout.ns or (high and high <= layout.ns) then return end
    if taking >= limit or scanned >= scan_limit then return end
    local low = math.max(layout.ns, tonumber(redis.call('HGET', KEYS[K_META], F_CLAIM_HEAD)) or 0)
    local head = walk_segments(now, low, high, limit + 1, function(id, seq, m)
      if id == nil then
        scanned = scanned + 1
      else
        single(id, seq, m)
      end
      return taking >= limit or scanned >= scan_limit
    end)
    if head > low then tidy.head = head end
  end
  if groups_since then
    scan(KEYS[K_IDX], '-inf', '(' .. groups_since)
    segments(tonumber(groups_since))
    scan(CLAIM_INDEX, '-inf', '+inf')
  else
    scan(KEYS[K_IDX], '-inf', '+inf')
    segments(nil)
  end
  return chosen, next_free, tidy
end

-- The tidying choose_messages asked for, once the chosen are written: ids
-- of gone messages out of the claim index and the groups, groups settled.
local function tidy_after(tidy)
  if tidy.head then redis.call('HSET', KEYS[K_META], F_CLAIM_HEAD, int(tidy.head)) end
  if #tidy.gone > 0 then redis.call('ZREM', CLAIM_INDEX, unpack(tidy.gone)) end
  for name, ids in pairs(tidy.stale) do redis.call('ZREM', GROUP_PREFIX .. name, unpack(ids)) end
  for name in pairs(tidy.groups) do settle_group(name) end
end

-- Forget up to GC_BATCH messages whose ttl has passed, and expired claims.
-- Redis drops the message hashes by itself (PEXPIREAT); this drops their
-- index entries so that nothing outlives its message. In a queue with
-- ordered groups (groups_since: its F_GROUPS_SINCE, nil = none) the claim
-- index's too, and the first two groups of the claim index are tidied.
local function collect_garbage(now_text, groups_since)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[K_EXP], "-inf", now_text, "LIMIT", 0, GC_BATCH)
  if #dead > 0 then
    local mkeys = {}
    for _, id in ipairs(dead) do
      mkeys[#mkeys + 1] = record_key(id)
      mkeys[#mkeys + 1] = legacy_key(id)
    end
    redis.call('DEL', unpack(mkeys))
    redis.call('ZREM', KEYS[K_IDX], unpack(dead))
    redis.call('ZREM', KEYS[K_EXP], unpack(dead))
    redis.call('ZREM', KEYS[K_CLAIMED], unpack(dead))
    if groups_since then redis.call('ZREM', CLAIM_INDEX, unpack(dead)) end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[K_CLAIMED], "-inf", now_text)
  redis.call('ZREMRANGEBYSCORE', KEYS[K_CLAIMS], "-inf", now_text)
  if groups_since then
    for _, entry in ipairs(redis.call('ZRANGE', CLAIM_INDEX, 0, 1)) do
      if sub(entry, 1, #GROUP_ENTRY) == GROUP_ENTRY then
        tidy_group(sub(entry, #GROUP_ENTRY + 1), now_text)
      end
    end
  end
end

-- How many live messages a feed holds (its Q:exp, Q:q and Q:seq keys), for
-- _max_messages and the project quotas (segments.py's live_count is the
-- same count): the older layout's from its expiry index, the segments' as
-- posted less those gone (F_GONE; until the sweep has counted them, expired
-- ones still count: a post may be refused early, a quota never overflows).
local function live_count(now_text, exp_key, meta_key, seq_key)
  local live = redis.call('ZCOUNT', exp_key, '(' .. now_text, '+inf')
  local q = redis.call('HMGET', meta_key, F_NEW_START, F_GONE)
  if q[1] then
    local top = tonumber(redis.call('GET', seq_key)) or 0
    live = live + math.max(0, top - tonumber(q[1]) + 1 - (tonumber(q[2]) or 0))
  end
  return live
end

-- An idempotent post's first answer, if its token ('' = none) was used
-- within its window: {'replay', id...}; nil: post it. With tidy, forgets a
-- few expired tokens on the way (when nil), so the hash stays bounded: a
-- call of several posts does it once.
local function replayed(token, now, tidy)
  if token == '' then return nil end
  local seen = redis.call('HGET', IDEMPOTENCY, token)
  if seen then
    local expires, ids = string.match(seen, '^(%d+) (.*)$')
    if tonumber(expires) > now then
      local out = {'replay'}
      for id in string.gmatch(ids, '%S+') do out[#out + 1] = id end
      return out
    end
  end
  if not tidy then return nil end
  local sample = redis.call('HRANDFIELD', IDEMPOTENCY, 5, 'WITHVALUES')
  for j = 1, #sample, 2 do
    if tonumber(string.match(sample[j + 1], '^(%d+)')) <= now then
      redis.call('HDEL', IDEMPOTENCY, sample[j])
    end
  end
  return nil
end

-- Remember an idempotent post's ids under its token until (ms).
local function remember_post(token, longestms, ids)
  redis.call('HSET', IDEMPOTENCY, token, int(longestms) .. ' ' .. table.concat(ids, ' '))
end

-- Reviews of segments (storage/reviews.py): when the sweep looks at each
-- segment next (zset k -> ms) and its messages not yet counted gone (hash
-- k -> that count less the seqs of its range given out so far).
local REVIEWS = PREFIX .. S_REVIEWS
local SEGMENT_COUNTS = PREFIX .. S_SEGMENT_COUNTS

-- Segment k's messages not yet counted gone (top: the counter).
local function segment_count(k, top)
  local sn = redis.call('HGET', SEGMENT_COUNTS, k)
  if not sn then return 0 end
  local passed = math.min(SEG_SLOTS, top - tonumber(k) * SEG_SLOTS + 1)
  return tonumber(sn) + math.max(0, passed)
end

-- What segment k holds at now: its string (nil: gone whole), its records'
-- {slot, offset, end} by slot (records at[j], live ones' slots in keep),
-- the seqs of the records to drop (expired), whether any record is to go
-- (expired or deleted), the survivors' earliest and latest expiry (a claim
-- may have extended one: its Q:cl state's last field).
local function survey_segment(k, now)
  local key = SEGMENT_PREFIX .. k
  local s = {data = redis.call('GET', key), at = {}, keep = {}, dead = {}, drop = false,
    earliest = nil, latest = 0}
  if not s.data then return s end
  local base = tonumber(k) * SEG_SLOTS
  local ends, slots, seqs = #s.data, {}, {}
  for j = SEG_SLOTS - 1, 0, -1 do
    local v, gone = slot_at(s.data, j)
    if v > 0 then
      s.at[j] = {v, ends}
      ends = v
      if gone then s.drop = true else slots[#slots + 1] = j end
    end
  end
  for i = 1, #slots do seqs[i] = int(base + slots[i]) end
  local states = {}
  if #seqs > 0 and redis.call('EXISTS', CLAIM_STATES) == 1 then
    states = redis.call('HMGET', CLAIM_STATES, unpack(seqs))
  end
  for i = #slots, 1, -1 do
    local j, v = slots[i], s.at[slots[i]][1]
    local expires = tonumber(string.sub(s.data, v + 1, v + SEG_EXPIRES_END))
    if states[i] then
      local extended = tonumber(string.match(states[i], '(%d+)$'))
      if extended > expires then expires = extended end
    end
    if expires > now then
      s.keep[#s.keep + 1] = j
      if not s.earliest or expires < s.earliest then s.earliest = expires end
      if expires > s.latest then s.latest = expires end
    else
      s.dead[#s.dead + 1] = seqs[i]
      s.drop = true
    end
  end
  return s
end

-- The next review of a segment whose live records expire from earliest to
-- latest: at the latest if they spread over at most SEG_SPREAD_MS (Redis
-- drops the segment then), else at the earliest + SEG_REVIEW_AFTER_MS.
local function review_time(earliest, latest)
  if latest - earliest <= SEG_SPREAD_MS then return latest end
  return earliest + SEG_REVIEW_AFTER_MS
end

-- A zset or hash of the segments (one entry per segment) that grew past
-- Redis's listpack size stays a hash table when it shrinks, its table sized
-- for its peak until rehashed: written anew once small, it is a listpack
-- again and a drained queue gives that memory back too.
local function compact_index(key)
  local encoding = redis.call('OBJECT', 'ENCODING', key)
  if encoding == 'skiplist' and redis.call('ZCARD', key) <= 64 then
    local all, again = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES'), {}
    for i = 1, #all, 2 do
      again[i], again[i + 1] = all[i + 1], all[i]
    end
    redis.call('DEL', key)
    if #again > 0 then redis.call('ZADD', key, unpack(again)) end
  elseif encoding == 'hashtable' and redis.call('HLEN', key) <= 64 then
    local all = redis.call('HGETALL', key)
    redis.call('DEL', key)
    if #all > 0 then redis.call('HSET', key, unpack(all)) end
  end
end

-- Review segment k (storage/reviews.py): drop its expired and deleted
-- records (slots kept), count what went, set its expiry and next review.
local function review_segment(k, now, top)
  local key = SEGMENT_PREFIX .. k
  local count = segment_count(k, top)
  local s = survey_segment(k, now)
  local open = segment_of(top) == k
  if count > #s.keep then redis.call('HINCRBY', KEYS[K_META], F_GONE, count - #s.keep) end
  if #s.dead > 0 then
    local ids = {}
    for i, seq in ipairs(s.dead) do ids[i] = segment_id(tonumber(seq)) end
    if redis.call('EXISTS', CLAIM_STATES) == 1 then redis.call('HDEL', CLAIM_STATES, unpack(s.dead)) end
    redis.call('ZREM', KEYS[K_CLAIMED], unpack(ids))
    if redis.call('EXISTS', CLAIM_INDEX) == 1 then redis.call('ZREM', CLAIM_INDEX, unpack(ids)) end
  end
  if #s.keep == 0 then
    if s.data then redis.call('DEL', key) end
    redis.call('ZREM', DIRECTORY, k)
    redis.call('ZREM', REVIEWS, k)
    redis.call('HDEL', SEGMENT_COUNTS, k)
    if open then redis.call('HDEL', KEYS[K_META], F_REVIEW_FROM) end
    compact_index(DIRECTORY)
    compact_index(REVIEWS)
    compact_index(SEGMENT_COUNTS)
    return
  end
  local passed = math.min(SEG_SLOTS, top - tonumber(k) * SEG_SLOTS + 1)
  redis.call('HSET', SEGMENT_COUNTS, k, int(#s.keep - passed))
  if s.drop and s.latest > now + SEG_REVIEW_AFTER_MS then
    -- rewritten with the survivors only, each in its own slot
    local table_, records, at = {}, {}, SEG_TABLE_BYTES
    local kept = {}
    for _, j in ipairs(s.keep) do kept[j] = true end
    for j = 0, SEG_SLOTS - 1 do
      local r = s.at[j]
      if kept[j] then
        table_[j + 1] = struct.pack('>I4', at)
        records[#records + 1] = string.sub(s.data, r[1] + 1, r[2])
        at = at + r[2] - r[1]
      else
        table_[j + 1] = '\0\0\0\0'
      end
    end
    redis.call('SET', key, table.concat(table_) .. table.concat(records), 'PXAT', int(s.latest))
  end
  redis.call('ZADD', REVIEWS, int(review_time(s.earliest, s.latest)), k)
  if open then redis.call('HSET', KEYS[K_META], F_REVIEW_FROM, int(s.earliest)) end
end

-- Run up to limit due reviews of the queue (now: ms); how many ran.
local function review_due(now, limit)
  local due = redis.call('ZRANGE', REVIEWS, '-inf', int(now), 'BYSCORE', 'LIMIT', 0, limit)
  if #due == 0 then return 0 end
  local top = tonumber(redis.call('GET', KEYS[K_SEQ])) or 0
  for _, k in ipairs(due) do review_segment(k, now, top) end
  return #due
end

-- The queue's segment messages expired but not yet counted gone (now: ms):
-- each is in a segment whose review is at most SEG_SPREAD_MS ahead
-- (storage/reviews.py); up to SEG_COUNT_SEGMENTS of those are read.
local function expired_unswept(now)
  local soon = redis.call('ZRANGE', REVIEWS, '-inf', int(now + SEG_SPREAD_MS), 'BYSCORE',
    'LIMIT', 0, SEG_COUNT_SEGMENTS)
  if #soon == 0 then return 0 end
  local top, expired = tonumber(redis.call('GET', KEYS[K_SEQ])) or 0, 0
  for _, k in ipairs(soon) do
    expired = expired + math.max(0, segment_count(k, top) - #survey_segment(k, now).keep)
  end
  return expired
end

-- A segment message goes (deleted, popped, dead-lettered; the caller has
-- checked it is one and settled its groups): its slot marked gone (its
-- record stays until the segment's review, within SEG_DELETE_REVIEW_MS),
-- counted gone once, its claim state and claimed entry dropped. Returns the
-- review's time (ms) if this moved it earlier, for the caller's reply (the
-- process notes it in fs:sweep: sweep_schedule.SweepSchedule.note_soon);
-- nil if it was gone already or its segment's review was due sooner.
local function segment_gone(seq, now)
  local k, slot = segment_of(seq)
  local key = SEGMENT_PREFIX .. k
  redis.call('HDEL', CLAIM_STATES, int(seq))
  redis.call('ZREM', KEYS[K_CLAIMED], segment_id(seq))
  local raw = redis.call('GETRANGE', key, slot * SEG_SLOT_BYTES, slot * SEG_SLOT_BYTES + 3)
  if #raw < SEG_SLOT_BYTES then return nil end
  local v, gone = slot_at(raw, 0)
  if v == 0 or gone then return nil end
  redis.call('SETRANGE', key, slot * SEG_SLOT_BYTES, struct.pack('>I4', v + SEG_GONE_BIT))
  redis.call('HINCRBY', KEYS[K_META], F_GONE, 1)
  redis.call('HINCRBY', SEGMENT_COUNTS, k, -1)
  local when = now + SEG_DELETE_REVIEW_MS
  if redis.call('ZADD', REVIEWS, 'LT', 'CH', int(when), k) == 0 then return nil end
  return when
end

-- The earliest of two review times (either may be nil).
local function earlier(a, b)
  if a == nil or (b ~= nil and b < a) then return b end
  return a
end
