"""Starting what a load-test run measures: `kvroute serve` as a subprocess on a generated
config (waited for on /health, stopped with SIGTERM), one managed llama-server for the
no-proxy baseline, and reading kvroute's and the servers' /metrics at the end of a run."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from backends.client import BackendClient
from backends.process import free_port
from loadtest.fleet import Cluster, policy_variant, terminate


def write_config(path: Path, cluster: Cluster, n_backends: int, policy: str) -> Path:
    """A config of ``n_backends`` managed backends; ``policy`` may carry settings
    (``policy_variant``)."""
    policy, routing = policy_variant(policy)
    cfg: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "port": free_port(), "policy": policy},
        "log_dir": str(path.parent / "logs" / path.stem),
        "supervision": {"startup_timeout_s": cluster.startup_timeout_s},
        "backends": [{"name": chr(ord("a") + i), "model": cluster.model,
                      "slots": cluster.slots, "ctx_per_slot": cluster.ctx_per_slot,
                      "threads": cluster.threads, "cache_ram_mib": cluster.cache_ram_mib,
                      **_offload(cluster, i)}
                     for i in range(n_backends)],
    }
    if routing:
        cfg["routing"] = routing
    if cluster.kv_disk:  # a directory of its own per run: the index starts empty
        cfg["kv_disk"] = {"path": str(path.parent / "slots" / path.stem)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _offload(cluster: Cluster, i: int) -> dict[str, Any]:
    devices, flags = cluster.offload(i)
    return {"devices": list(devices), "extra_args": list(flags)} if devices else {}


async def _wait_health(url: str, n: int, proc: subprocess.Popen[bytes], log: Path,
                       timeout_s: float) -> None:
    """Until ``proc`` serves ``url`` with ``n`` backends ready: its health says so, and its
    log that it is what listens there (not a server that took the port before it)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvroute serve exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(url + "/health") as r:
                    if r.status == 200 and (await r.json()).get("backends_ready", 0) >= n \
                            and f"listening on {url} " in log.read_text(errors="replace"):
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"kvroute at {url} not healthy within {timeout_s:.0f} s")


@contextlib.asynccontextmanager
async def kvroute_serve(cfg_path: Path, policy: str, n: int, timeout_s: float,
                        log_level: str = "info") -> AsyncIterator[str]:
    """A `kvroute serve` subprocess; yields its URL, SIGTERMs it (and waits) on exit. Its
    log (one line per routing decision at info; the policy's reasons at debug) goes to
    `<config>.serve.log`, next to the run's report. A port taken between its choice and
    serve's bind (free_port is racy) is chosen again."""
    port = int(yaml.safe_load(cfg_path.read_text())["proxy"]["port"])
    log = cfg_path.with_suffix(".serve.log")
    for attempt in range(3):
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg_path),
                 "--port", str(port), "--policy", policy, "--log-level", log_level],
                stdout=fh, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_health(url, n, proc, log, timeout_s)
        except RuntimeError as e:
            await terminate(proc, 30.0)
            said = log.read_text(errors="replace")
            if attempt == 2 or f"proxy.port: 127.0.0.1:{port} " not in said:
                raise RuntimeError(f"{e}; {log} ends:\n{said[-2000:]}") from None
            port = free_port()
            continue
        try:
            yield url
        finally:
            # NOTE: killed if its supervisor does not finish in time: its llama-servers run
            # in their own process groups and are stopped by their own parent-death check
            await terminate(proc, 30.0)
        return


@contextlib.asynccontextmanager
async def direct_backend(cfg_path: Path, timeout_s: float) -> AsyncIterator[tuple[str, str | None]]:
    """One managed llama-server, no proxy; yields (url, api key)."""
    from backends.supervisor import Supervisor
    from proxy.config.load import load_config

    sup = Supervisor(load_config(cfg_path, check_port=False))
    try:
        await asyncio.wait_for(sup.start(), timeout_s)
        ready = sup.ready()
        if not ready:
            raise RuntimeError(f"direct backend did not start: {sup.statuses()}")
        yield ready[0].url, ready[0].api_key
    finally:
        await sup.stop()


async def scrape_metrics(url: str) -> dict[str, Any]:
    """kvroute's prediction error and per-backend token counters (empty if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
                    http.get(url + "/metrics") as r):
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return {}
    out: dict[str, Any] = {"per_backend": {}}
    per = out["per_backend"]
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            b = s.labels.get("backend")
            if s.name == "kvroute_prediction_error_tokens_sum":
                out["prediction_error_sum"] = s.value
            elif s.name == "kvroute_prediction_error_tokens_count":
                out["prediction_error_count"] = s.value
            elif b and s.name in ("kvroute_prompt_tokens_total",
                                  "kvroute_predicted_cached_tokens_total",
                                  "kvroute_reported_cached_tokens_total"):
                key = s.name.removeprefix("kvroute_").removesuffix("_total")
                per.setdefault(b, {})[key] = s.value
            elif s.name == "kvroute_retries_total":
                out["retries"] = out.get("retries", 0) + s.value
            elif b and s.name == "kvroute_requests_total":
                d = per.setdefault(b, {})
                d["requests"] = d.get("requests", 0) + s.value
    n = out.get("prediction_error_count", 0)
    if n:
        out["prediction_error_mean"] = out["prediction_error_sum"] / n
    return out


async def scrape_servers(urls: list[str]) -> dict[str, float]:
    """The llama-servers' prefill over a run: prompt tokens and seconds summed over
    ``urls`` (their /metrics: a batch's prompt tokens and its time), and their ratio, the
    servers' prefill throughput: lower on a machine slowed by others, and for tokens
    prefilled after a long reused prefix (they attend to more). Empty if a server does
    not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    tokens = seconds = 0.0
    async with aiohttp.ClientSession() as http:
        texts = [await BackendClient(http, url, timeout=5).metrics() for url in urls]
    try:
        for text in texts:
            if not isinstance(text, str):
                return {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "llamacpp:prompt_tokens_total":
                        tokens += s.value
                    elif s.name == "llamacpp:prompt_seconds_total":
                        seconds += s.value
    except ValueError:  # not Prometheus text
        return {}
    return {"prompt_tokens": tokens, "prompt_seconds": seconds,
            "prefill_tps": tokens / seconds if seconds else 0.0}
