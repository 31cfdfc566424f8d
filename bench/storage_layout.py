"""The proposed compact layout (docs/design-compact-storage.md), tried on a
real redis-server before anyone builds it: ``python -m bench.storage_layout``.

Not feedsvc's storage: a prototype of the proposal's containers and of the
Redis work of its post, list and sweep scripts (the scripts below), beside
a plain Redis Stream on the same redis-server (its own, a free port,
default configuration), measured as ``bench/storage.py`` measures today's
layout: ``used_memory`` after ``MEMORY PURGE`` per message and the main
thread's CPU per call. What it leaves out (idempotency, quotas, claims'
writes, dead letters, the legacy read path) is listed in the proposal.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.service import PRODUCER
from bench.storage import (
    BATCH,
    BIG_BODIES,
    BODY_BYTES,
    PAGE,
    PIPELINE,
    READER,
    TTL,
    body,
    measure,
    used_memory,
    xadd_all,
    xrange_all,
)
from feedsvc.embedded_redis.server import RedisServer

#: entries per segment (one stream key each)
SEGMENT = 100
#: a segment whose expiries spread over more than this is reviewed (ms)
SPREAD_MS = 60_000
#: a review waits this long after the earliest expiry it is for (ms)
REVIEW_AFTER_MS = 30_000

# KEYS: Q:q (hash: seq, tmin, tmax), Q:dir (zset: segment number -> itself),
# Q:sx (zset: segment number -> when the sweep looks at it). ARGV: now ms,
# segment key prefix, client id, then per message ttl s, delay s, tag, body.
# A message's segment is its seq // SEGMENT: no lookup, and the seqs of one
# call are consecutive. Returns the last seq.
POST = """
local now = tonumber(ARGV[1])
local prefix, client = ARGV[2], ARGV[3]
local q = redis.call('HMGET', KEYS[1], 'seq', 'tmin', 'tmax')
local seq = tonumber(q[1]) or now * 1000
local tmin, tmax = tonumber(q[2]) or 0, tonumber(q[3]) or 0
local tail = math.floor(seq / SEGMENT)
local spread = false
for i = 4, #ARGV, 4 do
  seq = seq + 1
  local k = math.floor(seq / SEGMENT)
  if k ~= tail or tmax == 0 then
    if tmax > 0 then redis.call('ZADD', KEYS[3], 'LT', tmax, tail) end
    redis.call('ZADD', KEYS[2], k, k)
    tail, tmin, tmax = k, 0, 0
  end
  local ttl, delay = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local expires = now + ttl * 1000
  local due = 0
  if delay > 0 then due = now + delay * 1000 end
  local key = prefix .. k
  local id = string.format('%.0f-0', seq)
  redis.call('XADD', key, id, 'e', expires, 't', ttl, 'd', due, 'u', client,
    'g', ARGV[i + 2], 'b', ARGV[i + 3])
  if expires > tmax then
    redis.call('PEXPIREAT', key, expires)
    tmax = expires
  end
  if tmin == 0 or expires < tmin then tmin = expires end
  if tmax - tmin > SPREAD_MS then spread = true end
end
if spread then redis.call('ZADD', KEYS[3], 'LT', tmin + REVIEW_AFTER_MS, tail) end
local last = string.format('%.0f', seq)
redis.call('HSET', KEYS[1], 'seq', last, 'tmin', tmin, 'tmax', tmax)
redis.call('SPUBLISH', KEYS[1] .. ':feed', last)
return last
"""

# KEYS: Q:dir, Q:cl (hash: seq -> "<claim id> <claim expires> <count>", only
# claimed messages). ARGV: now ms (13 digits), segment key prefix, marker
# ('' = the head), limit, client, echo, include_claimed, include_delayed,
# scan limit. Returns {next marker, then per message: id, fields}.
LIST = """
local now, prefix, marker = ARGV[1], ARGV[2], ARGV[3]
local limit, client = tonumber(ARGV[4]), ARGV[5]
local echo, with_claimed, with_delayed = ARGV[6] == '1', ARGV[7] == '1', ARGV[8] == '1'
local scan_limit = tonumber(ARGV[9])
local seg, start
if marker == '' then
  seg, start = redis.call('ZRANGE', KEYS[1], 0, 0)[1], '-'
else
  seg, start = math.floor(tonumber(marker) / SEGMENT), '(' .. marker .. '-0'
end
local claims = redis.call('HLEN', KEYS[2]) > 0
local out, count, scanned, last = {''}, 0, 0, nil
while seg and count < limit and scanned < scan_limit do
  local want = math.min(limit - count + 2, scan_limit - scanned)
  local entries = redis.call('XRANGE', prefix .. seg, start, '+', 'COUNT', want)
  local held = nil
  if claims and #entries > 0 then
    local ids = {}
    for k, entry in ipairs(entries) do ids[k] = string.sub(entry[1], 1, -3) end
    held = redis.call('HMGET', KEYS[2], unpack(ids))
  end
  for k, entry in ipairs(entries) do
    local f = entry[2]
    scanned = scanned + 1
    last = entry[1]
    -- e t d u g b: expires, ttl, due, author, tag, body
    if f[2] > now and (echo or f[8] ~= client) and (with_delayed or f[6] <= now) then
      local shown = true
      if held and held[k] and not with_claimed then
        shown = string.match(held[k], ' (%d+) ') <= now
      end
      if shown then
        count = count + 1
        out[#out + 1] = entry[1]
        out[#out + 1] = f
        if count == limit then break end
      end
    end
  end
  if count < limit and #entries < want then
    seg = redis.call('ZRANGE', KEYS[1], '(' .. seg, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
    start = '-'
  elseif last then
    start = '(' .. last
  end
end
if last then out[1] = string.sub(last, 1, -3) end
return out
"""

# KEYS: Q:q, Q:dir, Q:sx. ARGV: now ms, segment key prefix. Looks at the
# segment whose time has come, if any: drops it when nothing in it lives
# (Redis may have done so already), else rewrites it in place with the live
# entries only. Bounded: one segment (<= SEGMENT entries) a call. Returns
# {segment or '', entries dropped, entries kept}; Q:q's "gone" counts what
# expired (live = posted - gone).
SWEEP = """
local now = tonumber(ARGV[1])
local prefix = ARGV[2]
local seg = redis.call('ZRANGE', KEYS[3], '-inf', now, 'BYSCORE', 'LIMIT', 0, 1)[1]
if not seg then return {'', 0, 0} end
local key = prefix .. seg
local entries = redis.call('XRANGE', key, '-', '+')
local live, top, low = {}, 0, nil
for _, entry in ipairs(entries) do
  local e = tonumber(entry[2][2])
  if e > now then
    live[#live + 1] = entry
    if e > top then top = e end
    if not low or e < low then low = e end
  end
end
local tail = math.floor(tonumber(redis.call('HGET', KEYS[1], 'seq')) / SEGMENT)
redis.call('HINCRBY', KEYS[1], 'gone', #entries - #live)
redis.call('ZREM', KEYS[3], seg)
if #live == #entries and #live > 0 then
  if top - low > SPREAD_MS then
    redis.call('ZADD', KEYS[3], low + REVIEW_AFTER_MS, seg)
  end
  return {seg, 0, #live}
end
redis.call('DEL', key)
if #live == 0 then
  if tonumber(seg) ~= tail then redis.call('ZREM', KEYS[2], seg) end
  return {seg, #entries, 0}
end
for _, entry in ipairs(live) do
  redis.call('XADD', key, entry[1], unpack(entry[2]))
end
redis.call('PEXPIREAT', key, top)
if tonumber(seg) == tail then
  redis.call('HSET', KEYS[1], 'tmin', low, 'tmax', top)
end
if top - low > SPREAD_MS then
  redis.call('ZADD', KEYS[3], low + REVIEW_AFTER_MS, seg)
elseif tonumber(seg) ~= tail then
  redis.call('ZADD', KEYS[3], top, seg)
end
return {seg, #entries - #live, #live}
"""


# -- the packed layout: a segment is one string -----------------------------------
#
# Q:p:<seq // SEGMENT>: SEGMENT slots of 4 bytes (big-endian offset of the
# message's record in this string, 0 = none or gone), then the records,
# appended. A record: expires ms (13 digits), due ms (13), ttl s (7), the
# author's 16 bytes, the body; it ends where the next live slot's record
# starts (or the string ends). Closed segments are copied once to fit.

# KEYS: Q:q, Q:dir, Q:sx. ARGV: now ms, key prefix, author (16 bytes), then
# per message ttl s, delay s, body. Returns the last seq.
PACKED_POST = """
local now = tonumber(ARGV[1])
local prefix, author = ARGV[2], ARGV[3]
local q = redis.call('HMGET', KEYS[1], 'seq', 'tmin', 'tmax')
local seq = tonumber(q[1]) or now * 1000
local tmin, tmax = tonumber(q[2]) or 0, tonumber(q[3]) or 0
local tail = math.floor(seq / SEGMENT)
local SN = string.sub(KEYS[1], 1, -3) .. ':sn'  -- segment -> its messages (see SWEEP)
local spread, raised = false, false
-- a call's records for one segment: one APPEND, one SETRANGE of their slots
local records, offsets, first, pending = {}, {}, nil, 0
local function flush()
  if not first then return end
  local key = prefix .. tail
  local data = table.concat(records)
  local at = redis.call('APPEND', key, data) - #data
  if at == 0 then  -- a new segment: its slots first
    redis.call('SET', key, string.rep('\\0', SEGMENT * 4) .. data)
    at, raised = SEGMENT * 4, true
  end
  for j = 1, #offsets do offsets[j] = struct.pack('>I4', at + offsets[j]) end
  redis.call('SETRANGE', key, first * 4, table.concat(offsets))
  if raised then redis.call('PEXPIREAT', key, tmax) end
  records, offsets, first, pending, raised = {}, {}, nil, 0, false
end
if #ARGV == 6 and math.floor((seq + 1) / SEGMENT) == tail and tmax > 0 then
  -- one message into the open segment: the short way, no tables
  seq = seq + 1
  local ttl, delay = tonumber(ARGV[4]), tonumber(ARGV[5])
  local expires = now + ttl * 1000
  local due = 0
  if delay > 0 then due = now + delay * 1000 end
  local key = prefix .. tail
  local record = string.format('%013d%013d%07d', expires, due, ttl) .. author .. ARGV[6]
  local at = redis.call('APPEND', key, record) - #record
  if at == 0 then  -- the segment expired whole meanwhile: its slots first
    redis.call('SET', key, string.rep('\\0', SEGMENT * 4) .. record)
    at, tmax, tmin = SEGMENT * 4, 0, expires
  end
  redis.call('SETRANGE', key, (seq - tail * SEGMENT) * 4, struct.pack('>I4', at))
  if expires > tmax then
    redis.call('PEXPIREAT', key, expires)
    tmax = expires
  end
  if expires < tmin then tmin = expires end
  if tmax - tmin > SPREAD_MS then
    redis.call('ZADD', KEYS[3], 'LT', tmin + REVIEW_AFTER_MS, tail)
  end
  local last = string.format('%.0f', seq)
  redis.call('HSET', KEYS[1], 'seq', last, 'tmin', tmin, 'tmax', tmax)
  redis.call('SPUBLISH', KEYS[1] .. ':feed', last)
  return last
end
for i = 4, #ARGV, 3 do
  seq = seq + 1
  local k = math.floor(seq / SEGMENT)
  if k ~= tail or tmax == 0 then
    flush()
    if tmax > 0 then
      -- the closed segment, copied to fit (APPEND left room to grow)
      local old = prefix .. tail
      local v = redis.call('GET', old)
      if v then
        redis.call('SET', old, v, 'KEEPTTL')
        local n = 0
        for j = 0, SEGMENT - 1 do
          if struct.unpack('>I4', v, j * 4 + 1) > 0 then n = n + 1 end
        end
        redis.call('HSET', SN, tail, n)
      end
      redis.call('ZADD', KEYS[3], 'LT', tmax, tail)
    end
    redis.call('ZADD', KEYS[2], k, k)
    -- open: minus the seqs of this segment before the first posted to it
    redis.call('HSET', SN, k, -(seq - k * SEGMENT))
    tail, tmin, tmax = k, 0, 0
  end
  local ttl, delay = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local expires = now + ttl * 1000
  local due = 0
  if delay > 0 then due = now + delay * 1000 end
  local record = string.format('%013d%013d%07d', expires, due, ttl) .. author .. ARGV[i + 2]
  if not first then first = seq - k * SEGMENT end
  offsets[#offsets + 1] = pending
  records[#records + 1] = record
  pending = pending + #record
  if expires > tmax then tmax, raised = expires, true end
  if tmin == 0 or expires < tmin then tmin = expires end
  if tmax - tmin > SPREAD_MS then spread = true end
end
flush()
if spread then redis.call('ZADD', KEYS[3], 'LT', tmin + REVIEW_AFTER_MS, tail) end
local last = string.format('%.0f', seq)
redis.call('HSET', KEYS[1], 'seq', last, 'tmin', tmin, 'tmax', tmax)
redis.call('SPUBLISH', KEYS[1] .. ':feed', last)
return last
"""

# KEYS: Q:dir, Q:cl. ARGV as LIST's, the client being its 16 bytes. Returns
# {next marker, then per message: seq, record}.
PACKED_LIST = """
local now, prefix, marker = ARGV[1], ARGV[2], ARGV[3]
local limit, author = tonumber(ARGV[4]), ARGV[5]
local echo, with_claimed, with_delayed = ARGV[6] == '1', ARGV[7] == '1', ARGV[8] == '1'
local scan_limit = tonumber(ARGV[9])
local from
if marker == '' then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not first then return {''} end
  from = tonumber(first) * SEGMENT
else
  from = tonumber(marker) + 1
end
local claims = redis.call('HLEN', KEYS[2]) > 0
local out, count, scanned, last = {''}, 0, 0, nil
local k = math.floor(from / SEGMENT)
while k and count < limit and scanned < scan_limit do
  local key = prefix .. k
  local i = from - k * SEGMENT  -- the first slot to read
  local want = math.min(limit - count + 2, scan_limit - scanned, SEGMENT - i)
  -- the slots wanted and one more (where the last record ends), if any
  local slots = redis.call('GETRANGE', key, i * 4, (i + math.min(want + 1, SEGMENT - i)) * 4 - 1)
  local offsets, seqs = {}, {}
  for j = 1, #slots / 4 do
    local at = struct.unpack('>I4', slots, j * 4 - 3)
    if at > 0 then
      offsets[#offsets + 1] = at
      seqs[#seqs + 1] = k * SEGMENT + i + j - 1
    end
  end
  local n = #offsets
  if n > want then n = want end
  local held = nil
  if claims and n > 0 then
    local ids = {}
    for j = 1, n do ids[j] = string.format('%.0f', seqs[j]) end
    held = redis.call('HMGET', KEYS[2], unpack(ids))
  end
  if n > 0 then
    local upto = -1
    if offsets[n + 1] then upto = offsets[n + 1] - 1 end
    local chunk = redis.call('GETRANGE', key, offsets[1], upto)
    local base = offsets[1] - 1
    for j = 1, n do
      local finish = #chunk
      if j < n or offsets[n + 1] then finish = (offsets[j + 1] or (upto + 1)) - 1 - base end
      local r = string.sub(chunk, offsets[j] - base, finish)
      scanned = scanned + 1
      last = seqs[j]
      if string.sub(r, 1, 13) > now and (with_delayed or string.sub(r, 14, 26) <= now)
          and (echo or string.sub(r, 34, 49) ~= author) then
        local shown = true
        if held and held[j] and not with_claimed then
          shown = string.match(held[j], ' (%d+) ') <= now
        end
        if shown then
          count = count + 1
          out[#out + 1] = string.format('%.0f', seqs[j])
          out[#out + 1] = r
          if count == limit then break end
        end
      end
    end
  end
  if count < limit and (i + want >= SEGMENT or #slots == 0) then
    local nxt = redis.call('ZRANGE', KEYS[1], '(' .. k, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
    if nxt then
      k = tonumber(nxt)
      from = k * SEGMENT
    else
      k = nil
    end
  else
    from = k * SEGMENT + i + want
  end
end
if last then out[1] = string.format('%.0f', last) end
return out
"""

# The thin read: no filtering in Redis. KEYS: Q:dir, Q:cl. ARGV: key prefix,
# the first seq wanted ('' = the head), how many slots. Returns {the
# segment's first seq, the first slot read, the slots (4 bytes each; the
# last one read only to find where the records end), the records as one
# string from the first live slot's, the claims of those slots (seq
# "<claim id> <expires> <count>" pairs; only if the queue has claims)}, or
# {} at the end of the feed. The process splits and filters (expiry, echo,
# delay, claims) and asks again if the page is not full.
PACKED_READ = """
local prefix, want = ARGV[1], tonumber(ARGV[3])
local from
if ARGV[2] == '' then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not first then return {} end
  from = tonumber(first) * SEGMENT
else
  from = tonumber(ARGV[2])
end
local k = math.floor(from / SEGMENT)
for _ = 1, 4 do
  local key = prefix .. k
  local i = from - k * SEGMENT
  local n = math.min(want, SEGMENT - i)
  local slots = redis.call('GETRANGE', key, i * 4, (i + math.min(n + 1, SEGMENT - i)) * 4 - 1)
  local first, upto = nil, -1
  for j = 1, math.min(n, #slots / 4) do
    first = struct.unpack('>I4', slots, j * 4 - 3)
    if first > 0 then break end
  end
  if first and first > 0 then
    if #slots > n * 4 then
      upto = struct.unpack('>I4', slots, n * 4 + 1) - 1
      if upto < 0 then upto = -1 end
    end
    local out = {string.format('%.0f', k * SEGMENT), i, slots,
      redis.call('GETRANGE', key, first, upto)}
    if redis.call('HLEN', KEYS[2]) > 0 then
      local ids = {}
      for j = 0, n - 1 do ids[j + 1] = string.format('%.0f', from + j) end
      local held = redis.call('HMGET', KEYS[2], unpack(ids))
      for j = 1, n do
        if held[j] then out[#out + 1] = ids[j]; out[#out + 1] = held[j] end
      end
    end
    return out
  end
  if #slots > 0 and i + n < SEGMENT then
    from = from + n  -- only gone slots here: on in this segment
  else
    local nxt = redis.call('ZRANGE', KEYS[1], '(' .. k, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
    if not nxt then return {} end
    k = tonumber(nxt)
    from = k * SEGMENT
  end
end
return {'', from}
"""

# KEYS: Q:q, Q:dir, Q:sx. ARGV: now ms, key prefix. SWEEP's work on a packed
# segment: its live records copied into a string of their own (slots kept).
PACKED_SWEEP = """
local now = ARGV[1]
local prefix = ARGV[2]
local seg = redis.call('ZRANGE', KEYS[3], '-inf', now, 'BYSCORE', 'LIMIT', 0, 1)[1]
if not seg then return {'', 0, 0} end
local key = prefix .. seg
local v = redis.call('GET', key) or ''
local at, live, total, top, low = {}, {}, 0, 0, nil
for j = 0, math.min(SEGMENT, #v / 4) - 1 do
  local o = struct.unpack('>I4', v, j * 4 + 1)
  if o > 0 then at[#at + 1] = {j, o} end
end
local parts, size, slots = {}, SEGMENT * 4, {}
for x = 1, #at do
  local j, o = at[x][1], at[x][2]
  local finish = #v
  if at[x + 1] then finish = at[x + 1][2] end
  local r = string.sub(v, o + 1, finish)
  total = total + 1
  local e = string.sub(r, 1, 13)
  if e > now then
    live[#live + 1] = j
    parts[#parts + 1] = r
    slots[j] = size
    size = size + #r
    local n = tonumber(e)
    if n > top then top = n end
    if not low or n < low then low = n end
  end
end
local last = tonumber(redis.call('HGET', KEYS[1], 'seq'))
local tail = math.floor(last / SEGMENT)
if v == '' then
  -- Redis dropped it whole: how many it held, from SN (the open segment's
  -- from the counter: SN holds minus the seqs before its first)
  local SN = string.sub(KEYS[1], 1, -3) .. ':sn'
  total = tonumber(redis.call('HGET', SN, seg) or 0)
  if tonumber(seg) == tail then total = total + last - tail * SEGMENT + 1 end
end
redis.call('HINCRBY', KEYS[1], 'gone', total - #live)
redis.call('ZREM', KEYS[3], seg)
local SN = string.sub(KEYS[1], 1, -3) .. ':sn'
if tonumber(seg) ~= tail then
  if #live > 0 then redis.call('HSET', SN, seg, #live) else redis.call('HDEL', SN, seg) end
end
if #live == 0 then
  redis.call('DEL', key)
  if tonumber(seg) ~= tail then redis.call('ZREM', KEYS[2], seg) end
  return {seg, total, 0}
end
if #live < total then
  local table_ = {}
  for j = 0, SEGMENT - 1 do table_[j + 1] = struct.pack('>I4', slots[j] or 0) end
  redis.call('SET', key, table.concat(table_) .. table.concat(parts), 'PXAT', top)
end
if tonumber(seg) == tail then
  redis.call('HSET', KEYS[1], 'tmin', low, 'tmax', top)
end
if top - low > SPREAD_MS then
  redis.call('ZADD', KEYS[3], low + REVIEW_AFTER_MS, seg)
elseif tonumber(seg) ~= tail then
  redis.call('ZADD', KEYS[3], top, seg)
end
return {seg, total - #live, #live}
"""


def _prelude() -> str:
    return (
        f"local SEGMENT = {SEGMENT}\nlocal SPREAD_MS = {SPREAD_MS}\n"
        f"local REVIEW_AFTER_MS = {REVIEW_AFTER_MS}\n"
    )


class Layout:
    """One queue in the proposed layout, and its scripts."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        tag = "fs:{bench/" + name + "}"
        self.keys = [tag + ":q", tag + ":dir", tag + ":sx"]
        self.claims = tag + ":cl"
        self.prefix = tag + ":g:"
        self.post_sha = client.script_load(_prelude() + POST)
        self.list_sha = client.script_load(_prelude() + LIST)
        self.sweep_sha = client.script_load(_prelude() + SWEEP)

    def post_args(self, messages: Sequence[tuple[int, int, bytes]], client: str) -> list[Any]:
        args: list[Any] = [int(time.time() * 1000), self.prefix, client]
        for ttl, delay, data in messages:
            args += [ttl, delay, os.urandom(5).hex(), data]
        return args

    def post(self, batches: Sequence[Sequence[tuple[int, int, bytes]]], per_trip: int,
             client: str = PRODUCER) -> None:  # fmt: skip
        """Each batch one EVALSHA, per_trip of them a round trip."""
        for first in range(0, len(batches), per_trip):
            pipe = self.client.pipeline(transaction=False)
            for batch in batches[first : first + per_trip]:
                pipe.evalsha(self.post_sha, 3, *self.keys, *self.post_args(batch, client))
            pipe.execute()

    def page_all(self, query: Sequence[str] = ("0", "0", "0")) -> tuple[int, int]:
        """Follow the markers from the head: (pages, messages shown)."""
        marker, pages, shown = "", 0, 0
        while True:
            now = str(int(time.time() * 1000))
            reply = self.client.evalsha(self.list_sha, 2, self.keys[1], self.claims, now,
                                        self.prefix, marker, PAGE, self.list_client(), *query,
                                        200)  # fmt: skip
            pages += 1
            got = (len(reply) - 1) // 2
            shown += got
            if got == 0:
                return pages, shown
            marker = reply[0].decode()

    def list_client(self) -> str | bytes:
        return READER

    def sweep(self) -> list[Any]:
        now = int(time.time() * 1000)
        return list(self.client.evalsha(self.sweep_sha, 3, *self.keys, now, self.prefix))


class PackedLayout(Layout):
    """One queue in the packed layout: segments are strings."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        super().__init__(client, name)
        self.prefix = self.prefix.replace(":g:", ":p:")
        self.post_sha = client.script_load(_prelude() + PACKED_POST)
        self.list_sha = client.script_load(_prelude() + PACKED_LIST)
        self.sweep_sha = client.script_load(_prelude() + PACKED_SWEEP)
        self.read_sha = client.script_load(_prelude() + PACKED_READ)
        self.reader: bytes = uuid.UUID(READER).bytes

    def page_thin(self, marker: str, query: Sequence[str]) -> tuple[str, int]:
        """One page through PACKED_READ, split and filtered here, as the
        process would: (next marker or '', messages shown)."""
        echo, with_claimed, with_delayed = (q == "1" for q in query)
        now = b"%013d" % int(time.time() * 1000)
        start = "" if marker == "" else str(int(marker) + 1)
        shown, last, calls, want = 0, "", 0, PAGE + 2
        while shown < PAGE and calls < 8:
            calls += 1
            reply = self.client.evalsha(self.read_sha, 2, self.keys[1], self.claims,
                                        self.prefix, start, want)  # fmt: skip
            if not reply:
                break
            if reply[0] == b"":
                start = str(int(reply[1]))
                continue
            base, i, slots, chunk = int(reply[0]), int(reply[1]), reply[2], reply[3]
            held = dict(zip(reply[4::2], reply[5::2], strict=True))
            offsets = [int.from_bytes(slots[j : j + 4]) for j in range(0, len(slots), 4)]
            live = [(base + i + j, o) for j, o in enumerate(offsets[:want]) if o]
            first = live[0][1]
            seq = base + i
            for seq, at in live:
                end = next((e for e in offsets[seq - base - i + 1 :] if e), 0)
                record = chunk[at - first : (end - first) if end else None]
                last = str(seq)
                claim = held.get(str(seq).encode())
                if (
                    record[:13] > now
                    and (with_delayed or record[13:26] <= now)
                    and (echo or record[33:49] != self.reader)
                    and (with_claimed or not claim or claim.split()[1] <= now)
                ):
                    shown += 1
                    if shown == PAGE:
                        break
            start = str(seq + 1)
            # filters left the page short: ask for more at once next time
            want = min(SEGMENT, 4 * (PAGE - shown) + 2)
        return last, shown

    def page_all_thin(self, query: Sequence[str] = ("0", "0", "0")) -> tuple[int, int]:
        marker, pages, seen = "", 0, 0
        while True:
            marker_next, shown = self.page_thin(marker, query)
            pages += 1
            seen += shown
            if shown == 0:
                return pages, seen
            marker = marker_next

    def post_args(self, messages: Sequence[tuple[int, int, bytes]], client: str) -> list[Any]:
        args: list[Any] = [int(time.time() * 1000), self.prefix, uuid.UUID(client).bytes]
        for ttl, delay, data in messages:
            args += [ttl, delay, data]
        return args

    def list_client(self) -> str | bytes:
        return self.reader


def messages(n: int, size: int, ttl: int = TTL) -> list[tuple[int, int, bytes]]:
    return [(ttl, 0, orjson.dumps(body(i, size))) for i in range(n)]


def run(n: int, reclaim: int, out: Callable[[str, dict[str, Any]], None]) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="feedsvc-layout-"))
    server = RedisServer(workdir / "redis", appendonly=False)
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        out("redis", {"version": client.info("server")["redis_version"], "segment": SEGMENT})
        for kind in (PackedLayout, Layout):
            client.flushall()
            label = "packed" if kind is PackedLayout else "streams"
            for name, values in costs(client, kind, n):
                out(f"{label}: {name}", values)
            client.flushall()
            out(f"{label}: expiry reclaim", expiry(client, kind, reclaim))
    finally:
        client.close()
        server.stop()


def costs(client: redis.Redis, kind: type[Layout], n: int) -> list[tuple[str, dict[str, Any]]]:
    """Each figure of the proposed layout (kind) against a stream's."""
    rows = []
    # the first writes of a run cost Redis memory once (≈ 0.3 MB); not the messages'
    kind(client, "warm").post([[m] for m in messages(300, BODY_BYTES)], PIPELINE)
    xadd_all(client, "bench:warm", BODY_BYTES, 300, PIPELINE)
    ours = kind(client, "q")
    ours.post([messages(1, BODY_BYTES)], 1)  # the queue's keys exist before
    one = [[m] for m in messages(n, BODY_BYTES)]
    post = measure(client, lambda: ours.post(one, PIPELINE))
    stream = measure(client, lambda: xadd_all(client, "bench:stream", BODY_BYTES, n, PIPELINE))
    read: list[tuple[int, int]] = []
    page = measure(client, lambda: read.append(ours.page_all()))
    xpages: list[int] = []
    xpage = measure(client, lambda: xpages.append(xrange_all(client, "bench:stream")))
    xpage_us = xpage.cpu_us / xpages[0]
    rows.append(("memory per message (100 B), bytes", {
        "proposed": post.memory / n, "stream": stream.memory / n,
        "ratio": post.memory / stream.memory}))  # fmt: skip
    rows.append(("Redis CPU per 1-message post, us", {
        "proposed": post.cpu_us / n, "stream": stream.cpu_us / n,
        "ratio": post.cpu_us / stream.cpu_us,
        "evalsha_us": post.commands.get("evalsha", (0, 0.0))[1],
        "xadd_us": stream.commands.get("xadd", (0, 0.0))[1]}))  # fmt: skip
    rows.append(("Redis CPU per page of 10, us", {
        "proposed": page.cpu_us / read[0][0], "stream": xpage_us,
        "ratio": page.cpu_us / read[0][0] / xpage_us,
        "pages": read[0][0], "seen": read[0][1]}))  # fmt: skip
    if isinstance(ours, PackedLayout):
        thin: list[tuple[int, int]] = []
        cost = measure(client, lambda: thin.append(ours.page_all_thin()))
        rows.append(("Redis CPU per page of 10, thin read, us", {
            "proposed": cost.cpu_us / thin[0][0], "stream": xpage_us,
            "ratio": cost.cpu_us / thin[0][0] / xpage_us,
            "pages": thin[0][0], "seen": thin[0][1]}))  # fmt: skip
    batches = max(1, n // BATCH)
    hundred = [messages(BATCH, BODY_BYTES) for _ in range(batches)]
    ours_b = kind(client, "b")
    batch = measure(client, lambda: ours_b.post(hundred, 1))
    xbatch = measure(
        client, lambda: xadd_all(client, "bench:sb", BODY_BYTES, batches * BATCH, BATCH)
    )
    rows.append(("Redis CPU per batch of 100, us", {
        "proposed": batch.cpu_us / batches, "stream": xbatch.cpu_us / batches,
        "ratio": batch.cpu_us / xbatch.cpu_us,
        "ceiling_msgs_per_s": 100e6 / (batch.cpu_us / batches),
        "stream_ceiling_msgs_per_s": 100e6 / (xbatch.cpu_us / batches)}))  # fmt: skip
    rows.append(("worst page", worst(client, kind, n // 4, xpage_us)))
    for size in BIG_BODIES:
        rows.append((f"memory per message ({size // 1024} KiB), bytes",
                     big(client, kind, size, n // 10)))  # fmt: skip
    return rows


def big(client: redis.Redis, kind: type[Layout], size: int, count: int) -> dict[str, Any]:
    ours = kind(client, f"k{size}")
    ours.post([messages(1, size)], 1)
    one = [[m] for m in messages(count, size)]
    mine = measure(client, lambda: ours.post(one, PIPELINE))
    theirs = measure(client, lambda: xadd_all(client, f"bench:s{size}", size, count, PIPELINE))
    return {"proposed": mine.memory / count, "stream": theirs.memory / count,
            "ratio": mine.memory / theirs.memory}  # fmt: skip


def worst(client: redis.Redis, kind: type[Layout], count: int, xrange_us: float) -> dict[str, Any]:
    """The reader's own messages, every other one delayed, an eighth
    claimed; read with echo and include_claimed."""
    ours = kind(client, "w")
    batch = [(TTL, 900 if i % 2 else 0, orjson.dumps(body(i, BODY_BYTES))) for i in range(count)]
    ours.post([[m] for m in batch], PIPELINE, client=READER)
    far = int(time.time() * 1000) + 3_600_000
    first = int(client.hget(ours.keys[0], "seq") or 0) - count + 1

    claimed = {str(first + i): f"c{i:023x} {far} 1" for i in range(0, count, 8)}
    client.hset(ours.claims, mapping=claimed)  # type: ignore[arg-type]
    read: list[tuple[int, int]] = []
    cost = measure(client, lambda: read.append(ours.page_all(("1", "1", "0"))))
    per_page = cost.cpu_us / read[0][0]
    out = {"proposed_us": per_page, "stream_us": xrange_us, "ratio": per_page / xrange_us,
           "pages": read[0][0], "shown": read[0][1]}  # fmt: skip
    if isinstance(ours, PackedLayout):
        thin: list[tuple[int, int]] = []
        packed = ours
        cost = measure(client, lambda: thin.append(packed.page_all_thin(("1", "1", "0"))))
        out["thin_us"] = cost.cpu_us / thin[0][0]
        out["thin_ratio"] = out["thin_us"] / xrange_us
        out["thin_pages"], out["thin_shown"] = thin[0]
    return out


def expiry(client: redis.Redis, kind: type[Layout], m: int) -> dict[str, Any]:
    """m messages of 2 and 5 s behind a 14-day one, and one 14-day message in
    every 50 among them; once they are past their ttl, the sweep called as
    processes would (again at once while it finds work, else every 0.2 s)
    until only the long-lived ones' reviews are left (120 s at most)."""
    ours = kind(client, "x")
    ours.post([messages(1, BODY_BYTES, ttl=1)], 1)
    time.sleep(1.1)
    start = used_memory(client)
    ours.post([messages(1, BODY_BYTES, ttl=1209600)], 1)
    mixed = [
        (1209600 if i % 50 == 49 else (2, 5)[i % 2], 0, orjson.dumps(body(i, BODY_BYTES)))
        for i in range(m)
    ]
    ours.post([mixed[i : i + BATCH] for i in range(0, m, BATCH)], 8)
    peak = used_memory(client)
    long_lived = 1 + m // 50
    time.sleep(5.2)
    expired = time.monotonic()
    calls, busiest, swept_s = 0, 0.0, 0.0
    while time.monotonic() - expired < 120:
        t0 = time.perf_counter()
        got = ours.sweep()
        busiest = max(busiest, time.perf_counter() - t0)
        calls += 1
        if got[0] not in (b"", ""):
            swept_s = time.monotonic() - expired  # the last review that had work
        else:
            nxt = client.zrange(ours.keys[2], 0, 0, withscores=True)
            if not nxt or float(nxt[0][1]) > time.time() * 1000 + 120_000:
                break  # only the long-lived ones' are left
            time.sleep(0.2)
    end = used_memory(client)
    per_entry = (peak - start) / (m + 1)
    return {
        "messages": m, "long_lived": long_lived, "start_bytes": start, "peak_bytes": peak,
        "end_bytes": end, "end_over_start_pct": 100 * (end - start) / start,
        "held_beyond_long_lived_pct": 100 * (end - start - long_lived * per_entry) / (peak - start),
        "sweep_calls": calls, "last_review_s_after_expiry": swept_s,
        "longest_call_ms": 1000 * busiest, "gone": int(client.hget(ours.keys[0], "gone") or 0),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.storage_layout", description=__doc__)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--reclaim", type=int, default=20000)
    args = parser.parse_args(argv)

    def out(name: str, values: dict[str, Any]) -> None:
        shown = {k: f"{v:.2f}" if isinstance(v, float) and not math.isnan(v) else v
                 for k, v in values.items()}  # fmt: skip
        print(f"{name:<36} " + "  ".join(f"{k}={v}" for k, v in shown.items()), flush=True)

    run(args.messages, args.reclaim, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
