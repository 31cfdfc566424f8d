-- One page of the feed after a marker.
-- KEYS: the 6 fixed keys.
-- ARGV: now_ms, marker ('' = from the head), limit, client_id, echo (1/0),
--       include_claimed (1/0), include_delayed (1/0), scan_limit,
--       with_authors (1/0)
-- Returns {next_marker or '', then per message:
--          id, seq, body, ttl, created_ms, live claim id or '', claim count,
--          and with_authors, author (the poster's client id)}.
-- next_marker, seq, ttl, created_ms and the claim count are integer replies
-- (every seq is below 2^53, so a Lua number holds it exactly): the client
-- reads them as numbers without parsing text, 10 times per page.
-- Scans past filtered-out and expired entries until the page is full, the
-- feed ends, or scan_limit entries were looked at. next_marker is the seq of
-- the last entry looked at ('' when nothing was returned and the feed ended).
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[3])
local client = ARGV[4]
local echo = ARGV[5] == '1'
local include_claimed = ARGV[6] == '1'
local include_delayed = ARGV[7] == '1'
local scan_limit = tonumber(ARGV[8])
local with_authors = ARGV[9] == '1'

local out = {''}
local count, scanned = 0, 0
local last = nil
local start = '-inf'
if ARGV[2] ~= '' then start = '(' .. ARGV[2] end
local chunk = limit + 2
while count < limit and scanned < scan_limit do
  local want = math.min(chunk, scan_limit - scanned)
  local entries = redis.call('ZRANGEBYSCORE', KEYS[K_IDX], start, '+inf',
    'WITHSCORES', 'LIMIT', 0, want)
  if #entries == 0 then break end
  for j = 1, #entries, 2 do
    local id, seq = entries[j], entries[j + 1]
    scanned = scanned + 1
    last = seq
    local m = redis.call('HMGET', message_key(id), F_BODY, F_TTL, F_CREATED, F_EXPIRES, F_AUTHOR,
      F_DUE, F_CLAIM, F_CLAIM_EXPIRES, F_CLAIM_COUNT)
    if m[1] and (tonumber(m[4]) or 0) > now then
      local claimed = m[7] and m[7] ~= '' and (tonumber(m[8]) or 0) > now
      if (echo or m[5] ~= client)
          and (include_claimed or not claimed)
          and (include_delayed or (tonumber(m[6]) or 0) <= now) then
        local claim = ''
        if claimed then claim = m[7] end
        out[#out + 1] = id
        out[#out + 1] = tonumber(seq)
        out[#out + 1] = m[1]
        out[#out + 1] = tonumber(m[2])
        out[#out + 1] = tonumber(m[3])
        out[#out + 1] = claim
        out[#out + 1] = tonumber(m[9]) or 0
        if with_authors then out[#out + 1] = m[5] or '' end
        count = count + 1
        if count == limit then break end
      end
    end
  end
  if #entries < 2 * want then break end
  start = '(' .. last
  chunk = math.min(chunk * 2, 512)
end
if last and (count > 0 or scanned >= scan_limit) then out[1] = tonumber(last) end
return out
