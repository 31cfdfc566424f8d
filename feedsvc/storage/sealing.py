"""Message bodies encrypted at rest, for queues with ``_enable_encrypt_messages``.

Zaqar (``zaqar/transport/encryptor.py``) encrypts the body of each message
posted to such a queue with AES-256 in CBC mode, the key being the SHA-256 of
``[transport] message_encryption_key``, and decrypts on every read; the rest
of the record (ttl, ids, claims) stays in the clear. feedsvc does the same
with two changes a user can rely on:

* AES-256-GCM (``cryptography``'s AESGCM, a fresh 96-bit nonce per body)
  instead of unauthenticated CBC: a body altered in Redis, or read with
  another key, is refused instead of decrypted to garbage;
* the body is sealed as the JSON bytes the service stores (no pickle), and a
  sealed body says so itself (it starts with :data:`MAGIC`, which no JSON
  text does), so a read never depends on the queue's current metadata:
  switching encryption on or off changes only what is posted afterwards.

The key is the SHA-256 of ``--message-encryption-key`` (as Zaqar derives
it), so use a long random string. Without a key nothing is sealed: a queue
cannot be given ``_enable_encrypt_messages: true`` (400), and a sealed body
met on a read, or a post to a queue encrypted by a service that had a key,
is a 500 that says the key is missing (the data is kept). A rotation
names the earlier keys in ``--message-encryption-old-keys``: they open what
they sealed, never seal (docs/security.md gives the three rolling steps).

One message that cannot be decrypted (sealed with a key this service does
not have, or altered in Redis) never costs another. Asked for by id it is a
500 (:class:`~feedsvc.errors.UnreadableMessage`); everywhere else it is
skipped, with a log line and ``feedsvc_unreadable_skipped_total``: a list
passes over it (its next link moves on), delivery counts it a failed attempt
and gives up on it after the retry policy (its ``last_error`` says why), and
pop and claim never take it. They cannot decrypt inside Redis, so their
scripts ask first: a script that would take a sealed body the caller has
not opened yet takes nothing and returns those bodies; the caller opens
them and runs it again with its verdicts (the SHA1 of each body it opened,
or '' for one it cannot open), and the script takes only what was opened,
unchanged since (``LuaStore._opening``; the watch driver checks the same
before its transaction). Without any key every read of a sealed body is
still a 500, and pop and claim take nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from feedsvc.errors import EncryptionUnavailable, UnreadableMessage
from feedsvc.storage.base import (
    Claim,
    Message,
    MessagePage,
    StoreCounters,
    Unclaimable,
    Unreadable,
)

log = logging.getLogger("feedsvc")

MAGIC = b"\x00fs-aes256gcm:"
NONCE_SIZE = 12


class MustSeal(Exception):
    """A driver's answer to a post of plain bodies to an encrypted queue:
    nothing was written; seal them and post again (storage-internal)."""


def require_sealed(queue_flag: bytes | None, sealed: bool) -> None:
    """MustSeal unless the bodies are sealed or the queue's hash (its ``enc``
    field, as read) does not ask for it: the watch driver's check (post.lua
    makes the same one)."""
    if queue_flag == b"1" and not sealed:
        raise MustSeal


def is_sealed(stored: bytes) -> bool:
    return stored.startswith(MAGIC)


def _aead(secret: str) -> AESGCM:
    return AESGCM(hashlib.sha256(secret.encode()).digest())


class BodySealer:
    """Seals and opens message bodies with the service's key (None: no key);
    bodies sealed under an earlier key (``old``, after a rotation) are opened
    with it, never sealed with it."""

    def __init__(self, secret: str | None, old: Sequence[str] = ()) -> None:
        self._aead = None if secret is None else _aead(secret)
        self._openers = [] if self._aead is None else [self._aead, *map(_aead, old)]

    def seal(self, body: bytes) -> bytes:
        if self._aead is None:
            raise EncryptionUnavailable(
                "This queue encrypts its messages, but the service has no --message-encryption-key."
            )
        nonce = os.urandom(NONCE_SIZE)
        return MAGIC + nonce + self._aead.encrypt(nonce, body, None)

    def open(self, stored: bytes, message_id: str) -> bytes:
        """The body as posted; a body that is not sealed is returned as it is."""
        if not stored.startswith(MAGIC):
            return stored
        if self._aead is None:
            raise EncryptionUnavailable(
                f"Message {message_id} is encrypted, but the service has no "
                "--message-encryption-key."
            )
        sealed = stored[len(MAGIC) :]
        for aead in self._openers:
            try:
                return aead.decrypt(sealed[:NONCE_SIZE], sealed[NONCE_SIZE:], None)
            except InvalidTag:
                continue  # another key's, or altered
        raise UnreadableMessage(
            f"Message {message_id} cannot be decrypted: it was encrypted with "
            "another --message-encryption-key, or altered in storage."
        )


def reveal(sealer: BodySealer, messages: list[Message]) -> list[Message]:
    """The messages with their bodies as posted (sealed ones opened); the
    list itself when none is sealed (every page of every plain queue)."""
    for m in messages:
        if m.body.startswith(MAGIC):
            break
    else:
        return messages
    return [
        dataclasses.replace(m, body=sealer.open(m.body, m.id)) if is_sealed(m.body) else m
        for m in messages
    ]


def reveal_each(sealer: BodySealer, messages: list[Message]) -> list[Message | Unreadable]:
    """Each message with its body as posted, or Unreadable where it cannot be
    decrypted. Without any key a sealed body still raises: that is the
    operator's to fix for the whole queue, not one message to pass over."""
    out: list[Message | Unreadable] = []
    for m in messages:
        if not is_sealed(m.body):
            out.append(m)
            continue
        try:
            out.append(dataclasses.replace(m, body=sealer.open(m.body, m.id)))
        except UnreadableMessage as exc:
            out.append(Unreadable(m.id, exc.description))
    return out


class BodyOpener:
    """Opens the bodies a read returns, for both drivers and every read (list,
    claim, pop, delivery); what it cannot open it passes over, logged and
    counted (``feedsvc_unreadable_skipped_total``), never silently.

    ``where`` names the read for the log: (operation, noun, project, feed).
    """

    def __init__(self, sealer: BodySealer, counters: StoreCounters) -> None:
        self.sealer = sealer
        self._counters = counters

    def reveal(self, messages: list[Message]) -> list[Message]:
        """The messages with their bodies as posted; raises if one cannot be
        opened (a read by id: the client named it)."""
        return reveal(self.sealer, messages)

    def page(self, page: MessagePage, noun: str, project: str, feed: str) -> MessagePage:
        """A page with its bodies opened; one that cannot be is skipped (the
        next marker stays where the scan got to, so the reader moves on)."""
        opened = self.readable(page.messages, "a list", noun, project, feed)
        return page if opened is page.messages else dataclasses.replace(page, messages=opened)

    def claim(self, claim: Claim | Unclaimable) -> Claim | Unclaimable:
        """A claim with its bodies opened (raises as :meth:`reveal`)."""
        if isinstance(claim, Unclaimable):
            return claim
        opened = self.reveal(claim.messages)
        return claim if opened is claim.messages else dataclasses.replace(claim, messages=opened)

    def readable(self, messages: list[Message], *where: str) -> list[Message]:
        """The messages opened, less those that cannot be."""
        if not any(is_sealed(m.body) for m in messages):
            return messages
        return [m for m in self.each(messages, *where) if isinstance(m, Message)]

    def each(self, messages: list[Message], *where: str) -> list[Message | Unreadable]:
        """Each message opened, or Unreadable (what delivery records)."""
        opened = reveal_each(self.sealer, messages)
        for item in opened:
            if isinstance(item, Unreadable):
                self._passed_over(item, *where)
        return opened

    def verdict(self, message_id: str, stored: bytes, *where: str) -> str:
        """What pop and claim tell their script of a sealed body: the SHA1 of
        the body if this process can open it, '' if it cannot. Without a key:
        raises, and the script takes nothing."""
        try:
            self.sealer.open(stored, message_id)
        except UnreadableMessage as exc:
            self._passed_over(Unreadable(message_id, exc.description), *where)
            return ""
        return hashlib.sha1(stored, usedforsecurity=False).hexdigest()

    def _passed_over(self, item: Unreadable, *where: str) -> None:
        op, noun, project, feed = where
        self._counters.unreadable_skipped += 1
        log.warning(
            "%s of %s %s (project %s) skipped message %s: %s",
            op, noun, feed, project, item.id, item.reason,
        )  # fmt: skip
