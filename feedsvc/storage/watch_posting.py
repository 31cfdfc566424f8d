"""A POST on its way to a watch driver's index (watch_store.py's combiner
hands them to the indexing transaction in either layout)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from feedsvc.errors import PostTooLarge
from feedsvc.storage import record as r
from feedsvc.storage.base import NewMessage, new_id
from feedsvc.storage.keys import Kind, QueueKeys
from feedsvc.storage.quotas import Reservation
from feedsvc.storage.redis_store import idempotency_token
from feedsvc.storage.sealing import require_sealed


def replayed(seen: Any, now: int) -> list[str] | None:
    """The first post's ids if an idempotency record (as read) is still in its window."""
    if seen is None:
        return None
    until, *first_ids = r.text(seen).split()
    return first_ids if int(until) > now else None


@dataclass(slots=True)
class Posting:
    """One POST on its way to the index."""

    project: str
    queue: str
    keys: QueueKeys
    client_id: str
    messages: list[NewMessage]
    ids: list[str]
    request_size: int
    token: str | None  # idempotency token
    sealed: bool
    #: the room it holds under its project's quota, let go of in the
    #: indexing transaction when ``held.in_script``
    held: Reservation | None = None
    #: what the feed is: the combiner that indexes it is the queue store's,
    #: shared by the topic view, so the posting says where to list the feed
    kind: Kind = "queue"

    @classmethod
    def make(
        cls,
        keys: QueueKeys,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int,
        idempotency_key: str | None,
        sealed: bool,
        held: Reservation | None = None,
        kind: Kind = "queue",
    ) -> Posting:
        token = None if idempotency_key is None else idempotency_token(client_id, idempotency_key)
        ids = [new_id() for _ in messages]
        return cls(
            project, queue, keys, client_id, messages, ids, request_size, token, sealed, held, kind
        )

    def replay_or_refuse(
        self,
        encrypted: bytes | None,
        max_post_size: bytes | None,
        too_large: Callable[[str, bytes], PostTooLarge],
        earlier: dict[str, list[str]],
        seen: dict[str, Any],
        now: int,
    ) -> list[str] | None:
        """The checks every post to a queue gets before its count, in either
        layout, in post.lua's order: sealed bodies where the queue's hash
        (``encrypted``, as read) asks for them (else MustSeal); its
        idempotency token (the ids of the post that used it first, earlier
        in this batch or as its record was read in ``seen``: returned); its
        size (else ``too_large``'s refusal). None: go on to the count."""
        require_sealed(encrypted, self.sealed)
        if self.token is not None:
            replay = earlier.get(self.token) or replayed(seen[self.token], now)
            if replay is not None:
                return replay
        if max_post_size is not None and self.request_size > int(max_post_size):
            raise too_large(self.queue, max_post_size)
        return None
