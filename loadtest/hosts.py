"""kvroute's parts on hosts of loadtest/netns.py: llama-servers, a NATS broker, replicas.

Each host has its own addresses, so every process listens on its host's address and the
ports repeat from host to host. The replicas are `kvroute serve` processes that see the
llama-servers as `url:` backends (the demo GGUF as tokenizer gives exact tokens).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from backends.process import ServerSpec
from loadtest.netns import Net

NATS_PORT = 4222
PROXY_PORT = 8080


def nats_binary() -> str | None:
    return shutil.which("nats-server")


def spawn_broker(net: Net, host: str, logs: Path) -> subprocess.Popen[bytes]:
    """Debian's nats-server on ``host``; its URL is broker_url(net, host)."""
    return net.spawn(host, [nats_binary() or "nats-server", "-a", net.ip(host),
                            "-p", str(NATS_PORT)], log=logs / f"{host}.log")


def broker_url(net: Net, host: str) -> str:
    return f"nats://{net.ip(host)}:{NATS_PORT}"


def spawn_backend(net: Net, host: str, spec: ServerSpec, logs: Path, name: str,
                  key: str | None = None) -> str:
    """A llama-server of ``spec`` on ``host`` (its address replaces spec.host), as the
    supervisor starts its own: the API key in the environment, out of argv. Its URL."""
    spec = dataclasses.replace(spec, host=net.ip(host))
    net.spawn(host, spec.argv(), log=logs / f"{name}.log",
              env={"LLAMA_API_KEY": key} if key else None)
    return spec.url


def spawn_replica(net: Net, host: str, backends: list[dict[str, Any]], tokenizer: Path,
                  logs: Path, nats: str | None, proxy: dict[str, Any] | None = None
                  ) -> str:
    """`kvroute serve` on ``host`` in front of ``backends`` (config entries), a replica
    named after its host on broker ``nats`` (None: alone). Its base URL."""
    cfg = logs / f"{host}.yaml"
    doc: dict[str, Any] = {
        "proxy": {"host": net.ip(host), "port": PROXY_PORT, "tokenizer": str(tokenizer),
                  **(proxy or {})},
        "log_dir": str(logs / f"{host}-logs"),
        "supervision": {"health_interval_s": 0.5},
        "backends": backends,
    }
    if nats is not None:
        doc["replicas"] = {"nats": nats, "id": host}
    cfg.write_text(yaml.safe_dump(doc))
    net.spawn(host, [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg)],
              log=logs / f"{host}.log")
    return f"http://{net.ip(host)}:{PROXY_PORT}"


def ready(status: dict[str, Any], shared: bool) -> bool:
    """Does a replica's /kvroute/status say it routes to every backend (and, ``shared``,
    that it is connected to the broker)?"""
    return bool(status) and all(b["healthy"] and b["routed"] for b in status["backends"]) \
        and (not shared or bool((status.get("replicas") or {}).get("connected")))


def tails(logs: Path, lines: int = 8) -> str:
    """The last lines of every log in ``logs``, for a failure's message."""
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace")
                                                   .splitlines()[-lines:])
                     for p in sorted(logs.glob("*.log")))
