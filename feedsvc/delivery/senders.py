"""Sending one notification: a webhook POST or a mail, as Zaqar's tasks do.

Webhook (``notification/tasks/webhook.py``): a POST of the message as JSON,
``{"body": ..., "ttl": ..., "queue_name": ..., "Message_Type":
"Notification"}`` with ``Content-Type: application/json`` plus the
subscription's ``options.post_headers`` (those ``subscribers`` allows;
a name differing only in case replaces the default); with
``options.post_data`` the body is that template with ``"$zaqar_message$"``
replaced by the JSON. feedsvc adds an ``X-Message-ID`` header, so a receiver
can drop the repeats that at-least-once delivery allows, and a message's
headers (docs/consumers.md#message-headers): as the notification's
``headers`` field, and its W3C ``traceparent`` and ``tracestate`` as HTTP
headers of the request too, so a traced receiver continues the producer's
trace (they replace a ``post_headers`` entry of the same name). A 2xx or 3xx answer
is success (redirects are not followed: see ``guard``); a 4xx is final, as in
Zaqar (no retry), except 408, 425 and 429, which say "later"; a 5xx, a
timeout or a connection error is retried by the policy.

Mail (``notification/tasks/mailto.py``): a text mail whose body is the same
JSON, To every address of the URI, From ``options.from`` (else
``--smtp-sender``), with the subject of the URI's ``?subject=`` or
``options.subject``; through ``--smtp-server`` (STARTTLS when offered). A 5xx
SMTP answer is final.

A final failure ends the retry schedule of that message at once; so does a
subscriber that cannot be reached at all (``subscribers``: stored before its
rules, e.g. a port out of range). Its error says "final".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import aiosmtplib
import orjson
from multidict import CIMultiDict

from feedsvc.config import Settings, smtp_address, subscriber_networks
from feedsvc.delivery import subscribers
from feedsvc.delivery.guard import (
    RefusedAddress,
    check_host,
    describe,
    guarded_connector,
    url_host,
)
from feedsvc.storage.base import Message, Subscription


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    final: bool = False  # a failure that retrying cannot mend
    error: str | None = None


OK = Outcome(True)
#: 4xx answers that ask to try again later: retried by the policy.
RETRIED_CLIENT_ERRORS = frozenset({408, 425, 429})


def final(error: str) -> Outcome:
    """A failure that retrying cannot mend: the message is given up at once."""
    return Outcome(False, final=True, error=f"{error} (final: not retried)")


def notification(sub: Subscription, message: Message) -> bytes:
    """Zaqar's notification document for a message."""
    document: dict[str, Any] = {
        "body": orjson.Fragment(message.body),
        "ttl": message.ttl,
        "queue_name": sub.source,
        "Message_Type": "Notification",
    }
    if message.headers is not None:  # a feedsvc extension, only when it has some
        document["headers"] = orjson.Fragment(message.headers)
    return orjson.dumps(document)


def control_document(sub: Subscription, control: bytes) -> bytes:
    """A confirmation request as sent: its JSON with the queue's name."""
    document = orjson.loads(control)
    document["queue_name"] = sub.source
    return orjson.dumps(document)


def _refusal(exc: BaseException) -> RefusedAddress | None:
    """The guard's refusal behind an error (aiohttp wraps the resolver's)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, RefusedAddress):
            return seen
        seen = getattr(seen, "os_error", None) or seen.__cause__ or seen.__context__
    return None


class Senders:
    """The HTTP client session (guarded) and the SMTP settings of one process."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._networks = subscriber_networks(settings.subscriber_allow)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=guarded_connector(self._networks),
                timeout=aiohttp.ClientTimeout(total=self._settings.delivery_timeout),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        sub: Subscription,
        data: bytes,
        message_id: str | None,
        trace: Mapping[str, str] | None = None,
    ) -> Outcome:
        """Send one document (a notification or a confirmation request);
        trace: the message's W3C Trace Context headers, for a webhook."""
        if sub.subscriber[:7].lower() == "mailto:":
            return await self._mail(sub, data)
        return await self._post(sub, data, message_id, trace or {})

    async def _post(
        self, sub: Subscription, data: bytes, message_id: str | None, trace: Mapping[str, str]
    ) -> Outcome:
        options = sub.options
        headers = CIMultiDict({"Content-Type": "application/json"})
        headers.update(subscribers.sendable_headers(options.get("post_headers")))
        if message_id is not None:
            headers["X-Message-ID"] = message_id
        headers.update(trace)
        template = options.get("post_data")
        body = (
            template.replace('"$zaqar_message$"', data.decode())
            if isinstance(template, str)
            else data.decode()
        )
        try:
            subscribers.webhook(sub.subscriber)
        except subscribers.Unreachable as exc:
            return final(str(exc))
        try:
            check_host(url_host(sub.subscriber), self._networks)
            async with self._client().post(
                sub.subscriber, data=body.encode(), headers=headers, allow_redirects=False
            ) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            refused = _refusal(exc)
            if refused is not None:  # final: retrying would be refused again
                return final(describe(refused))
            if isinstance(exc, ValueError):  # an invalid URL or header: the same again
                return final(describe(exc))
            return Outcome(False, error=describe(exc))
        if status < 400:
            return OK
        if status < 500 and status not in RETRIED_CLIENT_ERRORS:
            return final(f"HTTP {status}")
        return Outcome(False, error=f"HTTP {status}")

    async def _mail(self, sub: Subscription, data: bytes) -> Outcome:
        address = smtp_address(self._settings.smtp_server)
        if address is None:
            return final("no --smtp-server: mail cannot be sent")
        uri = urlsplit(sub.subscriber)
        params = {k.lower(): v for k, v in parse_qs(uri.query).items()}
        sender = sub.options.get("from")
        subject = params.get("subject", [sub.options.get("subject", "")])[0]
        try:
            recipients = subscribers.mail_recipients(sub.subscriber)
            mail = EmailMessage()
            mail["To"] = ", ".join(recipients)
            mail["From"] = (
                subscribers.sender_address(sender)
                if isinstance(sender, str) and sender
                else self._settings.smtp_sender
            )
            mail["Subject"] = subscribers.subject(str(subject or ""))
        except ValueError as exc:  # Unreachable, or a header the mail cannot carry
            return final(describe(exc))
        mail.set_content(data.decode())
        host, port = address
        try:
            await aiosmtplib.send(
                mail,
                sender=self._settings.smtp_sender,
                recipients=recipients,
                hostname=host,
                port=port,
                timeout=self._settings.delivery_timeout,
            )
        except aiosmtplib.SMTPRecipientsRefused as exc:
            return final(describe(exc))
        except aiosmtplib.SMTPResponseException as exc:
            return final(describe(exc)) if exc.code >= 500 else Outcome(False, error=describe(exc))
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as exc:
            return Outcome(False, error=describe(exc))
        return OK
