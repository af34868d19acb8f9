"""One URL to the run store's Redis, whatever its shape (redis-py's and kombu's conventions).

``TOOLOOP_REDIS_URL`` may be:

- ``redis://[user:password@]host:port/db``: one Redis; an ACL user goes in the URL.
- ``rediss://…?ssl_ca_certs=CA&ssl_certfile=CERT&ssl_keyfile=KEY&ssl_cert_reqs=required``:
  TLS, with redis-py's query arguments (kombu and Celery read the same ones).
- ``redis+sentinel://[user:password@]host:port[,host:port…]/SERVICE[/db]`` (or
  ``rediss+sentinel://`` for TLS to the data nodes): the sentinels name the primary of
  SERVICE. ``sentinel_username`` / ``sentinel_password`` in the query authenticate to
  the sentinels themselves; the other query arguments go to the data nodes.
- any node of a Redis Cluster, as a plain ``redis://host:port``: detected from the
  server (``INFO cluster`` says ``cluster_enabled:1``); redis-py's cluster client is
  used. No setting says so: the same deploy files work against either.

When the store's URL is also the broker (no ``TOOLOOP_BROKER_URL``), ``celery_urls``
translates it for kombu (a sentinel URL becomes kombu's ``sentinel://`` list with
``master_name``). A Redis Cluster cannot be the broker (kombu's Redis transport does
not support Cluster): the broker is then RabbitMQ or a separate plain Redis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis
from redis.cluster import RedisCluster

log = logging.getLogger(__name__)

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
SENTINEL_PORT = 26379
FAILOVER_RETRIES = 15  # ~12 s of retries, backing off to 1 s apart
_cluster_urls: dict[str, bool] = {}


@dataclass
class SentinelURL:
    hosts: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    options: dict[str, str] = field(default_factory=dict)  # for the data nodes
    sentinel_options: dict[str, str] = field(default_factory=dict)  # for the sentinels


def is_sentinel(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def parse_sentinel(url: str) -> SentinelURL:
    scheme, rest = url.split("://", 1)
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"{scheme}:// URL needs the service name as its path: …/SERVICE[/db]")
    options = dict(parse_qsl(query))
    own = [k for k in options if k in ("sentinel_username", "sentinel_password")]
    sentinel_options = {k.removeprefix("sentinel_"): options.pop(k) for k in own}
    return SentinelURL(
        hosts=[_host_port(h) for h in hosts.split(",") if h],
        service=unquote(parts[0]),
        db=int(parts[1]) if len(parts) > 1 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=SENTINEL_SCHEMES[scheme],
        options=options,
        sentinel_options=sentinel_options,
    )


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    return host, int(port) if port else SENTINEL_PORT


# -- an ACL user ---------------------------------------------------------------------
# Every command tooloop sends to Redis as store and broker (its Lua scripts included:
# Redis checks the commands a script calls too), measured with INFO commandstats over a
# run with tool calls, pause, steer, resume, abort, events and listing; plus the rarer
# paths' own: the judge's WATCH/UNWATCH, kombu's restore of unacked messages
# (ZREVRANGEBYSCORE) and binding lookups (SMEMBERS). A tooloop ACL user needs these only.
ACL_COMMANDS: tuple[str, ...] = (
    "auth", "hello", "ping", "info", "time",
    "evalsha", "script|load", "script|exists",
    "hget", "hgetall", "hmget", "hset", "hsetnx", "hdel", "hincrby", "hincrbyfloat", "hvals",
    "exists", "del", "expire", "get", "set",
    "lpush", "rpush", "lrange", "llen", "lrem", "brpop",
    "zadd", "zrem", "zrange", "zrevrange", "zrangebyscore", "zrevrangebyscore",
    "sadd", "srem", "smembers",
    "xadd", "xread",
    "multi", "exec", "watch", "unwatch",
    "publish", "psubscribe", "punsubscribe",
)  # fmt: skip


# What redis-py's cluster client sends besides (MONITOR on each primary of a cluster
# under the same kind of workload): the slot map, and the command table it reads keys by.
CLUSTER_ACL_COMMANDS: tuple[str, ...] = ("cluster|slots", "command", "command|getkeys")


def acl_rules(prefix: str, db: int = 0, commands: tuple[str, ...] = ACL_COMMANDS) -> list[str]:
    """``ACL SETUSER`` rules for a tooloop user: the commands, on the keys and pub/sub
    channels of one key prefix (``TOOLOOP_KEY_PREFIX``; kombu's are under it too).

    kombu subscribes to fanout exchanges with PSUBSCRIBE, and Redis matches a PSUBSCRIBE
    pattern literally against the user's channel patterns: Celery's remote control
    (``celery.pidbox``) and event receivers such as Flower (``celeryev``) are named here.
    """
    fanout = f"{prefix}:celery:/{db}."
    return [f"~{prefix}:*", f"&{prefix}:*", f"&{fanout}celery.pidbox", f"&{fanout}celeryev/*",
            *(f"+{c}" for c in commands)]  # fmt: skip


# -- the store's client ---------------------------------------------------------------
def connect(url: str, **options: Any) -> redis.Redis | RedisCluster:
    """A client for the run store at ``url`` (``options``: redis-py connection options)."""
    if is_sentinel(url):
        return _sentinel_master(parse_sentinel(url), **options)
    if is_cluster(url):
        return FailoverCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


class FailoverCluster(RedisCluster):
    """redis-py's cluster client, made to ride out a primary's failover.

    redis-py follows MOVED and ASK by itself, and after a lost connection, a cluster that
    is down or a slot not served, it reloads the slot map and tries again, but at once:
    its tries at a dead primary's slots are spent within milliseconds, long before the
    cluster marks the primary failed and promotes its replica (node timeout + election,
    2-4 s on loopback with a 2 s node timeout). Each command is therefore retried
    with a back-off too, as a sentinel's client is (``failover_retry``). A command
    that timed out is not retried here: redis-py already tried it again, and a node
    that does not answer at all is not a failover in progress.
    """

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        once = super().execute_command
        return cluster_retry().call_with_retry(lambda: once(*args, **kwargs), lambda _error: None)


def cluster_retry() -> Any:
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return Retry(ExponentialBackoff(cap=1.0, base=0.1), FAILOVER_RETRIES, supported_errors=_failover_errors())


def _failover_errors() -> tuple[type[Exception], ...]:
    """What a failover in progress looks like to a cluster client (not a timeout)."""
    from redis.exceptions import ClusterDownError, MasterDownError, SlotNotCoveredError, TryAgainError

    return (redis.ConnectionError, ClusterDownError, SlotNotCoveredError, MasterDownError, TryAgainError)


def _sentinel_master(parsed: SentinelURL, **options: Any) -> redis.Redis:
    from redis.sentinel import Sentinel

    data = {"retry": failover_retry(), **_data_options(parsed, options)}
    sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel_kwargs.update(parsed.sentinel_options)
    sentinel = Sentinel(parsed.hosts, sentinel_kwargs=sentinel_kwargs, **data)
    return sentinel.master_for(parsed.service, db=parsed.db)


def _data_options(parsed: SentinelURL, options: dict[str, Any]) -> dict[str, Any]:
    data = {**parsed.options, **options}
    if parsed.username:
        data["username"] = parsed.username
    if parsed.password:
        data["password"] = parsed.password
    if parsed.tls:
        data["ssl"] = True
    return data


def failover_retry() -> Any:
    """Ride out a failover (a replica promoted within a few seconds): each retry asks the
    sentinels, or the cluster, for the primary again. A plain Redis keeps redis-py's default."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return Retry(ExponentialBackoff(cap=1.0, base=0.1), FAILOVER_RETRIES)


CONNECTION_FIELDS = ("password", "username", "host", "port", "path", "credential_provider")


def forget_credentials(client: Any) -> None:
    """Empty what a redis-py client (plain or cluster) holds of its server's address and
    credentials: the connection arguments of its pools and of every connection they made
    (a connection copies the password). For the fork layer's tool calls
    (worker/sandbox/forget.py), and for clients dropped while the process lives on."""
    nodes_manager = getattr(client, "nodes_manager", None)
    for key in CONNECTION_FIELDS:
        getattr(nodes_manager, "connection_kwargs", {}).pop(key, None)
    for pool in _pools(client):
        for key in CONNECTION_FIELDS:
            pool.connection_kwargs.pop(key, None)
        made = [*getattr(pool, "_available_connections", ()), *getattr(pool, "_in_use_connections", ()),
                *getattr(pool, "_connections", ())]  # (the last: a BlockingConnectionPool's) # fmt: skip
        for connection in made:
            for name in (*CONNECTION_FIELDS, "_host"):
                if name in connection.__dict__:
                    connection.__dict__[name] = None


def _pools(client: Any) -> list[Any]:
    """A client's connection pools: its own, or one per node of a cluster client."""
    nodes = getattr(getattr(client, "nodes_manager", None), "nodes_cache", None) or {}
    clients = [client, *(getattr(node, "redis_connection", None) for node in nodes.values())]
    return [pool for c in clients if (pool := getattr(c, "connection_pool", None)) is not None]


def is_cluster(url: str) -> bool:
    """Whether the Redis at ``url`` is a node of a Redis Cluster (asked once per process)."""
    if urlsplit(url).scheme not in ("redis", "rediss"):
        return False
    if url not in _cluster_urls:
        probe = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        try:
            info = probe.info("cluster")
        except redis.ConnectionError:
            return False  # not answering yet: ask again next time, the caller's client will fail
        except redis.ResponseError as exc:  # e.g. an ACL user without +info
            log.warning("cannot tell whether %s is a Redis Cluster (%s): assuming it is not",
                        redact(url), exc)  # fmt: skip
            info = {}
        finally:  # closed, it lingers as cyclic garbage until collected: a forked tool call copies it
            probe.close()
            forget_credentials(probe)
        _cluster_urls[url] = bool(info.get("cluster_enabled"))
    return _cluster_urls[url]


def connect_async(url: str, **options: Any) -> Any:
    """The asyncio twin of ``connect`` (the operator API's event streams)."""
    from redis import asyncio as aioredis

    if is_sentinel(url):
        from redis.asyncio.sentinel import Sentinel

        parsed = parse_sentinel(url)
        sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
        sentinel_kwargs.update(parsed.sentinel_options)
        data = {"retry": async_failover_retry(), **_data_options(parsed, options)}
        sentinel = Sentinel(parsed.hosts, sentinel_kwargs=sentinel_kwargs, **data)
        return sentinel.master_for(parsed.service, db=parsed.db)
    if is_cluster(url):
        return _async_failover_cluster().from_url(url, **options)
    return aioredis.Redis.from_url(url, **options)


def async_failover_retry() -> Any:
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    return Retry(ExponentialBackoff(cap=1.0, base=0.1), FAILOVER_RETRIES)


@cache
def _async_failover_cluster() -> type:
    """``FailoverCluster`` for asyncio: redis-py's asyncio cluster client also retries at once."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    class AsyncFailoverCluster(AsyncRedisCluster):
        async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
            once = super().execute_command
            return await async_cluster_retry().call_with_retry(lambda: once(*args, **kwargs), _ignore)

    return AsyncFailoverCluster


def async_cluster_retry() -> Any:
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    return Retry(ExponentialBackoff(cap=1.0, base=0.1), FAILOVER_RETRIES, supported_errors=_failover_errors())


async def _ignore(_error: Exception) -> None:
    return None


# -- the same URL, for Celery -----------------------------------------------------------
@dataclass
class CeleryURLs:
    broker: str
    broker_transport: dict[str, Any]
    backend: str | None
    backend_transport: dict[str, Any]


def celery_urls(redis_url: str, broker_url: str | None) -> CeleryURLs:
    """Broker and result backend URLs (and transport options) for kombu and Celery."""
    broker = broker_url or redis_url
    if broker == redis_url and is_cluster(redis_url):
        raise ValueError(
            f"{redact(redis_url)} is a Redis Cluster node: it can hold the run store but not be the "
            "broker (kombu's Redis transport does not support Cluster). Set TOOLOOP_BROKER_URL to "
            "amqp://… (RabbitMQ) or to a separate plain redis://…"
        )
    broker, broker_transport = kombu_url(broker)
    if is_cluster(redis_url):
        backend, backend_transport = None, {}  # results are ignored; Celery's backend has no Cluster
    else:
        backend, backend_transport = kombu_url(redis_url)
    return CeleryURLs(broker, broker_transport, backend, backend_transport)


def kombu_url(url: str) -> tuple[str, dict[str, Any]]:
    """A store-style URL as kombu/Celery spell it, with the transport options it needs."""
    if not is_sentinel(url):
        return url, {}
    parsed = parse_sentinel(url)
    auth = ""
    if parsed.username or parsed.password:
        auth = f"{quote(parsed.username or '', safe='')}:{quote(parsed.password or '', safe='')}@"
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in parsed.options.items())
    if parsed.tls and "ssl_cert_reqs" not in parsed.options:
        query = "&".join(filter(None, [query, "ssl_cert_reqs=required"]))
    suffix = f"/{parsed.db}" + (f"?{query}" if query else "")
    urls = ";".join(f"sentinel://{auth}{host}:{port}{suffix}" for host, port in parsed.hosts)
    transport: dict[str, Any] = {"master_name": parsed.service}
    if parsed.sentinel_options:
        transport["sentinel_kwargs"] = dict(parsed.sentinel_options)
    return urls, transport


def redact(url: str) -> str:
    """The URL without its password (for logs and errors)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    return url.replace(f":{parts.password}@", ":**@", 1)
