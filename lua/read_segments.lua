-- The raw material of a page in the segment layout: the slots and records
-- of up to `want` seqs from `from` on, stepping over segments gone whole,
-- and the claim states of those messages. The caller splits and filters
-- them (storage/segment_pages.py): a script that only reads costs Redis
-- the least (docs/design-compact-storage.md, "List"). It runs on every
-- page, so it calls and builds as little as it can: the common page (from
-- a marker, in one segment) is a GETRANGE of its slots and one of its
-- records; the keys it reads come as KEYS, numbers go back as integers.
-- KEYS: the 6 fixed keys, the claim states (Q:cl), the segment holding
--       seq `from` (any key when from is '').
-- ARGV: from (the first seq wanted; '' = the queue's first), want (seqs),
--       '1' to read the segments even where the older layout still has
--       messages (the caller has read those) else '0', now_ms, a marker to
--       check against the counter ('' = none: the caller's own position).
-- Returns {'ahead'} if the marker is past anything given out (as list.lua);
-- {'legacy'} if the older layout is to be read first: the queue has no
-- segments, or from is below their first seq while Q:idx exists; else
-- {counter (or, when it was not read, the seq after the page's, given
-- out: the counter is at or past it), seq base ('' = not read: a page
-- from a written seq's marker needs none), first seq in segments ('' =
-- none or not read), reached (the
-- first seq not read: every seq before it from `from` on was looked at or
-- is in a segment gone whole), segments read, then per segment read: the
-- first seq read, its slots (4 bytes each), the records they point to (from
-- the first live one's offset to where the last one ends); then per claim
-- state of a message read: seq, state}.
local from, want = tonumber(ARGV[1]), tonumber(ARGV[2])
local top
-- every seq is below 2**53: a double holds it exactly, and one sent back
-- goes as an integer. seq % 100: from / 100 is q + r / 100 (r < 100)
-- rounded by less than 0.01, so its floor is q.
local out, key, slot, slots
if from and ARGV[3] == '0' and from % SEG_SLOTS + want < SEG_SLOTS
    and (ARGV[5] == '' or tonumber(ARGV[5]) <= from + want) then
  -- the common page: from a marker, in one segment. Its slots and the next
  slot = from % SEG_SLOTS
  local at = slot * SEG_SLOT_BYTES
  slots = redis.call('GETRANGE', KEYS[8], at, at + (want + 1) * SEG_SLOT_BYTES - 1)
  if #slots > want * SEG_SLOT_BYTES and struct.unpack('>I4', slots, 1) > 0
      and struct.unpack('>I4', slots, want * SEG_SLOT_BYTES + 1) > 0 then
    -- from's slot and the next one's are written: from is a segment
    -- message's seq (at or past the first in segments: nothing of the older
    -- layout comes first; past the counter's start: the seq base changes no
    -- count from the caller's marker, from - 1), and every seq up to the
    -- next one was given out (a zero slot between: a record a review
    -- dropped), so that one stands for the counter; neither the queue's
    -- hash nor its counter is read (a marker to check, at most that seq,
    -- was given out)
    top = from + want
    out, key = {top, '', '', 0, 0}, KEYS[8]
  end
end
if not out and ARGV[5] ~= '' then
  top = tonumber(redis.call('GET', KEYS[K_SEQ]))
  -- doubles: exact below 2**53, and a longer marker is past any counter
  local ceiling = top or tonumber(ARGV[4]) * 1000
  if tonumber(ARGV[5]) > ceiling then return {'ahead'} end
end
if not out then
  top = top or tonumber(redis.call('GET', KEYS[K_SEQ]))
  -- the slots read above serve if they reach the counter's (those past it
  -- are zero: no record yet)
  if slots and not (top and from <= top and top - from <= want) then slots = nil end
  if from and top and from <= top and not slots then
    slot = from % SEG_SLOTS
    -- the slots up to the counter's: none after it has a record yet (a
    -- record whose next slot is past it ends at the string's end)
    local last = math.min(SEG_SLOTS - 1, slot + (top - from))
    slots = redis.call('GETRANGE', KEYS[8], slot * SEG_SLOT_BYTES, (last + 1) * SEG_SLOT_BYTES - 1)
  end
  if ARGV[3] == '0' and slots and #slots > 0 and struct.unpack('>I4', slots, 1) > 0 then
    -- from's slot is written: as above, the queue's hash is not read
    out, key = {top, '', '', 0, 0}, KEYS[8]
  else
    local meta = redis.call('HMGET', KEYS[K_META], F_NEW_START, F_SEQ_BASE)
    local ns = tonumber(meta[1])
    if ARGV[3] ~= '1' and (not ns or ((not from or from < ns)
        and redis.call('EXISTS', KEYS[K_IDX]) == 1)) then
      return {'legacy'}
    end
    out = {top or 0, meta[2] or '', meta[1] or '', 0, 0}
    if not ns or not top then
      out[4] = (top or 0) + 1
      return out
    end
    if not from or from < ns then
      from, slots = ns, nil
    else
      key = KEYS[8]
    end
  end
end
local hops = 0
while want > 0 and from <= top and hops < 4 do
  local k = (from - from % SEG_SLOTS) / SEG_SLOTS
  if not slots then
    slot = from % SEG_SLOTS
    local last = math.min(SEG_SLOTS - 1, slot + (top - from))
    key = key or string.sub(KEYS[K_META], 1, -1 - #S_META) .. S_SEGMENT .. string.format('%d', k)
    slots = redis.call('GETRANGE', key, slot * SEG_SLOT_BYTES, (last + 1) * SEG_SLOT_BYTES - 1)
  end
  local n = math.min(want, SEG_SLOTS - slot, top - from + 1)
  if #slots == 0 then
    -- gone whole: on to the next segment there is
    hops = hops + 1
    local directory = string.sub(KEYS[K_META], 1, -1 - #S_META) .. S_DIRECTORY
    local after = '(' .. string.format('%d', k)
    local nxt = redis.call('ZRANGE', directory, after, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
    if nxt then from = tonumber(nxt) * SEG_SLOTS else from = top + 1 end
  else
    -- the records from the first written slot's offset (a gone message's
    -- record is still there) to where the next written slot's starts
    local first, upto = 0, -1
    for j = 0, n - 1 do
      first = struct.unpack('>I4', slots, j * SEG_SLOT_BYTES + 1) % SEG_GONE_BIT
      if first > 0 then break end
    end
    if first > 0 then
      for j = n, #slots / SEG_SLOT_BYTES - 1 do
        local at = struct.unpack('>I4', slots, j * SEG_SLOT_BYTES + 1) % SEG_GONE_BIT
        if at > 0 then
          upto = at - 1
          break
        end
      end
    end
    out[#out + 1] = from
    if n * SEG_SLOT_BYTES < #slots then slots = string.sub(slots, 1, n * SEG_SLOT_BYTES) end
    out[#out + 1] = slots
    out[#out + 1] = first > 0 and redis.call('GETRANGE', key, first, upto) or ''
    out[5] = out[5] + 1
    want = want - n
    from = from + n
  end
  key, slots = nil, nil
end
out[4] = math.min(from, top + 1)
if out[5] > 0 and redis.call('EXISTS', KEYS[7]) == 1 then
  -- the live seqs read, as text only here: most queues have no claim state
  local seqs = {}
  for i = 6, #out, 3 do
    local slots, at = out[i + 1], out[i]
    for j = 0, #slots / SEG_SLOT_BYTES - 1 do
      local v = struct.unpack('>I4', slots, j * SEG_SLOT_BYTES + 1)
      if v > 0 and v < SEG_GONE_BIT then seqs[#seqs + 1] = string.format('%d', at + j) end
    end
  end
  if #seqs > 0 then
    local states = redis.call('HMGET', KEYS[7], unpack(seqs))
    for i = 1, #seqs do
      if states[i] then
        out[#out + 1] = seqs[i]
        out[#out + 1] = states[i]
      end
    end
  end
end
return out
