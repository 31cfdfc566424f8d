-- One page of the feed after a marker.
-- KEYS: the 6 fixed keys.
-- ARGV: now_ms, marker ('' = from the head), limit, client_id, echo (1/0),
--       include_claimed (1/0), include_delayed (1/0), scan_limit,
--       with_authors (1/0; the header carries the author anyway)
-- Returns {next_marker or '', then per message: id, header, body}, the
-- header as stored (record.py's Header; record.list_reply decodes it).
-- Scans past filtered-out and expired entries until the page is full, the
-- feed ends, or scan_limit entries were looked at. next_marker is the seq of
-- the last entry looked at ('' when nothing was returned and the feed ended).
-- Cheap on purpose (docs/BENCHMARKS.md, "The list script's Redis cost"): the
-- index is read without scores (a message's seq is in its header), each
-- message with one HMGET of two fields, its times compared as fixed-width
-- strings, and the header answered as stored.
local now = ms_text(tonumber(ARGV[1]))
local limit = tonumber(ARGV[3])
local client = ARGV[4]
local echo = ARGV[5] == '1'
local include_claimed = ARGV[6] == '1'
local include_delayed = ARGV[7] == '1'
local scan_limit = tonumber(ARGV[8])
local own = H_AUTHOR + #client - 1  -- where the header of one of client's messages ends
local NO_CLAIM = byte(' ')

local out = {''}
local count, scanned = 0, 0
local last, last_id = nil, nil
local start = '-inf'
if ARGV[2] ~= '' then start = '(' .. ARGV[2] end
local chunk = limit + 2

-- The seq of the last entry looked at: from its header, else (its record is
-- gone) from the index.
local function last_seq()
  if not last then last = tonumber(redis.call('ZSCORE', KEYS[K_IDX], last_id)) end
  return last
end

while count < limit and scanned < scan_limit do
  local want = math.min(chunk, scan_limit - scanned)
  local ids = redis.call('ZRANGEBYSCORE', KEYS[K_IDX], start, '+inf', 'LIMIT', 0, want)
  if #ids == 0 then break end
  for _, id in ipairs(ids) do
    scanned = scanned + 1
    last, last_id = nil, id
    local r = redis.call('HMGET', message_key(id), F_HEADER, F_BODY)
    local h = r[1]
    if not h and r[2] then
      -- a legacy record (see record.py): answered with a header like any other
      local m = read_message(message_key(id))
      if m then h = header(m) end
    end
    if h then
      last = tonumber(sub(h, H_SEQ, H_SEQ_END))
      if sub(h, H_EXPIRES, H_EXPIRES_END) > now
          and (echo or #h ~= own or find(h, client, H_AUTHOR, true) ~= H_AUTHOR)
          and (include_claimed or byte(h, H_CLAIM) == NO_CLAIM
            or sub(h, H_CLAIM_EXPIRES, H_CLAIM_EXPIRES_END) <= now)
          and (include_delayed or sub(h, H_DUE, H_DUE_END) <= now) then
        out[#out + 1] = id
        out[#out + 1] = h
        out[#out + 1] = r[2]
        count = count + 1
        if count == limit then break end
      end
    end
  end
  if #ids < want or count == limit then break end
  start = '(' .. int(last_seq())
  chunk = math.min(chunk * 2, 512)
end
if last_id and (count > 0 or scanned >= scan_limit) then out[1] = int(last_seq()) end
return out
