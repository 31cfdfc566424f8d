-- The raw material of a page in the segment layout: the slots and records
-- of up to `want` seqs from `from` on, stepping over segments gone whole,
-- and the claim states of those messages. The caller splits and filters
-- them (storage/segment_pages.py): a script that only reads costs Redis
-- the least (docs/design-compact-storage.md, "List").
-- KEYS: the 6 fixed keys.
-- ARGV: from (the first seq wanted; '' = the queue's first), want (seqs),
--       '1' to read the segments even where the older layout still has
--       messages (the caller has read those) else '0', now_ms, a marker to
--       check against the counter ('' = none: the caller's own position).
-- Returns {'ahead'} if the marker is past anything given out (as list.lua);
-- {'legacy'} if the older layout is to be read first: the queue has no
-- segments, or from is below their first seq while Q:idx exists; else
-- {counter, seq base, first seq in segments ('' = none), reached (the
-- first seq not read: every seq before it from `from` on was looked at or
-- is in a segment gone whole), segments read, then per segment read: the
-- first seq read, its slots (4 bytes each), the records they point to (from
-- the first live one's offset to where the last one ends); then per claim
-- state of a message read: seq, state}.
local now = ARGV[4]
local meta = redis.call('HMGET', KEYS[K_META], F_NEW_START, F_SEQ_BASE)
local top = tonumber(redis.call('GET', KEYS[K_SEQ]))
if ARGV[5] ~= '' then
  -- doubles: exact below 2**53, and a longer marker is past any counter
  local ceiling = top or tonumber(now) * 1000
  if tonumber(ARGV[5]) > ceiling then return {'ahead'} end
end
local ns = tonumber(meta[1])
local from = tonumber(ARGV[1])
if ARGV[3] ~= '1' and (not ns or ((not from or from < ns)
    and redis.call('EXISTS', KEYS[K_IDX]) == 1)) then
  return {'legacy'}
end
local out = {int(top or 0), meta[2] or '', ns and int(ns) or '', '', 0}
if not ns or not top then
  out[4] = int((top or 0) + 1)
  return out
end
if not from or from < ns then from = ns end
local want = tonumber(ARGV[2])
local seqs, hops = {}, 0
while want > 0 and from <= top and hops < 4 do
  local k, slot = segment_of(from)
  local key = SEGMENT_PREFIX .. k
  local n = math.min(want, SEG_SLOTS - slot, top - from + 1)
  -- the slots up to the counter's: none after it has a record yet (a
  -- record whose next slot is past it ends at the string's end)
  local last = math.min(SEG_SLOTS - 1, slot + (top - from))
  local slots = redis.call('GETRANGE', key, slot * SEG_SLOT_BYTES, (last + 1) * SEG_SLOT_BYTES - 1)
  if #slots == 0 then
    -- gone whole: on to the next segment there is
    hops = hops + 1
    local nxt = redis.call('ZRANGE', DIRECTORY, '(' .. k, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
    if nxt then from = tonumber(nxt) * SEG_SLOTS else from = top + 1 end
  else
    local first, upto = nil, -1
    for j = 0, n - 1 do
      local at, gone = slot_at(slots, j)
      if at > 0 then
        if not first then first = at end
        if not gone then seqs[#seqs + 1] = int(from + j) end
      end
    end
    for j = n, #slots / SEG_SLOT_BYTES - 1 do
      local at = slot_at(slots, j)
      if at > 0 then
        upto = at - 1
        break
      end
    end
    out[#out + 1] = int(from)
    out[#out + 1] = string.sub(slots, 1, n * SEG_SLOT_BYTES)
    out[#out + 1] = first and redis.call('GETRANGE', key, first, upto) or ''
    out[5] = out[5] + 1
    want = want - n
    from = from + n
  end
end
out[4] = int(math.min(from, top + 1))
if #seqs > 0 and redis.call('EXISTS', CLAIM_STATES) == 1 then
  local states = redis.call('HMGET', CLAIM_STATES, unpack(seqs))
  for i = 1, #seqs do
    if states[i] then
      out[#out + 1] = seqs[i]
      out[#out + 1] = states[i]
    end
  end
end
return out
