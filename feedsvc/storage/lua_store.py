"""The lua driver: bodies written by a pipeline, indexed by a cached script.

A POST is one round trip: the pipeline carries the body writes and the
EVALSHA of ``post.lua`` that gives the messages their sequence numbers and
index entries atomically. Scripts are sent by SHA only; when Redis answers
NOSCRIPT (it restarted, or SCRIPT FLUSH ran) the script is loaded and that one
call is repeated. Every script is idempotent for a given message id, so the
repeat cannot index a message twice.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from redis.exceptions import NoScriptError

from feedsvc.errors import (
    InvalidClaim,
    MessageIsClaimed,
    StorageUnavailable,
    Unavailable,
)
from feedsvc.storage import record as r
from feedsvc.storage.base import (
    Claim,
    ListQuery,
    Message,
    MessagePage,
    NewMessage,
    Unclaimable,
    new_id,
    reserved_fields,
)
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.lua_segments import LuaSegments, SegmentPost
from feedsvc.storage.quotas import Reservation
from feedsvc.storage.redis_store import (
    RedisStore,
    idempotency_token,
    marker_not_given_out,
    read_tail_marker,
)
from feedsvc.storage.reviews import STATS_REVIEWS
from feedsvc.storage.scripts import LuaScript, load_script, script_names
from feedsvc.storage.sealing import MAGIC
from feedsvc.storage.segment_pages import MORE, MarkerAhead

log = logging.getLogger("feedsvc")

DROP_BATCH = 500
#: Rounds of pop or claim that ask for sealed bodies to be opened before
#: one takes them: a second round normally suffices (see ``_opening``).
OPENING_ROUNDS = 5


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _indexed(reply: Any, count: int) -> bool:
    """Whether post.lua's reply says it indexed all count messages."""
    return isinstance(reply, list) and len(reply) == count and isinstance(reply[0], int)


class LuaStore(RedisStore):
    name = "lua"

    def _share(self, queues: RedisStore | None) -> None:
        self.segments = LuaSegments(
            self._kind, self._transport, self._settings, self._clock, self._script,
            self._script_reply, self.parts.sweeps,
        )  # fmt: skip

    async def open(self) -> None:
        await super().open()
        try:
            await self.load_scripts()
        except Unavailable as exc:
            # Start anyway: requests answer 503 until Redis is back, and
            # scripts are loaded on first use (NOSCRIPT).
            log.warning("Redis not reachable at startup: %s", exc)

    async def close(self) -> None:
        # the segment posts' combiners (the topic view's too), then the rest
        await self.segments.close()
        if self._topic_view is not None:
            await self._topic_view.segments.close()
        await super().close()

    async def _sweep(self, keys: QueueKeys, most: int) -> tuple[int, int | None]:
        return await self.segments.sweep_due(keys, most)

    async def _live_swept(self, keys: QueueKeys) -> int | None:
        return (await self.segments.sweep(keys, STATS_REVIEWS, True))[2]

    async def load_scripts(self) -> None:
        """Load every script (on every primary of a cluster) so that the
        first calls find them cached."""
        load = [("SCRIPT", "LOAD", load_script(name).source) for name in script_names()]
        await self._transport.on_every_primary(load)

    async def _script(
        self, script: LuaScript, keys: list[str], args: list[Any], idempotent: bool = False
    ) -> Any:
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        [reply] = await self._transport.call([command], idempotent)
        return await self._script_reply(script, keys, args, reply)

    async def _script_reply(
        self, script: LuaScript, keys: list[str], args: list[Any], reply: Any
    ) -> Any:
        """A script's reply; on NOSCRIPT load the script and run that one call again."""
        for _ in range(3):
            if not isinstance(reply, NoScriptError):
                break
            # Load and run again, on the server that owns the keys; a SCRIPT
            # FLUSH can strike between the two, so try a few times, then
            # answer 503 rather than fail.
            self._transport.counters.noscript_reloads += 1
            loaded, reply = await self._transport.call(
                [
                    ("SCRIPT", "LOAD", script.source),
                    ("EVALSHA", script.sha, len(keys), *keys, *args),
                ]
            )
            if isinstance(loaded, Exception):
                async with self._transport.errors():
                    raise loaded
        if isinstance(reply, NoScriptError):
            raise StorageUnavailable("Redis keeps losing its script cache; retry.")
        if isinstance(reply, Exception):
            async with self._transport.errors():
                raise reply
        return reply

    async def create_queue(self, project: str, queue: str, metadata: dict[str, Any]) -> bool:
        keys = self._keys(project, queue)
        await self.quotas.admit(project, self._kind, queue, 0)
        script = load_script("create_queue")
        fixed = keys.fixed()
        args: list[Any] = [self._clock.now_ms(), orjson.dumps(metadata)]
        args += [item for pair in reserved_fields(metadata).items() for item in pair]
        replies = await self._transport.call(
            [
                ("ZADD", self._registry(project), 0, queue),
                ("EVALSHA", script.sha, len(fixed), *fixed, *args),
            ]
        )
        return bool(await self._script_reply(script, fixed, args, replies[-1]))

    async def delete_queue(self, project: str, queue: str) -> None:
        keys = self._keys(project, queue)
        await self._transport.call_checked([("ZREM", self._registry(project), queue)])
        while await self._script(load_script("drop_queue"), keys.fixed(), [DROP_BATCH, "0"]):
            pass
        # a dead-letter queue's redrive and its messages' origins (storage/redrive.py)
        await self._transport.call_checked([("DEL", keys.redrive, keys.origins)])

    async def purge_queue(self, project: str, queue: str) -> None:
        keys = self._keys(project, queue)
        while await self._script(load_script("drop_queue"), keys.fixed(), [DROP_BATCH, "1"]):
            pass
        await self._transport.call_checked([("DEL", keys.origins)])

    async def _post(
        self,
        keys: QueueKeys,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int,
        idempotency_key: str | None,
        sealed: bool,
        held: Reservation | None = None,
    ) -> list[str]:
        post = SegmentPost(keys, project, queue, client_id, messages, request_size, sealed, held)
        if self._settings.storage_layout == "segments":
            posted = await self.segments.post(post, idempotency_key, True)
            if posted is not None:
                return posted
        script = load_script("post")
        ids = [new_id() for _ in messages]
        settings = self._settings
        all_keys = keys.fixed()
        token = "" if idempotency_key is None else idempotency_token(client_id, idempotency_key)
        args: list[Any] = [
            self._clock.now_ms(),
            settings.default_message_ttl,
            0,
            request_size,
            token,
        ]
        args.append(settings.idempotency_window * 1000)
        args.append(_flag(sealed))
        args.append(held.member if held is not None and held.in_script else "")
        commands: list[Command] = []
        # a topic stores a message's group but has no claims to order by it
        grouping = self._kind == "queue"
        for message_id, message in zip(ids, messages, strict=True):
            # Until the script sets the exact expiry, a body that never gets
            # indexed (a crash in between) still expires by itself.
            orphan_ttl = (message.ttl or settings.max_message_ttl) + settings.max_message_delay
            commands += r.body_commands(
                keys,
                message_id,
                client_id,
                message.body,
                orphan_ttl,
                message.headers,
                message.group,
            )
            all_keys.append(keys.record(message_id))
            args += [
                message_id,
                "" if message.ttl is None else message.ttl,
                "" if message.delay is None else message.delay,
                message.group if grouping else "",
            ]
        if held is not None and held.in_script:
            all_keys.append(held.key)
        commands.append(("ZADD", self._registry(project), 0, queue))
        commands.append(("EVALSHA", script.sha, len(all_keys), *all_keys, *args))
        replies = await self._transport.call(commands)
        failed = [reply for reply in replies[:-1] if isinstance(reply, Exception)]
        if failed and not _indexed(replies[-1], len(ids)):
            # checked first: entering errors() costs on every post
            async with self._transport.errors():
                raise failed[0]
        # The script indexes all or nothing, and only bodies it finds: once it
        # has, the post is stored and is answered 201 even if a command beside
        # it failed (a Redis that filled up between the body writes and the
        # registry's ZADD: the next post lists the queue). A 503 here would
        # make the client post the message again.
        seqs = await self._script_reply(script, all_keys, args, replies[-1])
        if seqs and seqs[0] == b"segments":
            # the queue is in segments (another process started them): there it goes
            posted = await self.segments.post(post, idempotency_key, True)
            assert posted is not None
            return posted
        if seqs and seqs[0] == b"replay":
            return [r.text(i) for i in seqs[1:]]
        self.segments.refused(queue, seqs)
        if len(seqs) != len(ids):
            raise StorageUnavailable("Redis lost a message body before indexing it.")
        return ids

    async def tail_marker(self, project: str, queue: str) -> int:
        return await read_tail_marker(self._transport, self._keys(project, queue))

    async def list_messages(self, project: str, queue: str, query: ListQuery) -> MessagePage:
        keys = self._keys(project, queue)
        now = self._clock.now_ms()
        try:
            page = None
            if self._settings.storage_layout == "segments":
                page = await self.segments.page(keys, query, now)
            if page is None:
                page = await self._list(keys, query, now)
        except MarkerAhead:
            assert query.marker is not None
            raise marker_not_given_out(queue, query.marker) from None
        return self._opener.page(page, self._noun, project, queue)

    async def _list(self, keys: QueueKeys, query: ListQuery, now: int) -> MessagePage:
        """list.lua's page, carried on in the segments when it reached them."""
        args = [
            now,
            "" if query.marker is None else query.marker,
            query.limit,
            query.client_id,
            _flag(query.echo),
            _flag(query.include_claimed),
            _flag(query.include_delayed),
            self._settings.scan_limit,
            _flag(query.with_authors),
            _flag(query.check_marker),
            _flag(query.passing),
        ]
        script = load_script("list")  # reads only: may be sent again
        reply = await self._script(script, keys.fixed(), args, idempotent=True)
        if reply[0] == b"ahead":
            raise MarkerAhead
        if reply[0] == MORE:
            return await self.segments.carry_on(keys, reply, query, now)
        return r.list_reply(reply, now, query.with_authors)

    async def delete_message(
        self, project: str, queue: str, message_id: str, claim_id: str | None
    ) -> None:
        keys = self._keys(project, queue)
        all_keys = [*keys.fixed(), *r.message_keys(keys, message_id)]
        args = [self._clock.now_ms(), claim_id or "", "1", message_id]
        outcome = await self._script(load_script("delete"), all_keys, args)
        if outcome == b"claimed":
            raise MessageIsClaimed(
                f"Message {message_id} is claimed; give its claim_id to delete it."
            )
        if outcome == b"badclaim":
            raise InvalidClaim(f"Claim {claim_id} does not hold message {message_id} (or expired).")
        self.segments.note_soon(project, queue, int(outcome))

    async def delete_messages(self, project: str, queue: str, ids: list[str]) -> None:
        if not ids:
            return
        keys, unique = self._keys(project, queue), list(dict.fromkeys(ids))
        all_keys = [*keys.fixed(), *(k for i in unique for k in r.message_keys(keys, i))]
        args = [self._clock.now_ms(), "", "0", *unique]
        review = await self._script(load_script("delete"), all_keys, args)
        self.segments.note_soon(project, queue, int(review))

    async def try_claim(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | Unclaimable:
        keys = self._keys(project, queue)
        claim_id = new_id()
        script = load_script("claim")
        for _ in range(self._settings.watch_retries):
            [row] = await self._transport.call_checked(
                [("HMGET", keys.meta, *r.DEAD_LETTER_SETTINGS)]
            )
            max_claims, dlq, dlq_ttl = ("" if v is None else r.text(v) for v in row)
            # a queue that names itself as its dead-letter queue keeps its messages
            dead_letters = bool(max_claims and dlq) and dlq != queue
            now = self._clock.now_ms()
            args = [now, claim_id, ttl, grace, limit, self._claim_scan_limit()]
            args += [max_claims, dlq_ttl, dlq, "1" if dead_letters else "0"]
            out = await self._opening(script, keys, args, "a claim", project, queue)
            if out[0] != b"retry":
                break
        else:
            raise StorageUnavailable("The queue's dead-letter settings kept changing.")
        claim, parked = r.claim_reply(out, claim_id, ttl, grace, now)
        if parked:
            await self.claims.dead_letter(project, queue, dlq, claim_id, parked)
        return self._opener.claim(claim)

    async def pop_messages(self, project: str, queue: str, limit: int) -> list[Message]:
        keys = self._keys(project, queue)
        args = [self._clock.now_ms(), limit, self._claim_scan_limit()]
        review, *out = await self._opening(load_script("pop"), keys, args, "a pop", project, queue)
        self.segments.note_soon(project, queue, int(review))
        return self._opener.reveal(r.pop_reply(out))

    async def _opening(
        self, script: LuaScript, keys: QueueKeys, args: list[Any], op: str, project: str, queue: str
    ) -> Any:
        """Run pop.lua or claim.lua, opening first the sealed bodies it asks
        about: it takes a sealed body only with this process's verdict on it
        (the SHA1 of the body it opened, or '' for one it cannot open: that
        one is skipped), so it never removes or claims what cannot be
        returned (see ``sealing.py``)."""
        checked: dict[str, str] = {}
        for _ in range(OPENING_ROUNDS):
            verdicts = [x for pair in checked.items() for x in pair]
            out = await self._script(script, keys.fixed(), [*args, MAGIC, *verdicts])
            if not out or out[0] != b"open":
                return out
            for i in range(1, len(out), 2):
                message_id = r.text(out[i])
                checked[message_id] = self._opener.verdict(
                    message_id, out[i + 1], op, self._noun, project, queue
                )
        raise StorageUnavailable("The queue kept changing while its messages were opened; retry.")
