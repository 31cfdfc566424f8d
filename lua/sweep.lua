-- The sweep of one queue's segments (storage/reviews.py): run its due
-- reviews, each one segment of at most SEG_SLOTS records, and, for stats,
-- count its live messages exactly.
-- KEYS: the 6 fixed keys.
-- ARGV: now_ms, the most reviews to run, '1' to count the live messages.
-- Returns {reviews run, the next review due (ms; '' = none), the live
-- messages ('' unless counted)}: the older layout's live records and the
-- segment messages not counted gone, less those expired in segments not
-- yet reviewed (every such segment's review is at most SEG_SPREAD_MS
-- ahead; up to SEG_COUNT_SEGMENTS of them are read).
local now = tonumber(ARGV[1])
local ran = review_due(now, tonumber(ARGV[2]))
local first = redis.call('ZRANGE', REVIEWS, 0, 0, 'WITHSCORES')
local out = {ran, first[2] or '', ''}
if ARGV[3] == '1' then
  local live = live_count(ARGV[1], KEYS[K_EXP], KEYS[K_META], KEYS[K_SEQ])
  local soon = redis.call('ZRANGE', REVIEWS, '-inf', int(now + SEG_SPREAD_MS), 'BYSCORE',
    'LIMIT', 0, SEG_COUNT_SEGMENTS)
  if #soon > 0 then
    local top = tonumber(redis.call('GET', KEYS[K_SEQ])) or 0
    for _, k in ipairs(soon) do
      live = live - math.max(0, segment_count(k, top) - #survey_segment(k, now).keep)
    end
  end
  out[3] = math.max(0, live)
end
return out
