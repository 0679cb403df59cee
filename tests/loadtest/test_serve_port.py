"""A run's kvroute whose port another process took between its choice and serve's bind
(ports are chosen free, then bound: racy on a busy machine) starts on another port."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import pytest
import yaml

from loadtest.fleet import Cluster
from loadtest.launch import kvroute_serve, write_config


@pytest.mark.timeout(180)
async def test_a_port_taken_before_serve_binds_it_is_chosen_again(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    path = write_config(tmp_path / "p.yaml", Cluster(ctx_per_slot=2048), 1, "prefix")
    cfg = yaml.safe_load(path.read_text())
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", cfg["proxy"]["port"]))
        taker.listen()
        async with kvroute_serve(path, "prefix", 1, 120) as url:
            assert not url.endswith(f":{cfg['proxy']['port']}")
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
                assert r.status == 200
    assert "proxy.port: 127.0.0.1:" not in path.with_suffix(".serve.log").read_text()
