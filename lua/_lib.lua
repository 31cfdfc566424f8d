-- Shared by every feedsvc script (prepended by feedsvc/storage/scripts.py,
-- after the generated names: F_* the record's fields, S_* the key suffixes).
-- KEYS[1..6] are always the queue's fixed keys, in the order of
-- QueueKeys.fixed(): meta, seq, idx, exp, claimed, claims. Per-message and
-- per-claim keys live under the same hash tag: prefix .. S_MESSAGE .. id.
local K_META, K_SEQ, K_IDX, K_EXP, K_CLAIMED, K_CLAIMS = 1, 2, 3, 4, 5, 6
local PREFIX = string.sub(KEYS[K_META], 1, -1 - #S_META)
local GC_BATCH = 100
local IDEMPOTENCY = PREFIX .. S_IDEMPOTENCY

-- Numbers handed to redis.call must be formatted by hand: Lua's own
-- conversion would print a 16-digit seq in exponent notation.
local function int(x)
  return string.format('%d', x)
end

local function message_key(id)
  return PREFIX .. S_MESSAGE .. id
end

local function claim_key(id)
  return PREFIX .. S_CLAIM .. id
end

-- A claimed message's new expiry (ms) and ttl (s): it lives at least until
-- the claim expires plus grace, never shorter than it would have
-- (record.claim_extension in Python is the same rule).
local function extend_for_claim(expires, created, claim_expires, grace)
  local keep = math.max(expires, claim_expires + grace * 1000)
  return keep, math.floor((keep - created) / 1000 + 0.5)
end

-- A message's header (F_HEADER): every field but the body in one value,
-- laid out by record.py's HEADER_FIELDS (the generated H_* positions and
-- HEADER_FORMAT): fixed-width, zero-padded numbers, so that two of one width
-- compare as strings; the claim id padded with spaces (all spaces: none);
-- the author last. seq is 0 until the message is indexed.
local sub, byte, find = string.sub, string.byte, string.find

local function header(m)
  return string.format(HEADER_FORMAT, m.seq, m.ttl, m.created, m.expires, m.due,
    m.claim_expires, m.count, m.claim, m.author)
end

-- A time (ms) as the header writes it, to compare with its fields as strings.
local function ms_text(ms)
  return string.format(H_MS_FORMAT, ms)
end

-- A message record as a table (nil: gone), read in either layout: a record
-- without a header was written before it (record.py's LEGACY fields).
local function read_message(key)
  local r = redis.call('HMGET', key, F_HEADER, F_BODY)
  if not r[2] then return nil end
  local h = r[1]
  if h then
    return {body = r[2], seq = tonumber(sub(h, H_SEQ, H_SEQ_END)),
      ttl = tonumber(sub(h, H_TTL, H_TTL_END)), created = tonumber(sub(h, H_CREATED, H_CREATED_END)),
      expires = tonumber(sub(h, H_EXPIRES, H_EXPIRES_END)), due = tonumber(sub(h, H_DUE, H_DUE_END)),
      claim_expires = tonumber(sub(h, H_CLAIM_EXPIRES, H_CLAIM_EXPIRES_END)),
      count = tonumber(sub(h, H_COUNT, H_COUNT_END)),
      claim = string.match(sub(h, H_CLAIM, H_CLAIM_END), '^(%S*)'), author = sub(h, H_AUTHOR)}
  end
  local o = redis.call('HMGET', key, F_TTL, F_CREATED, F_EXPIRES, F_SEQ, F_DUE, F_CLAIM_EXPIRES,
    F_CLAIM_COUNT, F_CLAIM, F_AUTHOR)
  if not o[3] then return nil end
  return {body = r[2], seq = tonumber(o[4]) or 0, ttl = tonumber(o[1]) or 0,
    created = tonumber(o[2]) or 0, expires = tonumber(o[3]), due = tonumber(o[5]) or 0,
    claim_expires = tonumber(o[6]) or 0, count = tonumber(o[7]) or 0, claim = o[8] or '',
    author = o[9] or '', legacy = true}
end

-- Store m's header; a legacy record moves to the new layout, atomically.
local function write_header(key, m)
  redis.call('HSET', key, F_HEADER, header(m))
  if m.legacy then
    redis.call('HDEL', key, F_TTL, F_CREATED, F_EXPIRES, F_SEQ, F_DUE, F_CLAIM_EXPIRES,
      F_CLAIM_COUNT, F_CLAIM, F_AUTHOR)
    m.legacy = nil
  end
end

-- Whether a message (a read_message table) can be claimed or popped: it must
-- exist, be indexed, alive and due, and be held by no live claim.
local function is_free(m, now)
  return m and m.seq > 0 and m.expires > now and m.due <= now
    and not (m.claim ~= '' and m.claim_expires > now)
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
  redis.call('DEL', message_key(id))
  redis.call('ZREM', KEYS[K_IDX], id)
  redis.call('ZREM', KEYS[K_EXP], id)
  redis.call('ZREM', KEYS[K_CLAIMED], id)
end

-- Forget up to GC_BATCH messages whose ttl has passed, and expired claims.
-- Redis drops the message hashes by itself (PEXPIREAT); this drops their
-- index entries so that nothing outlives its message.
local function collect_garbage(now_text)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[K_EXP], "-inf", now_text, "LIMIT", 0, GC_BATCH)
  if #dead > 0 then
    local mkeys = {}
    for i, id in ipairs(dead) do
      mkeys[i] = message_key(id)
    end
    redis.call('DEL', unpack(mkeys))
    redis.call('ZREM', KEYS[K_IDX], unpack(dead))
    redis.call('ZREM', KEYS[K_EXP], unpack(dead))
    redis.call('ZREM', KEYS[K_CLAIMED], unpack(dead))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[K_CLAIMED], "-inf", now_text)
  redis.call('ZREMRANGEBYSCORE', KEYS[K_CLAIMS], "-inf", now_text)
end
