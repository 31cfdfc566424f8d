"""Settings: one frozen object built from CLI flags and ``FEEDSVC_*`` variables.

Every setting is a field of :class:`Settings`; its metadata carries the help
text, so ``feedsvc serve --help`` documents every setting and every setting
can be given either as ``--pool-size 64`` or as ``FEEDSVC_POOL_SIZE=64``
(a flag wins over the environment). The limits default to Zaqar's.

The flags are flat, the settings are in sections: one dataclass each
(:class:`RedisSettings`, :class:`MessageSettings`, ... and
:class:`~feedsvc.config.subscriptions.SubscriptionSettings` in a module of
its own), and :class:`Settings` inherits them all. Only ``create_app`` and
the command line take the whole; every subsystem names the section it reads
(the storage drivers :class:`StoreSettings`, the transport
:class:`RedisSettings`, delivery :class:`SubscriptionSettings`, tokens
:class:`AccessSettings`, the rate limiter :class:`ClientSettings`, logging
:class:`LogSettings`), is handed the Settings as that type, and ``mypy
--strict`` refuses a read of any other section's field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

# The sections declared here call the helpers by the short names they have
# always had here, so flags added to them elsewhere merge as they are.
from feedsvc.config.fields import opt as _opt
from feedsvc.config.fields import section as _section
from feedsvc.config.subscriptions import SubscriptionSettings, smtp_address, subscriber_networks

ENV_PREFIX = "FEEDSVC_"
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
# the storage drivers (see feedsvc.storage.drivers, which checks this list)
DRIVER_NAMES = ("lua", "watch", "watch-naive")
#: how new messages are stored (feedsvc.storage.segments)
STORAGE_LAYOUTS = ("records", "segments")
#: the layout of a process that names none (docs/operations.md: upgrading)
DEFAULT_STORAGE_LAYOUT = "segments"
#: the largest quota (messages or queues) a flag, the admin API or a queue's
#: _max_messages may set: far above what one Redis holds, and a count Lua's
#: doubles keep exact
MAX_QUOTA = 10**9
URL_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
#: Most queues --metrics-queues may name: each is a set of series in every
#: scrape and a few Redis reads per refresh, so both stay bounded.
MAX_METRICS_QUEUES = 100
# A queue name, as the API accepts it (feedsvc.api.validation.QUEUE_NAME).
_QUEUE_NAME = re.compile(r"^(?!\.\.?$)[a-zA-Z0-9_.-]{1,64}$")


class UnusableSetting(Exception):
    """A well-formed setting this machine cannot honour: a port in use, a host
    that is not one of its addresses, a data dir that is a file or in use.

    Found only when the process starts; ``feedsvc serve`` prints the message
    as one line and exits 2, as for a malformed setting.
    """


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """``redis+sentinel://[[user]:password@]host:port[,host:port...]/service``
    (``rediss+sentinel://`` for TLS to the sentinels and the master); the
    credentials are the master's."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    username: str | None
    password: str | None
    tls: bool

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        scheme, _, rest = url.partition("://")
        where, _, service = rest.partition("/")
        credentials, at, hosts = where.rpartition("@")
        if not at:
            credentials = ""
        username, _, password = credentials.partition(":")
        service = service.strip("/")
        sentinels = []
        for item in hosts.split(","):
            host, colon, port = item.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"--redis-url: a sentinel must be host:port, got {item!r} in {url!r}"
                )
            sentinels.append((host.strip("[]"), int(port)))
        if not service or "/" in service:
            raise ValueError(f"--redis-url: name the sentinel service after the hosts: {url!r}")
        return cls(
            tuple(sentinels),
            service,
            unquote(username) or None,
            unquote(password) or None,
            scheme.startswith("rediss"),
        )


@dataclass(frozen=True)
class ServiceSettings:
    """The service section of Settings (and of ``serve --help``)."""

    _section("service")
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8888, "TCP port to listen on", minimum=0, maximum=65535)
    workers: str = _opt(
        "1", "event-loop processes sharing the port: a number, or 'auto' for one per CPU"
    )
    shutdown_grace: float = _opt(
        30.0,
        "seconds a stopping process (SIGTERM) gives requests in flight to finish",
        minimum=0.0,
    )
    ready_file: Path | None = _opt(
        None,
        "once the service accepts connections (with --workers, once every worker does), "
        "write {url, host, port, pid, workers, redis_url} as JSON to this path, atomically "
        "(it holds the real port with --port 0); removed when the service stops",
    )
    loop: str = _opt("uvloop", "event loop", choices=("uvloop", "asyncio"))

    def worker_count(self) -> int:
        if self.workers == "auto":
            return os.cpu_count() or 1
        try:
            count = int(self.workers)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"--workers must be a number >= 1 or 'auto', got {self.workers!r}")
        return count


@dataclass(frozen=True)
class RedisSettings:
    """The Redis section of Settings (and of ``serve --help``)."""

    _section("Redis")
    redis_url: str | None = _opt(
        None,
        "Redis URL (redis://, rediss://, unix://; redis+cluster://host:port or "
        "rediss+cluster:// for a Redis Cluster, any node as the seed; "
        "redis+sentinel://host:port[,host:port...]/service or rediss+sentinel:// for "
        "a master found through Redis Sentinel); unset = start an embedded "
        "redis-server in --data-dir",
    )
    data_dir: Path = _opt(Path("feedsvc-data"), "data directory of the embedded Redis (AOF files)")
    redis_fsync: str = _opt(
        "everysec",
        "appendfsync of the embedded Redis: 'always' makes every 201 survive kill -9 of Redis",
        choices=("always", "everysec", "no"),
    )
    driver: str = _opt(
        "lua",
        "storage driver: lua (EVALSHA scripts), watch (WATCH/MULTI/EXEC, posts to a queue "
        "combined per process) or watch-naive (WATCH/MULTI/EXEC per request, Zaqar 2014 style)",
        choices=DRIVER_NAMES,
    )
    storage_layout: str = _opt(
        DEFAULT_STORAGE_LAYOUT,
        "the layout new messages are written in: segments (packed, 100 messages a string: "
        "docs/design.md) or records (a key per message, as releases before compact storage "
        "wrote); a queue that has segments keeps them whatever this says, and messages "
        "stored as records are read where they are",
        choices=STORAGE_LAYOUTS,
    )
    sweep_interval: float = _opt(
        5.0,
        "seconds between two looks of this process's sweep loop at the due segment "
        "reviews while none was due (once a second while some are); 0 = no sweep loop in "
        "this process (others sweep; posts and claims review their own queue's anyway)",
        minimum=0.0,
    )
    pool_size: int = _opt(
        32,
        "Redis connections per process (with --coalesce, one of them carries the coalesced calls)",
        minimum=2,
    )
    pool_timeout: float = _opt(
        2.0,
        "seconds a request may wait for a free Redis connection, or for room among the "
        "coalesced calls in flight (then 503)",
        minimum=0.001,
    )
    redis_timeout: float = _opt(5.0, "seconds to wait for a Redis reply (then 503)", minimum=0.001)
    redis_connect_timeout: float = _opt(
        1.0,
        "seconds to wait for a Redis connection to open (then 503)",
        minimum=0.001,
    )
    min_replicas_ack: int = _opt(
        0,
        "answer a write only once this many replicas have it (Redis WAIT), so a failover "
        "cannot lose it; 0 = don't wait (replication is asynchronous: a failover may lose "
        "the last acknowledged writes)",
        minimum=0,
    )
    replica_ack_timeout: float = _opt(
        1.0,
        "seconds --min-replicas-ack waits for the replicas (then 503: the write may or may "
        "not be kept)",
        minimum=0.001,
    )
    allow_evicting_redis: bool = _opt(
        False,
        "serve on a Redis whose maxmemory-policy may evict feedsvc's keys (anything but "
        "noeviction), which can lose acknowledged messages without a word; without it "
        "feedsvc refuses to start on such a Redis (exit 2) and refuses writes (503) if "
        "one becomes so; with it /v2/health and the feedsvc_redis_may_evict metric say so",
    )
    coalesce: bool = _opt(
        True,
        "share pipelines between concurrent requests (auto-pipelining); "
        "--no-coalesce sends each request's commands on their own",
    )
    watch_retries: int = _opt(
        50, "watch driver: attempts per write before answering 503", minimum=1
    )

    def redis_cluster(self) -> bool:
        """Whether --redis-url names a Redis Cluster (redis+cluster://)."""
        return self.redis_url is not None and self.redis_url.startswith(CLUSTER_SCHEMES)

    def redis_sentinel(self) -> SentinelURL | None:
        """The sentinels and service --redis-url names (redis+sentinel://), if it does."""
        if self.redis_url is None or not self.redis_url.startswith(SENTINEL_SCHEMES):
            return None
        return SentinelURL.parse(self.redis_url)


@dataclass(frozen=True)
class MessageSettings:
    """The messages, claims and their limits section of Settings (and of ``serve --help``)."""

    _section("messages, claims and their limits")
    idempotency_window: int = _opt(
        3600,
        "seconds during which a POST repeated with the same Idempotency-Key (and "
        "Client-ID) returns the first post's result instead of posting again",
        minimum=1,
    )
    max_messages_post_size: int = _opt(262144, "largest POST body in bytes", minimum=1)
    min_message_ttl: int = _opt(60, "smallest message ttl in seconds", minimum=1)
    max_message_ttl: int = _opt(1209600, "largest message ttl in seconds", minimum=1)
    default_message_ttl: int = _opt(3600, "message ttl when none is given", minimum=1)
    max_message_delay: int = _opt(900, "largest message delay in seconds", minimum=0)
    min_claim_ttl: int = _opt(60, "smallest claim ttl in seconds", minimum=1)
    max_claim_ttl: int = _opt(43200, "largest claim ttl in seconds", minimum=1)
    default_claim_ttl: int = _opt(300, "claim ttl when none is given", minimum=1)
    min_claim_grace: int = _opt(60, "smallest claim grace in seconds", minimum=0)
    max_claim_grace: int = _opt(43200, "largest claim grace in seconds", minimum=0)
    default_claim_grace: int = _opt(60, "claim grace when none is given", minimum=0)
    max_messages_per_page: int = _opt(20, "largest 'limit' of a message list", minimum=1)
    default_messages_per_page: int = _opt(
        10, "'limit' of a message list when none is given", minimum=1
    )
    max_messages_per_claim_or_pop: int = _opt(
        20, "largest 'limit' of a claim and 'pop' of a delete", minimum=1
    )
    max_queues_per_page: int = _opt(20, "largest 'limit' of a queue list", minimum=1)
    default_queues_per_page: int = _opt(10, "'limit' of a queue list when none is given", minimum=1)
    max_messages_per_post: int = _opt(
        1000,
        "most messages in one POST (Zaqar has no count limit, only the body size; "
        "this bounds the time one index script runs)",
        minimum=1,
    )
    scan_limit: int = _opt(
        1000,
        "most index entries one list request scans past filtered-out messages "
        "before answering with a forward 'next' link",
        minimum=1,
    )


@dataclass(frozen=True)
class AccessSettings:
    """The access and encryption section of Settings (and of ``serve --help``)."""

    _section("access and encryption")
    auth_token: str | None = _opt(
        None,
        "static bearer tokens, TOKEN=PROJECT[,TOKEN=PROJECT...], each granting its whole "
        "project: when set, queue routes need 'Authorization: Bearer TOKEN' (else 401) and "
        "the project is the token's, not X-Project-ID's. A flag shows in ps: prefer "
        "--auth-token-file",
    )
    auth_token_file: Path | None = _opt(
        None,
        "file of static bearer tokens, one 'TOKEN PROJECT SCOPE...' per line (scopes as "
        "a JWT's, e.g. '*:*' or 'read:orders-*'; # starts a comment); read again on SIGHUP "
        "by every worker (a file that does not parse keeps the tokens in force)",
    )
    jwt_jwks_url: str | None = _opt(
        None,
        "accept JWT bearer tokens (OIDC / OAuth2 access tokens) signed by the keys of this "
        "JWKS URL (http:// or https://): fetched at start, again on an unknown kid (at most "
        "every 10 s) and every --jwt-jwks-refresh seconds; needs --jwt-issuer and "
        "--jwt-audience",
    )
    jwt_key_file: Path | None = _opt(
        None,
        "accept JWT bearer tokens signed by the public key in this PEM file (instead of "
        "--jwt-jwks-url); needs --jwt-issuer and --jwt-audience",
    )
    jwt_issuer: str | None = _opt(None, "the iss a JWT must carry")
    jwt_audience: str | None = _opt(None, "the aud a JWT must carry (one of, if a list)")
    jwt_algorithms: str = _opt(
        "RS256,ES256,PS256,EdDSA",
        "signature algorithms a JWT may use, comma-separated; asymmetric ones only "
        "(RS*, PS*, ES*, EdDSA): never none, never an HMAC keyed by a public key",
    )
    jwt_leeway: float = _opt(
        30.0, "seconds of clock skew allowed on a JWT's exp and nbf", minimum=0.0, maximum=300.0
    )
    jwt_project_claim: str = _opt(
        "project", "the JWT claim that names the project (it wins over X-Project-ID)"
    )
    jwt_jwks_refresh: float = _opt(
        60.0,
        "seconds between fetches of --jwt-jwks-url: a key added or removed at the issuer "
        "counts within this",
        minimum=1.0,
        maximum=86400.0,
    )
    keystone_url: str | None = _opt(
        None,
        "accept OpenStack Keystone tokens (X-Auth-Token) validated against this Keystone "
        "(http(s)://host:port, /v3 added if missing) as keystonemiddleware does; needs "
        "--keystone-user, --keystone-password-file and --keystone-project",
    )
    keystone_user: str | None = _opt(None, "feedsvc's service user in Keystone")
    keystone_password_file: Path | None = _opt(
        None, "file whose first line is --keystone-user's password (read at each login)"
    )
    keystone_project: str | None = _opt(None, "the project feedsvc's service user logs in to")
    keystone_user_domain: str = _opt("Default", "the domain (name) of --keystone-user")
    keystone_project_domain: str = _opt("Default", "the domain (name) of --keystone-project")
    keystone_cache: float = _opt(
        300.0,
        "seconds a validated Keystone token is cached (never past its expiry): a token "
        "revoked at Keystone stops working within this",
        minimum=1.0,
        maximum=3600.0,
    )
    keystone_negative_cache: float = _opt(
        10.0,
        "seconds a token Keystone called invalid is refused unasked",
        minimum=0.0,
        maximum=300.0,
    )
    keystone_roles: str = _opt(
        "admin=*:*,member=*:*,reader=read:*",
        "what a Keystone role allows: ROLE=SCOPE[ SCOPE...], comma-separated, scopes as a "
        "JWT's (ACTION:NAME_GLOB); a token gets the scopes of all its roles, a role not "
        "named gives none",
    )
    cors_origin: str | None = _opt(
        None,
        "a browser origin (scheme://host[:port]) allowed to call the API cross-origin; "
        "repeat the flag (or comma-separate in the environment) for several; '*' allows "
        "any origin, for GET and HEAD without credentials only",
        repeat=True,
    )
    signed_url_key: str | None = _opt(
        None,
        "secret key of pre-signed URLs (POST /v2/queues/{name}/share), HMAC-SHA256 as "
        "Zaqar's [signed_url] secret_key; unset = no URLs are made and signed requests "
        "are 404. Prefer the environment variable: a flag shows in ps",
    )
    message_encryption_key: str | None = _opt(
        None,
        "secret of encrypted queues (_enable_encrypt_messages: true): message bodies "
        "are stored AES-256-GCM-encrypted under its SHA-256, as Zaqar's [transport] "
        "message_encryption_key; at least 16 characters, a long random string; unset = "
        "no queue can be made encrypted (400). To rotate it, name the old one in "
        "--message-encryption-old-keys (docs/security.md: Encrypted queues). Prefer the "
        "environment variable",
    )
    message_encryption_old_keys: str | None = _opt(
        None,
        "earlier --message-encryption-key values, comma-separated (so keys without "
        "commas): tried after the current key to open bodies sealed before a "
        "rotation, never used to seal",
    )

    def old_encryption_keys(self) -> list[str]:
        raw = self.message_encryption_old_keys or ""
        return [key for key in (k.strip() for k in raw.split(",")) if key]

    def auth_tokens(self) -> dict[str, str]:
        """token -> project, from auth_token (empty: authentication off)."""
        if not self.auth_token:
            return {}
        tokens: dict[str, str] = {}
        for pair in self.auth_token.split(","):
            token, sep, project = pair.strip().partition("=")
            if not sep or not token or not project or len(project) > 256:
                raise ValueError("--auth-token must be TOKEN=PROJECT[,TOKEN=PROJECT...]")
            tokens[token] = project
        return tokens

    def jwt_on(self) -> bool:
        return self.jwt_jwks_url is not None or self.jwt_key_file is not None

    def jwt_algorithm_list(self) -> list[str]:
        return [name for name in (a.strip() for a in self.jwt_algorithms.split(",")) if name]

    def cors_origins(self) -> frozenset[str]:
        """The origins of --cors-origin ('*' among them when given)."""
        raw = self.cors_origin or ""
        return frozenset(o for o in (item.strip() for item in raw.split(",")) if o)


@dataclass(frozen=True)
class QuotaSettings:
    """The quotas and admin API section of Settings (and of ``serve --help``)."""

    _section("quotas and the admin API")
    project_max_messages: int = _opt(
        0,
        "live messages a project may hold across its queues and topics (0: no limit); "
        "a post over it is 403. The admin API sets it per project",
        minimum=0,
        maximum=MAX_QUOTA,
    )
    project_max_queues: int = _opt(
        0,
        "queues and topics a project may have (0: no limit); creating one more is 403. "
        "The admin API sets it per project",
        minimum=0,
        maximum=MAX_QUOTA,
    )
    admin_token: str | None = _opt(
        None,
        "bearer token of the admin API (/v2/admin/...), at least 16 characters; unset = "
        "no admin API (404). Prefer --admin-token-file or the environment variable: a "
        "flag shows in ps",
    )
    admin_token_file: Path | None = _opt(
        None, "file whose first line is the admin token (instead of --admin-token)"
    )

    def admin_secret(self) -> str | None:
        """The admin API's token (None: no admin API), from the flag or the file."""
        if self.admin_token_file is not None:
            try:
                lines = self.admin_token_file.read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"--admin-token-file: cannot read it: {exc}") from None
            token = lines[0].strip() if lines else ""
        else:
            token = self.admin_token or ""
        if not token:
            return None
        if len(token) < 16:
            raise ValueError("the admin token must be at least 16 characters long")
        return token


@dataclass(frozen=True)
class ClientSettings:
    """The clients, long polls and streams section of Settings (and of ``serve --help``)."""

    _section("clients, long polls and streams")
    client_timeout: float = _opt(
        10.0,
        "seconds a client may take to send a request's headers, and its body "
        "(then the connection is closed, or 408)",
        minimum=0.1,
    )
    keepalive_timeout: float = _opt(
        75.0, "seconds an idle keep-alive connection is kept open", minimum=0.1
    )
    stream_heartbeat: float = _opt(
        15.0, "seconds between heartbeat comments on an event stream", minimum=0.1
    )
    stream_lifetime: float = _opt(
        600.0,
        "seconds an event stream stays open (give or take a tenth), then the client "
        "reconnects with Last-Event-ID",
        minimum=1.0,
    )
    stream_retry: int = _opt(
        2000, "milliseconds an event stream tells its client to wait before reconnecting", minimum=0
    )
    stream_buffer_kib: int = _opt(
        256,
        "KiB of events waiting to be sent to a slow event stream before it is cut off "
        "(it resumes from its last event id)",
        minimum=1,
    )
    max_followers: int = _opt(
        10000,
        "event streams and long polls one process serves at once (503 with Retry-After beyond)",
        minimum=1,
    )
    project_rate: float = _opt(
        0.0,
        "requests/s each project may make to its queues and topics, over all processes and "
        "hosts (429 beyond; its limits hash overrides it); 0 = no limit",
        minimum=0,
        maximum=1_000_000,
    )
    project_burst: int = _opt(
        0, "requests at once above --project-rate; 0 = one second's worth", minimum=0, maximum=10**7
    )


@dataclass(frozen=True)
class LogSettings:
    """The logs and benchmarks section of Settings (and of ``serve --help``)."""

    _section("logs and benchmarks")
    access_log: bool = _opt(False, "log every request (costs throughput)")
    bench_routes: bool = _opt(
        False,
        "serve GET /bench/hello, a JSON handler without Redis: the baseline the "
        "benchmarks compare against in the same process and event loop; and the "
        "rungs of their ladder between it and a real POST and GET (GET /bench/ping, "
        "POST /bench/post, GET /bench/page)",
    )
    log_format: str = _opt(
        "text", "log lines as plain text or as JSON objects", choices=("text", "json")
    )
    log_level: str = _opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    metrics_queues: str | None = _opt(
        None,
        f"PROJECT/QUEUE[,...] (at most {MAX_METRICS_QUEUES}): the queues whose depth, claimed, "
        "oldest age, dead letters and followers /metrics reports; no other queue is a label",
    )
    metrics_queue_refresh: float = _opt(
        5.0, "seconds a --metrics-queues reading serves /metrics", minimum=0.0, maximum=300.0
    )


# dataclasses gather a class's fields from its bases last to first: the
# sections are listed in reverse so that fields (and --help) keep their order
@dataclass(frozen=True)
class StoreSettings(QuotaSettings, AccessSettings, MessageSettings, RedisSettings):
    """What the storage drivers read: Redis, the message limits, the project
    quotas and, of the access section, the message encryption keys."""


@dataclass(frozen=True)
class Settings(
    LogSettings,
    ClientSettings,
    SubscriptionSettings,
    StoreSettings,
    ServiceSettings,
):
    """Every setting, flat (a flag each), declared by section. Only the app
    and the command line take it whole; they hand each subsystem its
    section by type (a Settings is each of its sections), so a subsystem
    reads only the section(s) it names, and mypy holds it to that."""

    def __post_init__(self) -> None:
        _check(self)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _check(settings: Settings) -> None:
    """Every value in range, and the settings consistent with each other;
    ValueError (one line, exit 2 from the CLI) otherwise."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"{_flag(f.name)} must be a number, got nan")
        lo = f.metadata.get("minimum")
        hi = f.metadata.get("maximum")
        if lo is not None and value < lo:
            raise ValueError(f"{_flag(f.name)} must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise ValueError(f"{_flag(f.name)} must be <= {hi}, got {value}")
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{_flag(f.name)} must be one of {', '.join(choices)}, got {value!r}")
    if settings.message_encryption_key is not None and len(settings.message_encryption_key) < 16:
        raise ValueError(
            "--message-encryption-key must be at least 16 characters long (a long random string)"
        )
    if settings.message_encryption_old_keys is not None:
        if settings.message_encryption_key is None:
            raise ValueError("--message-encryption-old-keys needs --message-encryption-key")
        if any(len(key) < 16 for key in settings.old_encryption_keys()):
            raise ValueError("--message-encryption-old-keys: each key has at least 16 characters")
    settings.auth_tokens()  # fails early on a malformed list
    _check_access(settings)
    if settings.admin_token is not None and settings.admin_token_file is not None:
        raise ValueError("give --admin-token or --admin-token-file, not both")
    settings.admin_secret()  # fails early on a short or unreadable token
    settings.worker_count()
    if settings.redis_url is not None and not settings.redis_url.startswith(URL_SCHEMES):
        raise ValueError(
            f"--redis-url must start with {', '.join(URL_SCHEMES)}, got {settings.redis_url!r}"
        )
    settings.redis_sentinel()  # fails early on a malformed sentinel URL
    subscriber_networks(settings.subscriber_allow)  # fails early on a malformed CIDR
    metrics_queue_names(settings.metrics_queues)
    smtp_address(settings.smtp_server)
    if settings.delivery_timeout * 2 >= settings.delivery_lease:
        raise ValueError("--delivery-timeout must be below half of --delivery-lease")
    if 0 < settings.project_rate < 0.001:
        raise ValueError("--project-rate must be 0 (no limit) or at least 0.001")
    if settings.project_burst and not settings.project_rate:
        raise ValueError("--project-burst needs --project-rate")
    if settings.require_confirmation and not settings.signed_url_key:
        raise ValueError(
            "--require-confirmation needs --signed-url-key (confirmation URLs are signed)"
        )
    pairs = [
        ("min_message_ttl", "default_message_ttl", "max_message_ttl"),
        ("min_claim_ttl", "default_claim_ttl", "max_claim_ttl"),
        ("min_claim_grace", "default_claim_grace", "max_claim_grace"),
        ("max_messages_per_page", "default_messages_per_page", None),
        ("max_queues_per_page", "default_queues_per_page", None),
    ]
    for lo_name, mid_name, hi_name in pairs:
        if hi_name is None:
            if getattr(settings, mid_name) > getattr(settings, lo_name):
                raise ValueError(f"{_flag(mid_name)} must not exceed {_flag(lo_name)}")
            continue
        lo, mid, hi = (getattr(settings, n) for n in (lo_name, mid_name, hi_name))
        if not lo <= mid <= hi:
            raise ValueError(
                f"need {_flag(lo_name)} <= {_flag(mid_name)} <= {_flag(hi_name)}"
                f", got {lo}, {mid}, {hi}"
            )


#: What --jwt-algorithms may name: the asymmetric JWS algorithms (RFC 7518, 8037).
JWT_ALGORITHMS = frozenset(
    ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
)
_ORIGIN = re.compile(
    r"^https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?$|^https?://\[[0-9A-Fa-f:.]+\](?::[0-9]{1,5})?$"
)


def _check_access(settings: Settings) -> None:
    """The JWT and CORS settings consistent (the token file is read at start)."""
    if settings.jwt_jwks_url is not None and settings.jwt_key_file is not None:
        raise ValueError("give --jwt-jwks-url or --jwt-key-file, not both")
    if settings.jwt_jwks_url is not None and not settings.jwt_jwks_url.startswith(
        ("http://", "https://")
    ):
        raise ValueError(
            f"--jwt-jwks-url must be an http:// or https:// URL, got {settings.jwt_jwks_url!r}"
        )
    if settings.jwt_on() and not (settings.jwt_issuer and settings.jwt_audience):
        raise ValueError("JWT bearer tokens need --jwt-issuer and --jwt-audience (both checked)")
    algorithms = settings.jwt_algorithm_list()
    refused = [name for name in algorithms if name not in JWT_ALGORITHMS]
    if refused or not algorithms:
        raise ValueError(
            f"--jwt-algorithms may name only {', '.join(sorted(JWT_ALGORITHMS))}, got "
            f"{settings.jwt_algorithms!r}"
        )
    if not settings.jwt_project_claim.strip():
        raise ValueError("--jwt-project-claim must name a claim")
    if settings.keystone_url is not None:
        if not settings.keystone_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--keystone-url must be an http:// or https:// URL, got {settings.keystone_url!r}"
            )
        if not (
            settings.keystone_user and settings.keystone_password_file and settings.keystone_project
        ):
            raise ValueError(
                "--keystone-url needs --keystone-user, --keystone-password-file and "
                "--keystone-project (feedsvc's service user)"
            )
    for origin in settings.cors_origins():
        if origin != "*" and not _ORIGIN.match(origin):
            raise ValueError(
                f"--cors-origin must be '*' or scheme://host[:port] (no path), got {origin!r}"
            )


def metrics_queue_names(queues: str | None) -> list[tuple[str, str]]:
    """(project, queue) pairs of --metrics-queues, in order, each once.

    A project may hold ``/`` (the queue name after the last one cannot), but
    not ``,``, which separates the pairs."""
    if not queues:
        return []
    pairs: dict[tuple[str, str], None] = {}
    for item in queues.split(","):
        project, slash, queue = item.strip().rpartition("/")
        if not slash or not 0 < len(project) <= 256 or not _QUEUE_NAME.match(queue):
            raise ValueError(
                f"--metrics-queues must be PROJECT/QUEUE[,PROJECT/QUEUE...], got {item.strip()!r}"
            )
        pairs[project, queue] = None
    if len(pairs) > MAX_METRICS_QUEUES:
        raise ValueError(
            f"--metrics-queues names at most {MAX_METRICS_QUEUES} queues, got {len(pairs)}"
        )
    return list(pairs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(f: dataclasses.Field[Any]) -> Any:
    kind = str(f.type)
    if kind == "int":
        return int
    if kind == "float":
        return float
    if kind == "bool":
        return _parse_bool
    if kind in ("Path", "Path | None"):
        return Path
    return str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting, in a group per section; defaults are resolved
    later (env, then field). A flag with choices shows them as its metavar
    (the settings check the value, with their own one-line message)."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        section = f.metadata["section"]
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        group = groups[section]
        default = f.default
        shown = "unset" if default is None else str(default)
        help_text = f"{f.metadata['help']} (env {_env_name(f.name)}; default {shown})"
        choices = f.metadata.get("choices")
        metavar = f.name.upper() if choices is None else "{" + ",".join(choices) + "}"
        if f.metadata.get("repeat"):
            group.add_argument(
                _flag(f.name), dest=f.name, default=None, metavar=metavar,
                action="append", help=help_text,
            )  # fmt: skip
        elif str(f.type) == "bool":
            group.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            group.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                metavar=metavar,
                help=help_text,
            )


def settings_from(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build settings: flag, else ``FEEDSVC_*`` variable, else the default.

    Raises ValueError with a one-line message naming the bad setting.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        raw: Any = getattr(args, f.name, None) if args is not None else None
        source = _flag(f.name)
        if raw is None and _env_name(f.name) in env:
            raw = env[_env_name(f.name)]
            source = _env_name(f.name)
        if raw is None:
            continue
        if isinstance(raw, list):  # a repeated flag
            raw = ",".join(raw)
        if isinstance(raw, str):
            if raw == "" and f.default is None:
                continue
            try:
                raw = _converter(f)(raw)
            except ValueError:
                raise ValueError(f"{source}: invalid value {raw!r}") from None
        values[f.name] = raw
    return Settings(**values)


def parse_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse ``serve`` flags alone (used by tests and embedding code)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from(parser.parse_args(list(argv)), environ)
