"""The typed keys under which the app keeps its long-lived resources (aiohttp AppKeys).

Every endpoint module reads its resources through these; proxy/app.py creates them.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.disk.tier import DiskTier
from proxy.forwarding.forwarder import Forwarder
from proxy.forwarding.health import BackendHealth
from proxy.forwarding.upstream import Upstream
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.recent import RecentActivity
from proxy.observability.tracing import Tracing
from proxy.replicas.bus import ReplicaBus
from proxy.reporting.recorder import Recorder
from proxy.routing.router import Router
from proxy.server.admission import Admission
from proxy.server.event_streams import EventStreams
from proxy.server.pools import Pools
from proxy.server.tokenizing import Tokenizing

CONFIG = web.AppKey("kvroute.config", Config)
SUPERVISOR = web.AppKey("kvroute.supervisor", Supervisor)
SETTINGS = web.AppKey("kvroute.settings", ProxySettings)
METRICS = web.AppKey("kvroute.metrics", ProxyMetrics)
ADMISSION = web.AppKey("kvroute.admission", Admission)
# What the pools share, made once with the app (proxy/server/pools.py `Shared`): the
# request path's client, the client off it (probes, /slots, backends' /metrics), each
# request's metrics and log line, its spans, and the disk tier (only with `kv_disk:`)
UPSTREAM = web.AppKey("kvroute.upstream", Upstream)
SESSION = web.AppKey("kvroute.session", aiohttp.ClientSession)
RECORDER = web.AppKey("kvroute.recorder", Recorder)
TRACING = web.AppKey("kvroute.tracing", Tracing)
DISK = web.AppKey("kvroute.disk", DiskTier)
# The model pools, each built whole (proxy/server/pools.py `build_pool`)
POOLS = web.AppKey("kvroute.pools", Pools)
# The first pool's (the only one's, in most configurations): for tests and tools that
# serve one model
ROUTER = web.AppKey("kvroute.router", Router)
HEALTH = web.AppKey("kvroute.health", BackendHealth)
TOKENIZING: web.AppKey[Tokenizing] = web.AppKey("kvroute.tokenizing")
FORWARDER = web.AppKey("kvroute.forwarder", Forwarder)
REPLICAS = web.AppKey("kvroute.replicas", ReplicaBus)  # only with `replicas:` configured
# the status page: recent routing decisions (filled by the Recorder) and its open streams
RECENT = web.AppKey("kvroute.recent", RecentActivity)
STATUS_STREAMS = web.AppKey("kvroute.status_streams", EventStreams)
