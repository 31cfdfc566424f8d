-- Claim up to `limit` messages for a new claim, atomically.
-- KEYS: the 6 fixed keys; when the queue dead-letters, then the 6 fixed keys
--       of the dead-letter queue.
-- ARGV: now_ms, claim_id, ttl, grace, limit, scan_limit, max_claim_count
--       ('' = none), dead-letter ttl ('' = keep the message's ttl),
--       dead-letter queue name ('' = none; must equal the queue's setting).
-- Returns {'retry'} when the queue's dead-letter settings changed since the
-- caller read them; else {claim_id or '', number of messages dead-lettered,
--   then per claimed message: id, seq, body, ttl, created_ms, claim count}.
-- Every candidate is checked on its own: its claim, delay and expiry (no
-- "claimed messages form a prefix" shortcut).
local now = tonumber(ARGV[1])
local claim_id = ARGV[2]
local ttl, grace = tonumber(ARGV[3]), tonumber(ARGV[4])
local limit, scan_limit = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_claims = tonumber(ARGV[7])
local dlq_ttl = tonumber(ARGV[8])
local dlq = ARGV[9]
local q = redis.call('HMGET', KEYS[K_META], 'mcc', 'dlq', 'dlqttl')
if (q[1] or '') ~= ARGV[7] or (q[2] or '') ~= dlq or (q[3] or '') ~= ARGV[8] then
  return {'retry'}
end
collect_garbage(ARGV[1])
local claim_expires = now + ttl * 1000
local keep_until = claim_expires + grace * 1000
local out = {'', 0}
local moved = 0
local claimed_ids = {}
local scanned, offset = 0, 0
while #claimed_ids < limit and scanned < scan_limit do
  local entries = redis.call('ZRANGE', KEYS[K_IDX], offset, offset + 99, 'WITHSCORES')
  if #entries == 0 then break end
  offset = offset + #entries / 2
  for j = 1, #entries, 2 do
    local id, seq = entries[j], entries[j + 1]
    scanned = scanned + 1
    local key = message_key(id)
    local m = redis.call('HMGET', key, 'b', 't', 'c', 'e', 'd', 'k', 'x', 'n', 'u')
    if is_free(m, now) then
      local expires = tonumber(m[4])
      local count = tonumber(m[8]) or 0
      if max_claims and dlq ~= '' and count >= max_claims then
        -- claimed too often: move it to the dead-letter queue instead
        local dttl = dlq_ttl or tonumber(m[2])
        local dexp = now + dttl * 1000
        local dkey = string.sub(KEYS[7], 1, -3) .. ':m:' .. id
        if redis.call('EXISTS', KEYS[8]) == 0 then
          redis.call('SET', KEYS[8], ARGV[1] .. '000')
        end
        if redis.call('EXISTS', KEYS[7]) == 0 then
          redis.call('HSET', KEYS[7], 'c', ARGV[1], 'm', '{}')
        end
        local dseq = redis.call('INCR', KEYS[8])
        redis.call('HSET', dkey, 'b', m[1], 'u', m[9] or '', 's', int(dseq), 't', int(dttl),
          'c', ARGV[1], 'e', int(dexp), 'd', '0', 'k', '', 'x', '0', 'n', int(count))
        redis.call('PEXPIREAT', dkey, int(dexp))
        redis.call('ZADD', KEYS[9], int(dseq), id)
        redis.call('ZADD', KEYS[10], int(dexp), id)
        forget(id)
        offset = offset - 1
        moved = moved + 1
      else
        local new_expires = math.max(expires, keep_until)
        local created = tonumber(m[3])
        local new_ttl = math.floor((new_expires - created) / 1000 + 0.5)
        redis.call('HSET', key, 'k', claim_id, 'x', int(claim_expires), 'n', int(count + 1),
          'e', int(new_expires), 't', int(new_ttl))
        redis.call('PEXPIREAT', key, int(new_expires))
        redis.call('ZADD', KEYS[K_EXP], int(new_expires), id)
        redis.call('ZADD', KEYS[K_CLAIMED], int(claim_expires), id)
        claimed_ids[#claimed_ids + 1] = id
        out[#out + 1] = id
        out[#out + 1] = seq
        out[#out + 1] = m[1]
        out[#out + 1] = int(new_ttl)
        out[#out + 1] = m[3]
        out[#out + 1] = int(count + 1)
        if #claimed_ids == limit then break end
      end
    end
  end
end
if #claimed_ids > 0 then
  local ckey = claim_key(claim_id)
  redis.call('HSET', ckey, 't', int(ttl), 'g', int(grace), 'c', ARGV[1],
    'x', int(claim_expires), 'ids', table.concat(claimed_ids, ' '))
  redis.call('PEXPIREAT', ckey, int(claim_expires))
  redis.call('ZADD', KEYS[K_CLAIMS], int(claim_expires), claim_id)
  out[1] = claim_id
end
out[2] = moved
return out
