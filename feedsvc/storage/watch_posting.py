"""A POST on its way to a watch driver's index (watch_store.py's combiner
hands them to the indexing transaction in either layout)."""

from __future__ import annotations

from dataclasses import dataclass

from feedsvc.storage.base import NewMessage, new_id
from feedsvc.storage.keys import Kind, QueueKeys
from feedsvc.storage.quotas import Reservation
from feedsvc.storage.redis_store import idempotency_token


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
