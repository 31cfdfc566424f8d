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

-- Whether a message can be claimed or popped: m holds its fields
-- b, t, c, e, d, k, x (HMGET in that order); it must exist, be alive, be due
-- and be held by no live claim.
local function is_free(m, now)
  return m[1] and (tonumber(m[4]) or 0) > now and (tonumber(m[5]) or 0) <= now
    and not (m[6] and m[6] ~= '' and (tonumber(m[7]) or 0) > now)
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
