-- Index messages whose records the same pipeline has just written
-- (unindexed: seq 0 in the header).
-- KEYS: the 6 fixed keys, then one record key per message, then (when the
--       post holds room under its project's quota, see quotas.py) the
--       project's reservations.
-- ARGV: now_ms, default_ttl, default_delay, request size in bytes,
--       idempotency token ('' = none), idempotency window in ms, '1' if the
--       bodies are sealed (encrypted) else '0', the post's reservation
--       ('' = none), then per message: id, ttl, delay ('' = the queue's
--       default, else the service's), ordered group ('' = none, or not
--       indexed: a topic's).
-- The reservation goes first thing, whatever the outcome: from here on the
-- messages count as live (indexed) or not at all (refused).
-- Returns the seq of each message; {} (nothing indexed) if a body is missing;
-- {'seal'} if the queue encrypts its messages and these bodies are not sealed:
-- the bodies this call wrote are deleted and nothing else changes;
-- {'toolarge', limit} if the request is over the queue's _max_messages_post_size;
-- {'full', limit} if the queue would hold more live messages than its
-- _max_messages: the bodies this call wrote are deleted, nothing else changes;
-- {'segments'} if the queue writes its messages in segments (storage/segments.py):
-- the bodies this call wrote are deleted, nothing else changes (the
-- reservation is still held);
-- {'replay', id...} if the idempotency token was used within its window: the
-- bodies this call wrote are deleted and the first post's ids returned.
-- Idempotent: a message already indexed keeps its seq.
-- Ordered groups (docs/consumers.md): the first grouped message sets the
-- queue's F_GROUPS_SINCE to its seq; from then on every message is also
-- claim-indexed: a grouped one in its group's zset (and its group's entry
-- in the claim index, if the group had none), an ungrouped one in the claim
-- index itself. A queue that never had a grouped message pays nothing.
-- Publishes a notification for the queue's followers (see _lib.lua's notify).
local now = tonumber(ARGV[1])
local n = (#ARGV - 8) / 4
local token = ARGV[5]
-- a queue in segments stays there (storage/segments.py): post_segments.lua
-- writes these messages, the bodies written ahead go
if redis.call('HEXISTS', KEYS[K_META], F_NEW_START) == 1 then
  redis.call('DEL', unpack(KEYS, 7, 6 + n))
  return {'segments'}
end
if ARGV[8] ~= '' then redis.call('ZREM', KEYS[7 + n], ARGV[8]) end
-- all or nothing: index no message if any body is missing
for i = 1, n do
  if redis.call('EXISTS', KEYS[6 + i]) == 0 then return {} end
end
if ARGV[7] ~= '1' and redis.call('HGET', KEYS[K_META], F_ENCRYPTED) == '1' then
  redis.call('DEL', unpack(KEYS, 7, 6 + n))
  return {'seal'}
end
local replay = replayed(token, now, true)
if replay then
  redis.call('DEL', unpack(KEYS, 7, 6 + n))
  return replay
end
if redis.call('EXISTS', KEYS[K_META]) == 0 then
  redis.call('HSET', KEYS[K_META], F_CREATED, ARGV[1])
end
local q = redis.call('HMGET', KEYS[K_META], F_DEFAULT_TTL, F_DEFAULT_DELAY, F_MAX_POST_SIZE,
  F_MAX_MESSAGES, F_GROUPS_SINCE)
local groups_since = q[5]
collect_garbage(ARGV[1], groups_since)
if q[3] and tonumber(ARGV[4]) > tonumber(q[3]) then return {'toolarge', q[3]} end
-- live messages only: an expired one, collected or not, holds no room
if q[4] and live_count(ARGV[1], KEYS[K_EXP], KEYS[K_META], KEYS[K_SEQ]) + n > tonumber(q[4]) then
  redis.call('DEL', unpack(KEYS, 7, 6 + n))
  return {'full', q[4]}
end
local default_ttl = tonumber(q[1] or ARGV[2])
local default_delay = tonumber(q[2] or ARGV[3])
if redis.call('EXISTS', KEYS[K_SEQ]) == 0 then
  -- microseconds: a re-created queue starts above every old marker
  redis.call('SET', KEYS[K_SEQ], ARGV[1] .. '000')
  -- where it started: list.lua counts missed messages from here at most
  redis.call('HSET', KEYS[K_META], F_SEQ_BASE, ARGV[1] .. '000')
end
local seqs = {}
local indexed, first_due = 0, 0
for i = 1, n do
  local key = KEYS[6 + i]
  local id = ARGV[5 + 4 * i]
  local ttl = tonumber(ARGV[6 + 4 * i]) or default_ttl
  local delay = tonumber(ARGV[7 + 4 * i]) or default_delay
  local group = ARGV[8 + 4 * i]
  -- the pipeline wrote the record unindexed (seq 0)
  local seq = tonumber(redis.call('GETRANGE', key, H_SEQ - 1, H_SEQ_END - 1)) or 0
  if seq == 0 then
    seq = redis.call('INCR', KEYS[K_SEQ])
    local expires = now + ttl * 1000
    local due = 0
    if delay > 0 then due = now + delay * 1000 end
    redis.call('SETRANGE', key, 0, header({seq = seq, ttl = ttl, created = now,
      expires = expires, due = due, claim_expires = 0, count = 0, claim = ''}))
    redis.call('PEXPIREAT', key, int(expires))
    redis.call('ZADD', KEYS[K_IDX], int(seq), id)
    redis.call('ZADD', KEYS[K_EXP], int(expires), id)
    groups_since = index_for_claims(seq, group, groups_since, id)
    indexed = seq
    if due > 0 and (first_due == 0 or due < first_due) then first_due = due end
  end
  seqs[i] = seq
end
if indexed > 0 then notify(indexed, first_due) end
if token ~= '' then
  local ids = {}
  for i = 1, n do ids[i] = ARGV[5 + 4 * i] end
  remember_post(token, now + tonumber(ARGV[6]), ids)
end
return seqs
