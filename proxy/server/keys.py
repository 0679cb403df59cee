"""The typed keys under which the app keeps its long-lived resources (aiohttp AppKeys).

Every endpoint module reads its resources through these; proxy/app.py creates them.
"""

from __future__ import annotations

from aiohttp import web

from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.forwarding.forwarder import Forwarder
from proxy.forwarding.health import BackendHealth
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.recent import RecentActivity
from proxy.replicas.bus import ReplicaBus
from proxy.routing.router import Router
from proxy.server.admission import Admission
from proxy.server.event_streams import EventStreams
from proxy.server.pools import Pools
from proxy.server.tokenizing import Tokenizing

CONFIG = web.AppKey("kvroute.config", Config)
SUPERVISOR = web.AppKey("kvroute.supervisor", Supervisor)
SETTINGS = web.AppKey("kvroute.settings", ProxySettings)
METRICS = web.AppKey("kvroute.metrics", ProxyMetrics)
ROUTER = web.AppKey("kvroute.router", Router)
HEALTH = web.AppKey("kvroute.health", BackendHealth)
ADMISSION = web.AppKey("kvroute.admission", Admission)
TOKENIZING: web.AppKey[Tokenizing] = web.AppKey("kvroute.tokenizing")
FORWARDER = web.AppKey("kvroute.forwarder", Forwarder)
# The model pools; ROUTER, HEALTH, TOKENIZING and FORWARDER are the first one's (the
# only one's, in most configurations), and the FORWARDER's session and slot store the
# app's.
POOLS = web.AppKey("kvroute.pools", Pools)
REPLICAS = web.AppKey("kvroute.replicas", ReplicaBus)  # only with `replicas:` configured
# the status page: recent routing decisions (filled by the Recorder) and its open streams
RECENT = web.AppKey("kvroute.recent", RecentActivity)
STATUS_STREAMS = web.AppKey("kvroute.status_streams", EventStreams)
