-- Delete messages, in either layout (a segment message's slot is marked gone).
-- KEYS: the 6 fixed keys, then per id its record key and legacy key
-- (record.message_keys).
-- ARGV: now_ms, claim_id ('' = none), check (1 = enforce claims), ids...
-- With check=1 (single delete): returns 'claimed' when a live claim holds the
-- message and no claim_id was given, 'badclaim' when claim_id does not hold
-- it; nothing is deleted then. Otherwise deletes and returns the segment
-- review it moved earlier (ms; 0: none; see segment_gone). Absent
-- messages are fine (deletes are idempotent). Deleting the head of an
-- ordered group publishes a wake-up (see _lib.lua's notify: 0 0) when the
-- group has a next message.
local now = tonumber(ARGV[1])
local claim_id = ARGV[2]
local check = ARGV[3] == '1'
if check then
  local m = read_message(ARGV[4])
  if m and m.seq > 0 then
    local claimed = m.claim ~= '' and m.claim_expires > now
    if claim_id == '' then
      if claimed then return 'claimed' end
    elseif not claimed or m.claim ~= claim_id then
      return 'badclaim'
    end
  end
end
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
-- the ids of the queue's segments (storage/segments.py), id -> seq
local segment_ids = {}
for _, id in ipairs(ids) do
  local seq = segment_message_seq(id)
  if seq and (not segment_layout().legacy
      or redis.call('EXISTS', record_key(id), legacy_key(id)) == 0) then
    segment_ids[id] = seq
  end
end
-- In a queue with ordered groups: out of the claim index and their groups,
-- and a group whose head this frees wakes the claim waits (as a release).
local fronts = nil
if redis.call('HEXISTS', KEYS[K_META], F_GROUPS_SINCE) == 1 then
  fronts = {}
  local members = {}
  for _, id in ipairs(ids) do
    local group
    if segment_ids[id] then
      local m = segment_message(id)
      group = m and string.match(m.author, GROUP_PATTERN) or ''
    else
      group = stored_group(id)
    end
    if group ~= '' then
      if not fronts[group] then
        fronts[group] = redis.call('ZRANGE', GROUP_PREFIX .. group, 0, 0)[1] or ''
        members[group] = {}
      end
      members[group][#members[group] + 1] = id
    end
  end
  redis.call('ZREM', CLAIM_INDEX, unpack(ids))
  for group, gone in pairs(members) do redis.call('ZREM', GROUP_PREFIX .. group, unpack(gone)) end
end
redis.call('DEL', unpack(KEYS, 7))
redis.call('ZREM', KEYS[K_IDX], unpack(ids))
redis.call('ZREM', KEYS[K_EXP], unpack(ids))
redis.call('ZREM', KEYS[K_CLAIMED], unpack(ids))
local review = nil
for _, seq in pairs(segment_ids) do review = earlier(review, segment_gone(seq, now)) end
if fronts then
  local freed = false
  for group, front in pairs(fronts) do
    local first = settle_group(group)
    if first and first ~= front then freed = true end
  end
  if freed then notify(0, 0) end
end
return review or 0
