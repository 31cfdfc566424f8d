-- Remove and return up to `limit` messages nobody has claimed, atomically.
-- KEYS: the 6 fixed keys. ARGV: now_ms, limit, scan_limit.
-- Returns per message: id, seq, body, ttl, created_ms.
local now = tonumber(ARGV[1])
local limit, scan_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
collect_garbage(ARGV[1])
local out = {}
local taken = 0
local scanned, offset = 0, 0
while taken < limit and scanned < scan_limit do
  local entries = redis.call('ZRANGE', KEYS[K_IDX], offset, offset + 99, 'WITHSCORES')
  if #entries == 0 then break end
  offset = offset + #entries / 2
  for j = 1, #entries, 2 do
    local id, seq = entries[j], entries[j + 1]
    scanned = scanned + 1
    local m = read_message(id)
    if is_free(m, now) then
      forget(id)
      offset = offset - 1
      out[#out + 1] = id
      out[#out + 1] = seq
      out[#out + 1] = m.body
      out[#out + 1] = int(m.ttl)
      out[#out + 1] = int(m.created)
      taken = taken + 1
      if taken == limit then break end
    end
  end
end
return out
