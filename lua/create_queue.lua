-- Create a queue unless it exists.
-- KEYS: the 6 fixed keys. ARGV: now_ms, metadata JSON, then field/value
-- pairs of reserved settings to keep as plain fields.
-- Returns 1 if created, 0 if it existed (then nothing changes).
if redis.call('EXISTS', KEYS[K_META]) == 1 then return 0 end
redis.call('HSET', KEYS[K_META], F_CREATED, ARGV[1], F_METADATA, ARGV[2], unpack(ARGV, 3))
return 1
