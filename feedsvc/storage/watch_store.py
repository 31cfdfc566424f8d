"""The watch driver: WATCH / MULTI / EXEC with bounded, jittered retries.

No server-side scripting at all, so that it measures what the lua driver
buys. Each write is the classic optimistic transaction, done in the fewest
round trips the protocol allows: ``WATCH`` and the reads travel in one
write, ``MULTI ... EXEC`` in a second. A conflicting transaction makes EXEC
answer nil; the attempt is counted in ``counters.watch_retries`` and repeated
after a jittered backoff, at most ``watch_retries`` times, then the request
gets a 503. A transaction that was not executed wrote nothing, so retrying it
cannot write twice.

Transactions run on a connection taken from the pool directly; a connection
whose conversation was interrupted (error, timeout, cancelled request) is
closed, never returned with unread replies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from feedsvc.errors import InvalidClaim, MessageIsClaimed, PayloadTooLarge
from feedsvc.storage.base import (
    Claim,
    ListQuery,
    Message,
    MessagePage,
    NewMessage,
    reserved_fields,
)
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys, registry_key
from feedsvc.storage.redis_store import (
    MESSAGE_FIELDS,
    Conflicted,
    Parked,
    Plan,
    RedisStore,
    forget_commands,
    idempotency_token,
    message_from_fields,
    new_id,
    parse_seq,
    text,
)

GC_BATCH = 100
DROP_BATCH = 500


def gc_commands(keys: QueueKeys, dead: Sequence[bytes], now: int) -> list[Command]:
    """The writes that forget expired messages and claims (see _lib.lua)."""
    commands = forget_commands(keys, dead) if dead else []
    commands.append(("ZREMRANGEBYSCORE", keys.claimed, "-inf", now))
    commands.append(("ZREMRANGEBYSCORE", keys.claims, "-inf", now))
    return commands


class WatchStore(RedisStore):
    name = "watch"

    async def create_queue(self, project: str, queue: str, metadata: dict[str, Any]) -> bool:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
            if replies[1]:
                return None, False
            fields = [item for pair in reserved_fields(metadata).items() for item in pair]
            return [("HSET", keys.meta, "c", now, "m", orjson.dumps(metadata), *fields)], True

        registry = await self._registry_add(project, queue)
        async with self._slot():
            return await self._optimistic([keys.meta], [registry, ("EXISTS", keys.meta)], plan)

    async def delete_queue(self, project: str, queue: str) -> None:
        await self._call_checked([("ZREM", registry_key(project), queue)])
        await self._drop(QueueKeys.of(project, queue), keep_queue=False)

    async def purge_queue(self, project: str, queue: str) -> None:
        await self._drop(QueueKeys.of(project, queue), keep_queue=True)

    async def _drop(self, keys: QueueKeys, keep_queue: bool) -> None:
        """Delete messages and claims in batches, then the queue's own keys."""
        while True:
            [ids] = await self._call_checked([("ZRANGE", keys.index, 0, DROP_BATCH - 1)])
            if not ids:
                break
            await self._transaction(forget_commands(keys, ids))
        while True:
            [claims] = await self._call_checked([("ZRANGE", keys.claims, 0, DROP_BATCH - 1)])
            if not claims:
                break
            await self._transaction(
                [("DEL", *(keys.claim(text(c)) for c in claims)), ("ZREM", keys.claims, *claims)]
            )
        kept = {keys.meta, keys.seq, keys.idempotency} if keep_queue else set()
        everything = [*keys.fixed(), keys.idempotency]
        await self._call_checked([("DEL", *(k for k in everything if k not in kept))])

    async def post_messages(
        self,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int = 0,
        idempotency_key: str | None = None,
    ) -> list[str]:
        keys = QueueKeys.of(project, queue)
        ids = [new_id() for _ in messages]
        settings = self._settings
        now = self._clock.now_ms()
        token = None if idempotency_key is None else idempotency_token(client_id, idempotency_key)

        def plan(replies: list[Any]) -> tuple[list[Command] | None, list[str]]:
            _, last, exists, (dttl, ddelay, mps), dead = replies[:5]
            forget: list[Any] = []
            if token is not None:
                seen, sample = replies[5], replies[6]
                if seen is not None:
                    until, *first_ids = text(seen).split()
                    if int(until) > now:
                        return None, first_ids
                forget = [
                    field for field, value in pairs(sample) if int(text(value).split()[0]) <= now
                ]
            if mps is not None and request_size > int(mps):
                raise PayloadTooLarge(f"Queue {queue} accepts posts of at most {int(mps)} bytes.")
            default_ttl = int(dttl or settings.default_message_ttl)
            default_delay = int(ddelay or 0)
            seq = int(last) if last is not None else now * 1000
            writes = gc_commands(keys, dead, now)
            if not exists:
                writes.append(("HSET", keys.meta, "c", now))
            for message_id, message in zip(ids, messages, strict=True):
                seq += 1
                ttl = default_ttl if message.ttl is None else message.ttl
                delay = default_delay if message.delay is None else message.delay
                expires = now + ttl * 1000
                due = now + delay * 1000 if delay > 0 else 0
                key = keys.message(message_id)
                writes.append(
                    ("HSET", key, "b", message.body, "u", client_id, "s", seq,
                     "t", ttl, "c", now, "e", expires, "d", due,
                     "k", "", "x", 0, "n", 0)
                )  # fmt: skip
                writes.append(("PEXPIREAT", key, expires))
                writes.append(("ZADD", keys.index, seq, message_id))
                writes.append(("ZADD", keys.expiry, expires, message_id))
            writes.append(("SET", keys.seq, seq))
            if token is not None:
                record = f"{now + settings.idempotency_window * 1000} {' '.join(ids)}"
                writes.append(("HSET", keys.idempotency, token, record))
                if forget:
                    writes.append(("HDEL", keys.idempotency, *forget))
            return writes, ids

        reads: list[Command] = [
            await self._registry_add(project, queue),
            ("GET", keys.seq),
            ("EXISTS", keys.meta),
            ("HMGET", keys.meta, "dttl", "ddelay", "mps"),
            ("ZRANGEBYSCORE", keys.expiry, "-inf", now, "LIMIT", 0, GC_BATCH),
        ]
        watch = [keys.seq, keys.meta]
        if token is not None:
            reads.append(("HGET", keys.idempotency, token))
            reads.append(("HRANDFIELD", keys.idempotency, 5, "WITHVALUES"))
            watch.append(keys.idempotency)
        async with self._slot():
            return await self._optimistic(watch, reads, plan)

    async def list_messages(self, project: str, queue: str, query: ListQuery) -> MessagePage:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
        scan_limit = self._settings.scan_limit
        found: list[Message] = []
        scanned = 0
        last: int | None = None
        start = "-inf" if query.marker is None else f"({query.marker}"
        chunk = query.limit + 2
        while len(found) < query.limit and scanned < scan_limit:
            want = min(chunk, scan_limit - scanned)
            [raw] = await self._call_checked(
                [("ZRANGEBYSCORE", keys.index, start, "+inf", "WITHSCORES", "LIMIT", 0, want)]
            )
            entries = pairs(raw)
            if not entries:
                break
            rows = await self._call_checked(
                [("HMGET", keys.message(text(m)), *MESSAGE_FIELDS, "u", "d") for m, _ in entries]
            )
            for (member, score), row in zip(entries, rows, strict=True):
                scanned += 1
                last = parse_seq(score)
                message = message_from_fields(text(member), row[:-2], now)
                if message is None:
                    continue
                author, due = row[-2], int(row[-1] or 0)
                if not query.echo and author is not None and text(author) == query.client_id:
                    continue
                if not query.include_claimed and message.claim_id is not None:
                    continue
                if not query.include_delayed and due > now:
                    continue
                found.append(message)
                if len(found) == query.limit:
                    break
            if len(entries) < want:
                break
            start = f"({last}"
            chunk = min(chunk * 2, 512)
        next_marker = last if (found or scanned >= scan_limit) else None
        return MessagePage(found, next_marker)

    async def delete_message(
        self, project: str, queue: str, message_id: str, claim_id: str | None
    ) -> None:
        keys = QueueKeys.of(project, queue)
        key = keys.message(message_id)
        now = self._clock.now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, str]:
            holder, claim_expires, seq = replies[0]
            if seq is not None:
                claimed = bool(holder) and int(claim_expires or 0) > now
                if claim_id is None and claimed:
                    return None, "claimed"
                if claim_id is not None and (not claimed or text(holder) != claim_id):
                    return None, "badclaim"
            return [
                ("DEL", key),
                ("ZREM", keys.index, message_id),
                ("ZREM", keys.expiry, message_id),
                ("ZREM", keys.claimed, message_id),
            ], "ok"

        async with self._slot():
            outcome = await self._optimistic([key], [("HMGET", key, "k", "x", "s")], plan)
        if outcome == "claimed":
            raise MessageIsClaimed(
                f"Message {message_id} is claimed; give its claim_id to delete it."
            )
        if outcome == "badclaim":
            raise InvalidClaim(f"Claim {claim_id} does not hold message {message_id} (or expired).")

    async def delete_messages(self, project: str, queue: str, ids: list[str]) -> None:
        if not ids:
            return
        keys = QueueKeys.of(project, queue)
        await self._transaction(forget_commands(keys, list(dict.fromkeys(ids))))

    async def _free_candidates(
        self, keys: QueueKeys, now: int, limit: int, max_claims: int | None = None
    ) -> list[str]:
        """Up to limit messages from the head that nobody holds (read without WATCH).

        With max_claims, messages claimed that often (to be dead-lettered) are
        included too but do not count towards limit.
        """
        found: list[str] = []
        counted = 0
        offset, scanned, budget = 0, 0, self._claim_scan_limit()
        while counted < limit and scanned < budget:
            ids: list[Any] = await self._redis.zrange(keys.index, offset, offset + 99)
            if not ids:
                break
            offset += len(ids)
            pipe = self._redis.pipeline(transaction=False)
            for raw in ids:
                pipe.hmget(keys.message(text(raw)), list(FREE_FIELDS))
            for raw, row in zip(ids, await pipe.execute(), strict=True):
                scanned += 1
                if is_free(row, now):
                    found.append(text(raw))
                    if max_claims is None or int(row[5] or 0) < max_claims:
                        counted += 1
                    if counted == limit:
                        break
        return found

    async def claim_messages(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | None:
        keys = QueueKeys.of(project, queue)
        claim_id = new_id()
        attempt = 0
        async with self._slot():
            while True:
                now = self._clock.now_ms()
                meta: list[Any] = await self._redis.hmget(keys.meta, ["mcc", "dlq", "dlqttl"])
                dlq = text(meta[1]) if meta[0] and meta[1] and text(meta[1]) != queue else None
                max_claims = int(meta[0]) if dlq is not None else None
                candidates = await self._free_candidates(keys, now, limit, max_claims)
                if not candidates:
                    return None
                plan = self._claim_plan(keys, claim_id, now, ttl, grace, candidates, meta, dlq)
                watch = [keys.meta, *(keys.message(i) for i in candidates)]
                reads: list[Command] = [("HMGET", keys.meta, "mcc", "dlq", "dlqttl")]
                reads += [("HMGET", keys.message(i), *CLAIM_FIELDS) for i in candidates]
                done, result = await self._attempt(watch, reads, plan)
                if done and result is not None:
                    break
                await self._backoff(attempt)
                attempt += 1
        claim, parked = result
        if dlq is not None:
            await self._dead_letter(project, queue, dlq, claim_id, parked)
        return claim

    def _claim_plan(
        self,
        keys: QueueKeys,
        claim_id: str,
        now: int,
        ttl: int,
        grace: int,
        candidates: list[str],
        meta: list[Any],
        dlq: str | None,
    ) -> Plan[tuple[Claim | None, list[Parked]]]:
        """The claim transaction; its result is (the claim, the messages parked
        for the dead-letter queue: see RedisStore._dead_letter)."""
        claim_expires = now + ttl * 1000
        keep_until = claim_expires + grace * 1000

        def plan(
            replies: list[Any],
        ) -> tuple[list[Command] | None, tuple[Claim | None, list[Parked]]]:
            if replies[0] != meta:
                raise Conflicted
            rows = replies[1 : 1 + len(candidates)]
            writes: list[Command] = []
            claimed: list[Message] = []
            parked: list[Parked] = []
            for message_id, row in zip(candidates, rows, strict=True):
                body, ttl_s, created, expires, _due, _k, _x, count, author, seq = row
                if not is_free([*row[3:7], seq], now):
                    raise Conflicted
                key = keys.message(message_id)
                n = int(count or 0)
                if dlq is not None and n >= int(meta[0]):
                    # claimed too often: hold it under this claim id, unlisted,
                    # until it is copied to the dead-letter queue
                    dttl = int(meta[2]) if meta[2] else int(ttl_s)
                    parked.append(Parked(message_id, body, author or b"", dttl, n))
                    writes.append(("HSET", key, "k", claim_id, "x", claim_expires))
                    writes.append(("ZADD", keys.claimed, claim_expires, message_id))
                    continue
                keep = max(int(expires), keep_until)
                new_ttl = round((keep - int(created)) / 1000)
                writes.append(
                    ("HSET", key, "k", claim_id, "x", claim_expires, "n", n + 1,
                     "e", keep, "t", new_ttl)
                )  # fmt: skip
                writes.append(("PEXPIREAT", key, keep))
                writes.append(("ZADD", keys.expiry, keep, message_id))
                writes.append(("ZADD", keys.claimed, claim_expires, message_id))
                claimed.append(
                    Message(
                        message_id, parse_seq(seq), body, new_ttl, int(created), claim_id, n + 1
                    )
                )
            if not claimed:
                return writes or None, (None, parked)
            ckey = keys.claim(claim_id)
            ids = " ".join(m.id for m in claimed)
            writes.append(
                ("HSET", ckey, "t", ttl, "g", grace, "c", now, "x", claim_expires, "ids", ids)
            )
            writes.append(("PEXPIREAT", ckey, claim_expires))
            writes.append(("ZADD", keys.claims, claim_expires, claim_id))
            return writes, (Claim(claim_id, ttl, grace, now, claimed), parked)

        return plan

    async def pop_messages(self, project: str, queue: str, limit: int) -> list[Message]:
        keys = QueueKeys.of(project, queue)
        attempt = 0
        async with self._slot():
            while True:
                now = self._clock.now_ms()
                candidates = await self._free_candidates(keys, now, limit)
                if not candidates:
                    return []

                def plan(
                    replies: list[Any], now: int = now, candidates: list[str] = candidates
                ) -> tuple[list[Command] | None, list[Message]]:
                    writes: list[Command] = []
                    popped: list[Message] = []
                    for message_id, row in zip(candidates, replies, strict=True):
                        body, ttl_s, created, _e, _d, _k, _x, _n, _u, seq = row
                        if not is_free([*row[3:7], seq], now):
                            raise Conflicted
                        writes += _forget(keys, message_id)
                        popped.append(
                            Message(message_id, parse_seq(seq), body, int(ttl_s), int(created))
                        )
                    return writes, popped

                watch = [keys.message(i) for i in candidates]
                reads: list[Command] = [
                    ("HMGET", keys.message(i), *CLAIM_FIELDS) for i in candidates
                ]
                done, result = await self._attempt(watch, reads, plan)
                if done:
                    return result or []
                await self._backoff(attempt)
                attempt += 1


# Fields read to decide whether a message is free: e, d, k, x, s.
FREE_FIELDS = ("e", "d", "k", "x", "s", "n")
CLAIM_FIELDS = ("b", "t", "c", "e", "d", "k", "x", "n", "u", "s")


def pairs(reply: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Field/value or member/score pairs: RESP2 answers a flat list, RESP3 a list of pairs."""
    if reply and isinstance(reply[0], list):
        return [(a, b) for a, b in reply]
    return list(zip(reply[::2], reply[1::2], strict=True))


def is_free(row: Sequence[Any], now: int) -> bool:
    """Indexed, alive, due and held by no live claim (row = FREE_FIELDS[:5])."""
    expires, due, holder, claim_expires, seq = row[:5]
    if seq is None or expires is None or int(expires) <= now:
        return False
    if int(due or 0) > now:
        return False
    return not (holder and int(claim_expires or 0) > now)


def _forget(keys: QueueKeys, message_id: str) -> list[Command]:
    return forget_commands(keys, [message_id])
