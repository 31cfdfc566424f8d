-- Delete messages.
-- KEYS: the 6 fixed keys, then per id its record key and legacy key
-- (record.message_keys).
-- ARGV: now_ms, claim_id ('' = none), check (1 = enforce claims), ids...
-- With check=1 (single delete): returns 'claimed' when a live claim holds the
-- message and no claim_id was given, 'badclaim' when claim_id does not hold
-- it; nothing is deleted then. Otherwise deletes and returns 'ok'. Absent
-- messages are fine (deletes are idempotent).
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
if #ids > 0 then
  redis.call('DEL', unpack(KEYS, 7))
  redis.call('ZREM', KEYS[K_IDX], unpack(ids))
  redis.call('ZREM', KEYS[K_EXP], unpack(ids))
  redis.call('ZREM', KEYS[K_CLAIMED], unpack(ids))
end
return 'ok'
