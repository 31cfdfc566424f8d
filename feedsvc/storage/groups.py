"""Ordered message groups where Python writes messages: the claim index
entries of a copied message, and the group entries of forgotten ones.

The scripts own the groups' layout (``lua/post.lua``, ``lua/_lib.lua``'s
``choose_messages``; the keys are in ``keys.py``, the ``gs`` field in
``record.py``). A message copied by a transaction (a dead letter into its
dead-letter queue, a redrive into its target) is claim-indexed as a post
would be; a message forgotten by one (a dead letter's original, a redriven
dead letter) leaves the claim index and its group. What a transaction
cannot see cheaply it leaves to the scripts: a group emptied here keeps its
entry in the claim index until a claim or the garbage collection finds
the group empty and drops it (docs/consumers.md#ordered-groups).
"""

from __future__ import annotations

from collections.abc import Sequence

from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import GROUP_ENTRY, QueueKeys
from feedsvc.storage.record import GROUPS_SINCE, parse_seq


def groups_since(raw: bytes | str | None) -> int | None:
    """A queue's ``gs`` field as read (None: it never had a grouped message)."""
    return None if raw is None else parse_seq(raw)


def index_commands(
    keys: QueueKeys, message_id: str, seq: int, group: str, since: int | None
) -> tuple[list[Command], int | None]:
    """The claim index entries of a message indexed at seq (post.lua writes
    the same), and the queue's ``gs`` after it: a grouped message starts the
    claim index if the queue had none; an ungrouped one enters it only if
    the queue has one."""
    if group:
        commands: list[Command] = []
        if since is None:
            since = seq
            commands.append(("HSET", keys.meta, GROUPS_SINCE, seq))
        commands.append(("ZADD", keys.group(group), seq, message_id))
        commands.append(("ZADD", keys.claim_index, "NX", seq, GROUP_ENTRY + group))
        return commands, since
    if since is None:
        return [], None
    return [("ZADD", keys.claim_index, seq, message_id)], since


def forget_commands(keys: QueueKeys, messages: Sequence[tuple[str, str]]) -> list[Command]:
    """Take forgotten messages, (id, group ('' = none)) pairs, out of the
    claim index and their groups."""
    if not messages:
        return []
    commands: list[Command] = [("ZREM", keys.claim_index, *(i for i, _ in messages))]
    by_group: dict[str, list[str]] = {}
    for message_id, group in messages:
        if group:
            by_group.setdefault(group, []).append(message_id)
    commands += [("ZREM", keys.group(g), *ids) for g, ids in by_group.items()]
    return commands
