"""The backends' own metrics on kvroute's /metrics, each sample labelled with its backend.

Managed llama-servers listen on ports and keys of kvroute's own, so nothing else can
scrape them. When kvroute is scraped it fetches every routed backend's /metrics
(llama-server `--metrics`; managed ones have it, an external one without it is left out)
within `SCRAPE_TIMEOUT_S`, and re-exports each family under its own name with a
`backend` label; `kvroute_backend_metrics_up{backend}` says whose came. Only the
`llamacpp:*` families of llama-servers: a server behind another router (another
kvroute) exports that router's names too, which would collide with kvroute's own.
Parsed and written by prometheus-client, the format's own library.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from backends.client import BackendClient
from backends.info import BackendInfo

# A scrape waits for the slowest backend: one busy in a long prefill still answers
# /metrics from its HTTP thread, so this only cuts off a hung one.
SCRAPE_TIMEOUT_S = 2.0
LLAMACPP = "llamacpp:"  # the prefix of llama-server's own metric names


async def scrape(session: aiohttp.ClientSession, backends: Iterable[BackendInfo]) -> bytes:
    """Every llama-server's families, relabelled, and whose came, in Prometheus text."""
    infos = [b for b in backends if b.dialect.has_metrics]
    texts = await asyncio.gather(*(
        BackendClient(session, b.url, b.api_key, timeout=SCRAPE_TIMEOUT_S).metrics()
        for b in infos))
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily("kvroute_backend_metrics_up",
                           "1 when the backend's own /metrics answered this scrape.",
                           labels=["backend"])
    for info, text in zip(infos, texts, strict=True):
        ok = isinstance(text, str) and _merge(families, info.name, text)
        up.add_metric([info.name], 1.0 if ok else 0.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), up]))
    return generate_latest(registry)


def _merge(families: dict[str, Metric], backend: str, text: str) -> bool:
    """Add ``text``'s samples to ``families`` with ``backend`` as a label; False when
    it is not Prometheus text."""
    try:
        parsed = list(text_string_to_metric_families(text))
    except ValueError:
        return False
    for fam in parsed:
        if not fam.name.startswith(LLAMACPP):
            continue  # (kvroute's own names, a runtime's process_*: not the server's)
        into = families.get(fam.name)
        if into is None:
            into = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                               fam.unit)
        for s in fam.samples:
            labels = dict(s.labels)
            if "backend" in labels:  # (a server behind a router of its own)
                labels["exported_backend"] = labels.pop("backend")
            into.add_sample(s.name, {**labels, "backend": backend}, s.value,
                            s.timestamp, s.exemplar)
    return True


class _Fixed(Collector):
    """Families collected already (a registry renders only collectors)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
