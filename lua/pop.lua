-- Remove and return up to `limit` messages nobody has claimed, atomically.
-- KEYS: the 6 fixed keys. ARGV: now_ms, limit, scan_limit, sealed (the
-- prefix of a sealed body), then pairs (id, SHA1 of the body the caller
-- opened, or '' if it cannot) for sealed bodies (see verdict).
-- Returns per message: id, seq, body, ttl, created_ms, author line (the
-- author and the message's headers, see record.py); or, when a sealed
-- body it would take was not opened by the caller yet, {'open', then per
-- such message: id, body}, having removed nothing: a message the caller
-- cannot open is never removed (it is skipped).
local now = tonumber(ARGV[1])
local limit, scan_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local sealed, checked = ARGV[4], verdicts(5)
collect_garbage(ARGV[1])
local chosen, unopened = {}, {'open'}
local scanned, offset = 0, 0
while #chosen < limit and scanned < scan_limit do
  local entries = redis.call('ZRANGE', KEYS[K_IDX], offset, offset + 99, 'WITHSCORES')
  if #entries == 0 then break end
  offset = offset + #entries / 2
  for j = 1, #entries, 2 do
    local id, seq = entries[j], entries[j + 1]
    scanned = scanned + 1
    local m = read_message(id)
    if is_free(m, now) and may_take(checked, sealed, id, m, unopened) then
      chosen[#chosen + 1] = {id, seq, m}
      if #chosen == limit then break end
    end
  end
end
if #unopened > 1 then return unopened end
local out = {}
for _, c in ipairs(chosen) do
  local id, seq, m = c[1], c[2], c[3]
  forget(id)
  out[#out + 1] = id
  out[#out + 1] = seq
  out[#out + 1] = m.body
  out[#out + 1] = int(m.ttl)
  out[#out + 1] = int(m.created)
  out[#out + 1] = m.author
end
return out
