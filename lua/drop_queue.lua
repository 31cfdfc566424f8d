-- Delete a queue, a bounded batch of messages per call so that a huge queue
-- does not block Redis. Call until it returns 0.
-- KEYS: the 6 fixed keys. ARGV: batch size, keep ('1' = purge: delete the
-- messages and claims but keep the queue, its metadata and its counter).
-- The claim index and the ordered groups go too (a group's zset is deleted
-- whole: its ids are among the messages), and the segments (storage/
-- segments.py), up to SEG_SLOTS of them (as many messages as 100 x that)
-- a call, with their keys; a purge counts every message given out so far
-- gone, and claims start past them.
local batch = tonumber(ARGV[1])
local ids = redis.call('ZRANGE', KEYS[K_IDX], 0, batch - 1)
if #ids > 0 then
  local mkeys = {}
  for _, id in ipairs(ids) do
    mkeys[#mkeys + 1] = record_key(id)
    mkeys[#mkeys + 1] = legacy_key(id)
  end
  redis.call('DEL', unpack(mkeys))
  redis.call('ZREM', KEYS[K_IDX], unpack(ids))
  redis.call('ZREM', KEYS[K_EXP], unpack(ids))
  redis.call('ZREM', KEYS[K_CLAIMED], unpack(ids))
  return 1
end
local segments = redis.call('ZRANGE', DIRECTORY, 0, SEG_SLOTS - 1)
if #segments > 0 then
  local skeys = {}
  for i, k in ipairs(segments) do skeys[i] = SEGMENT_PREFIX .. k end
  redis.call('DEL', unpack(skeys))
  redis.call('ZREM', DIRECTORY, unpack(segments))
  return 1
end
-- the claim index and the ordered groups its entries name
local entries = redis.call('ZRANGE', CLAIM_INDEX, 0, batch - 1)
if #entries > 0 then
  local groups = {}
  for _, entry in ipairs(entries) do
    if string.sub(entry, 1, #GROUP_ENTRY) == GROUP_ENTRY then
      groups[#groups + 1] = GROUP_PREFIX .. string.sub(entry, #GROUP_ENTRY + 1)
    end
  end
  if #groups > 0 then redis.call('DEL', unpack(groups)) end
  redis.call('ZREM', CLAIM_INDEX, unpack(entries))
  return 1
end
local claims = redis.call('ZRANGE', KEYS[K_CLAIMS], 0, batch - 1)
if #claims > 0 then
  local ckeys = {}
  for i, id in ipairs(claims) do ckeys[i] = claim_key(id) end
  redis.call('DEL', unpack(ckeys))
  redis.call('ZREM', KEYS[K_CLAIMS], unpack(claims))
  return 1
end
redis.call('UNLINK', CLAIM_STATES, REVIEWS, SEGMENT_COUNTS)
if ARGV[2] == '1' then
  redis.call('DEL', KEYS[K_IDX], KEYS[K_EXP], KEYS[K_CLAIMED], KEYS[K_CLAIMS])
  -- a queue in segments stays in them: every seq so far is gone
  local ns = tonumber(redis.call('HGET', KEYS[K_META], F_NEW_START))
  local top = tonumber(redis.call('GET', KEYS[K_SEQ]))
  if ns and top then
    redis.call('HSET', KEYS[K_META], F_GONE, int(math.max(0, top - ns + 1)), F_CLAIM_HEAD,
      int(top + 1))
  end
  redis.call('HDEL', KEYS[K_META], F_REVIEW_FROM)
  -- no message left: the next grouped post starts the claim index again
  redis.call('HDEL', KEYS[K_META], F_GROUPS_SINCE)
else
  redis.call('DEL', KEYS[K_META], KEYS[K_SEQ], KEYS[K_IDX], KEYS[K_EXP], KEYS[K_CLAIMED],
    KEYS[K_CLAIMS], IDEMPOTENCY)
  notify_end()
end
return 0
