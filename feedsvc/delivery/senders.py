"""Sending one notification: a webhook POST or a mail, as Zaqar's tasks do.

Webhook (``notification/tasks/webhook.py``): a POST of the message as JSON,
``{"body": ..., "ttl": ..., "queue_name": ..., "Message_Type":
"Notification"}`` with ``Content-Type: application/json`` plus the
subscription's ``options.post_headers``; with ``options.post_data`` the
body is that template with ``"$zaqar_message$"`` replaced by the JSON. feedsvc
adds an ``X-Message-ID`` header, so a receiver can drop the repeats that
at-least-once delivery allows. A 2xx or 3xx answer is success (redirects
are not followed: see ``guard``); a 4xx is final, as in Zaqar (no retry);
a 5xx, a timeout or a connection error is retried by the policy.

Mail (``notification/tasks/mailto.py``): a text mail whose body is the same
JSON, To the address, From ``options.from`` (else ``--smtp-sender``), with
the subject of the URI's ``?subject=`` or ``options.subject``; through
``--smtp-server`` (STARTTLS when offered). A 5xx SMTP answer is final.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import aiohttp
import aiosmtplib
import orjson

from feedsvc.config import Settings, smtp_address, subscriber_networks
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


def notification(sub: Subscription, message: Message) -> bytes:
    """Zaqar's notification document for a message."""
    document: dict[str, Any] = {
        "body": orjson.Fragment(message.body),
        "ttl": message.ttl,
        "queue_name": sub.source,
        "Message_Type": "Notification",
    }
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

    async def send(self, sub: Subscription, data: bytes, message_id: str | None) -> Outcome:
        """Send one document (a notification or a confirmation request)."""
        if sub.subscriber.startswith("mailto:"):
            return await self._mail(sub, data)
        return await self._post(sub, data, message_id)

    async def _post(self, sub: Subscription, data: bytes, message_id: str | None) -> Outcome:
        options = sub.options
        headers = {"Content-Type": "application/json"}
        extra = options.get("post_headers")
        if isinstance(extra, dict):
            headers.update({str(k): str(v) for k, v in extra.items()})
        if message_id is not None:
            headers["X-Message-ID"] = message_id
        template = options.get("post_data")
        body = (
            template.replace('"$zaqar_message$"', data.decode())
            if isinstance(template, str)
            else data.decode()
        )
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
                return Outcome(False, final=True, error=describe(refused))
            return Outcome(False, error=describe(exc))
        if status < 400:
            return OK
        return Outcome(False, final=status < 500, error=f"HTTP {status}")

    async def _mail(self, sub: Subscription, data: bytes) -> Outcome:
        address = smtp_address(self._settings.smtp_server)
        if address is None:
            return Outcome(False, final=True, error="no --smtp-server: mail cannot be sent")
        uri = urlsplit(sub.subscriber)
        params = {k.lower(): v for k, v in parse_qs(uri.query).items()}
        mail = EmailMessage()
        mail["To"] = unquote(uri.path)
        sender = sub.options.get("from")
        mail["From"] = sender if isinstance(sender, str) and sender else self._settings.smtp_sender
        subject = params.get("subject", [sub.options.get("subject", "")])[0]
        mail["Subject"] = str(subject or "")
        mail.set_content(data.decode())
        host, port = address
        try:
            await aiosmtplib.send(
                mail,
                sender=self._settings.smtp_sender,
                recipients=[unquote(uri.path)],
                hostname=host,
                port=port,
                timeout=self._settings.delivery_timeout,
            )
        except aiosmtplib.SMTPRecipientsRefused as exc:
            return Outcome(False, final=True, error=describe(exc))
        except aiosmtplib.SMTPResponseException as exc:
            return Outcome(False, final=exc.code >= 500, error=describe(exc))
        except (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError) as exc:
            return Outcome(False, error=describe(exc))
        return OK
