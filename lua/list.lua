-- One page of the feed after a marker.
-- KEYS: the 6 fixed keys.
-- ARGV: now_ms, marker ('' = from the head), limit, client_id, echo (1/0),
--       include_claimed (1/0), include_delayed (1/0), scan_limit,
--       with_authors (1/0; a record carries the author anyway),
--       check_marker (1/0: the marker is a client's), passing (1/0: a
--       follower catching up asks how far an empty page lets it pass)
-- Returns {next_marker or '', next_due or '', claim_ends or '', missed,
-- passed or '', then per message: id, record},
-- the record as stored (record.py; record.list_reply decodes it); {'ahead'}
-- if check_marker is 1 and the marker is past anything given out: past the
-- queue's counter, or with no counter past now in microseconds (where a
-- first post starts it).
-- Scans past filtered-out and expired entries until the page is full, the
-- feed ends, or scan_limit entries were looked at. next_marker is the seq of
-- the last entry looked at ('' when nothing was returned and the feed ended),
-- except that it stops at the page's last message when a delayed message
-- this query would show once due was looked at after it: that one is not
-- passed, so it is seen when it falls due. next_due is then (and on an
-- empty page at the feed's end) when the first such message falls due (a
-- waiter sleeps until then at most). claim_ends is when the first live
-- claim on a message the scan looked at ends (shown with include_claimed,
-- else passed): a follower that passed one wakes then.
-- missed: how many messages after the
-- marker, up to next_marker, are gone (expired, deleted, popped): seqs are
-- consecutive per queue (post.lua), so it is the seqs in that range less the
-- live entries met there, live ones filtered out (echo, claimed, delayed)
-- included; 0 without a marker or a next_marker. Counted from the queue
-- counter's start (F_SEQ_BASE) when the marker is older than the queue.
-- passed (asked with passing, on an empty page at the feed's end after a
-- marker): the seq up to which every entry after the marker is gone, up to
-- the counter if none is live (at least the marker, or the counter's start
-- if that is later), missed then counting those.
-- Cheap on purpose (docs/BENCHMARKS.md, "The list script's Redis cost"): the
-- index is read without scores (a message's seq is in its record), the
-- records a page needs with one MGET, their times compared as fixed-width
-- strings, and each record answered as stored.
local now = ms_text(tonumber(ARGV[1]))
local limit = tonumber(ARGV[3])
local client = ARGV[4]
local echo = ARGV[5] == '1'
local include_claimed = ARGV[6] == '1'
local include_delayed = ARGV[7] == '1'
local scan_limit = tonumber(ARGV[8])
-- where a newline (or, before a message's headers, a space) follows client
-- as the author
local own = H_AUTHOR + #client
local NO_CLAIM, NL, HS = byte(' '), byte(NEWLINE), byte(H_HEADERS_SEPARATOR)

if ARGV[10] == '1' and ARGV[2] ~= '' then
  local top = redis.call('GET', KEYS[K_SEQ])
  -- doubles: exact below 2**53, and a longer marker is past any counter
  local ceiling = top and tonumber(top) or tonumber(ARGV[1]) * 1000
  if tonumber(ARGV[2]) > ceiling then return {'ahead'} end
end

-- A queue in segments (storage/segments.py) has its older messages below
-- F_NEW_START: this scan stops there, and answers {'more', scanned, last,
-- alive, alive at the page's last message, first alive, next due, claim
-- ends, then id, record...} if it did with room left on the page
-- (storage/segment_pages.py carries on in the segments).
local ns = tonumber(redis.call('HGET', KEYS[K_META], F_NEW_START))
if ns and ARGV[2] ~= '' and tonumber(ARGV[2]) >= ns - 1 then
  return {'more', 0, '', 0, 0, '', '', ''}
end
local stop = '+inf'
if ns then stop = '(' .. int(ns) end

local out, n = {'', '', '', '0', ''}, 5
local next_due, claim_ends = nil, nil
local count, scanned = 0, 0
local last, last_id = nil, nil
local alive, alive_at_message = 0, 0  -- live entries met, and up to the page's last message
local first_alive = nil  -- the seq of the first live entry met
local start = '-inf'
if ARGV[2] ~= '' then start = '(' .. ARGV[2] end
local chunk = limit + 2

while count < limit and scanned < scan_limit do
  local want = math.min(chunk, scan_limit - scanned)
  local ids = redis.call('ZRANGEBYSCORE', KEYS[K_IDX], start, stop, 'LIMIT', 0, want)
  if #ids == 0 then break end
  -- read the records a few at a time, as many as the page still needs: the
  -- chunk's extra ids are read only if messages were filtered out
  local j = 1
  while j <= #ids and count < limit do
    local upto = math.min(#ids, j + limit - count - 1)
    local keys = {}
    for k = j, upto do keys[k - j + 1] = RECORD_PREFIX .. ids[k] end
    local records = redis.call('MGET', unpack(keys))
    for k = j, upto do
      local id, r = ids[k], records[k - j + 1]
      scanned = scanned + 1
      -- a legacy message (see record.py) is answered as a record like any other
      if not r then r = legacy_record(id) end
      last, last_id = r, id
      if r then
        local expires = sub(r, H_EXPIRES, H_EXPIRES_END)
        if expires > now then
          alive = alive + 1
          if not first_alive then first_alive = tonumber(sub(r, H_SEQ, H_SEQ_END)) end
        end
        local shown = expires > now
            and (echo or (byte(r, own) ~= NL and byte(r, own) ~= HS)
              or find(r, client, H_AUTHOR, true) ~= H_AUTHOR)
        if shown and byte(r, H_CLAIM) ~= NO_CLAIM then
          local ends = sub(r, H_CLAIM_EXPIRES, H_CLAIM_EXPIRES_END)
          if ends > now then
            if not claim_ends or ends < claim_ends then claim_ends = ends end
            shown = include_claimed
          end
        end
        if shown then
          local due = sub(r, H_DUE, H_DUE_END)
          if include_delayed or due <= now then
            out[n + 1] = id
            out[n + 2] = r
            n = n + 2
            count = count + 1
            alive_at_message = alive
            next_due = nil  -- only those after the page's last message count
          elseif due < expires and (not next_due or due < next_due) then
            next_due = due  -- fixed width: compared as text, like now
          end
        end
      end
    end
    j = upto + 1
  end
  -- the seq of the last entry looked at: from its record, else (the record
  -- is gone) from the index
  if last then
    last = tonumber(sub(last, H_SEQ, H_SEQ_END))
  else
    last = tonumber(redis.call('ZSCORE', KEYS[K_IDX], last_id))
  end
  if #ids < want or count == limit then break end
  start = '(' .. int(last)
  chunk = math.min(chunk * 2, 512)
end
if ns and count < limit and scanned < scan_limit then
  out[1], out[2], out[3], out[4], out[5] = 'more', scanned, last and int(last) or '', alive,
    alive_at_message
  table.insert(out, 6, first_alive and int(first_alive) or '')
  table.insert(out, 7, next_due or '')
  table.insert(out, 8, claim_ends or '')
  return out
end
local upto, met = nil, alive
if next_due and count > 0 then
  upto, met = tonumber(sub(out[n], H_SEQ, H_SEQ_END)), alive_at_message
  out[1] = int(upto)
  out[2] = next_due
elseif last_id and (count > 0 or scanned >= scan_limit) then
  upto = last
  out[1] = int(last)
elseif next_due then
  out[2] = next_due
end
if claim_ends then out[3] = claim_ends end
if upto and ARGV[2] ~= '' then
  local from = tonumber(ARGV[2])
  if upto - from > met then
    -- something is gone: the counter's start (read only then) bounds the range
    local base = tonumber(redis.call('HGET', KEYS[K_META], F_SEQ_BASE))
    if base and base > from then from = base end
    out[4] = int(math.max(0, upto - from - met))
  end
elseif ARGV[11] == '1' and ARGV[2] ~= '' and count == 0 and scanned < scan_limit then
  local from = tonumber(ARGV[2])
  local base = tonumber(redis.call('HGET', KEYS[K_META], F_SEQ_BASE))
  if base and base > from then from = base end
  local passed = from
  if first_alive then
    passed = math.max(from, first_alive - 1)
  else
    passed = math.max(from, tonumber(redis.call('GET', KEYS[K_SEQ])) or from)
  end
  out[4] = int(passed - from)
  out[5] = int(passed)
end
return out
