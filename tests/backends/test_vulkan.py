"""The Vulkan variant on a real device (Mesa's lavapipe where no GPU is): a managed
backend naming its device, every layer offloaded, serving and reusing its slot's KV
cache on the device. Runs wherever the variant is built (`GPU=vulkan make run`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from backends.binary import find_llama_server
from backends.devices import list_devices
from backends.supervisor import Supervisor
from proxy.config.load import Config

# ggml lists CPU-type Vulkan devices (lavapipe) only when asked to
VISIBLE = {"GGML_VK_VISIBLE_DEVICES": "0"}


@pytest.fixture(scope="module")
def vulkan_bin() -> Path:
    found = find_llama_server(gpu="vulkan")
    if found is None:
        pytest.skip("no Vulkan build of llama-server (GPU=vulkan make run builds one)")
    return found.path


async def test_a_backend_on_a_vulkan_device_serves_and_reuses_its_slot(
        vulkan_bin: Path, pool_config: Callable[..., Config],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    listed = list_devices(vulkan_bin)
    assert listed and listed[0].name == "Vulkan0", listed
    cfg = pool_config(n=1, slots=1, ctx_per_slot=2048)
    b = dataclasses.replace(cfg.backends[0], devices=("Vulkan0",), env=VISIBLE,
                            extra_args=("-ngl", "all"))
    sup = Supervisor(dataclasses.replace(cfg, backends=(b,), llama_server=str(vulkan_bin)))
    await sup.start()
    try:
        (info,) = sup.ready()
        log = Path(str(sup.statuses()[0]["log"])).read_text()
        assert "--device Vulkan0 -ngl all" in log
        prompt = "Count the colours of a rainbow: red, orange, yellow, green, blue."
        body = {"prompt": prompt, "n_predict": 2, "cache_prompt": True, "id_slot": 0}
        headers = {"Authorization": f"Bearer {info.api_key}"}
        async with aiohttp.ClientSession() as http:
            got = []
            for _ in range(2):
                async with http.post(info.url + "/completion", json=body,
                                     headers=headers) as r:
                    assert r.status == 200, await r.text()
                    got.append((await r.json())["timings"])
        n = got[0]["prompt_n"]
        assert got[1]["cache_n"] == n - 1  # the whole prompt but its last token
    finally:
        await sup.stop()
