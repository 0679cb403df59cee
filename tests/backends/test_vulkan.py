"""The Vulkan variant on a real device (Mesa's lavapipe where no GPU is): managed backends
naming their device, every layer offloaded, so the KV cache lives in device memory and
the host-RAM and disk tiers copy it from there. The routing core runs through the proxy
on them: predictions as reported, the RAM tier, a slot saved by one backend restored into
another, the sliding-window and hybrid demo models.

Runs wherever the variant is built (`GPU=vulkan make run`), skipped otherwise; with
$KVROUTE_REQUIRE_VULKAN set (as `.ci/run` sets it) a missing variant or device fails.
Prompts are short: lavapipe prefills ~20 tokens a second."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import NoReturn

import pytest
from faults import FAST_HEALTH, until
from proxy_client import proxy
from proxy_client import slot_files_counted as counted
from test_proxy_e2e import Accuracy, cached_of, chat
from texts import words

from backends.binary import find_llama_server
from backends.config import KvDiskConfig, ManagedBackendConfig
from backends.demo_model import ensure_demo_model
from backends.devices import VISIBLE_ENV, listing
from backends.supervisor import Supervisor
from proxy.cli import main
from proxy.config.load import Config, RoutingConfig, load_config
from proxy.config.settings import ProxySettings
from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(240)
REQUIRE_ENV = "KVROUTE_REQUIRE_VULKAN"
DEVICE = "Vulkan0"


def _unavailable(why: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0"):
        pytest.fail(f"{why}, and ${REQUIRE_ENV} asks for the Vulkan tests (fix: `make "
                    "artifacts GPU=vulkan`, as .ci/run does: as root it installs glslc "
                    "and Mesa's lavapipe with apt)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def vulkan_bin() -> Path:
    found = find_llama_server(gpu="vulkan")
    if found is None:
        _unavailable("no Vulkan build of llama-server (GPU=vulkan make run builds one)")
    if not listing(found.path).devices:
        _unavailable(f"{found.path} lists no Vulkan device (fix: Mesa's lavapipe, apt "
                     "install mesa-vulkan-drivers, or a GPU's driver)")
    return found.path


def on_device(log: str) -> None:
    """Every layer and the KV cache in DEVICE's memory, as the server logged them."""
    layers = re.search(r"offloaded (\d+)/(\d+) layers", log)
    assert layers is not None and layers[1] == layers[2], layers
    assert f"{DEVICE} KV buffer size" in log


Pool = Callable[..., contextlib.AbstractAsyncContextManager[Supervisor]]


@pytest.fixture
def vulkan_pool(vulkan_bin: Path, pool_config: Callable[..., Config]) -> Pool:
    """Started backends on DEVICE, every layer offloaded: ``model`` (default: the demo),
    ``kv_disk``, router ``settings`` and pool_config's sizes."""

    @contextlib.asynccontextmanager
    async def start(*, model: Path | None = None, kv_disk: KvDiskConfig | None = None,
                    settings: dict[str, int] | None = None,
                    **sizes: int) -> AsyncIterator[Supervisor]:
        cfg = dataclasses.replace(pool_config(**sizes),
                                  routing=RoutingConfig(settings or {}))
        backends = []
        for b in cfg.backends:
            assert isinstance(b, ManagedBackendConfig)
            backends.append(dataclasses.replace(  # (-lv 4: where the buffers are)
                b, devices=(DEVICE,), extra_args=("-ngl", "all", "-lv", "4"),
                model=model or b.model))
        sup = Supervisor(dataclasses.replace(cfg, backends=tuple(backends), kv_disk=kv_disk,
                                             llama_server=str(vulkan_bin)))
        await sup.start()
        try:
            assert len(sup.ready()) == len(backends), sup.statuses()
            for status in sup.statuses():
                on_device(Path(str(status["log"])).read_text())
            yield sup
        finally:
            await sup.stop()

    return start


def test_the_build_lists_its_device_and_says_what_shows_it(vulkan_bin: Path) -> None:
    """ggml lists a CPU-type device (lavapipe) only when GGML_VK_VISIBLE_DEVICES names it:
    the listing says so, and the servers of the backends naming it get that setting."""
    got = listing(vulkan_bin)
    assert got.devices[0].name == DEVICE, got
    if "llvmpipe" in got.devices[0].description and VISIBLE_ENV not in os.environ:
        assert dict(got.env) == {VISIBLE_ENV: "0"}


async def test_a_backend_on_a_vulkan_device_serves_and_reuses_its_slot(
        vulkan_pool: Pool) -> None:
    async with vulkan_pool(n=1, slots=2, ctx_per_slot=2048) as sup, proxy(sup) as client:
        acc = Accuracy()
        messages = [{"role": "system", "content": words(60, 1)}]
        previous = 0
        for turn in range(3):
            messages.append({"role": "user", "content": words(15, 10 + turn)})
            headers, data = await chat(client, messages, max_tokens=4)
            acc.add(headers, data)
            assert cached_of(data) >= previous, (turn, data["timings"])
            usage = data["usage"]
            previous = usage["prompt_tokens"] - 4  # the template's turn ends are re-read
            messages.append({"role": "assistant",
                             "content": data["choices"][0]["message"]["content"] or ""})
        assert not acc.bad(), acc.rows
        assert cached_of(data) > 80


async def test_a_slot_evicted_to_host_ram_is_restored_to_the_device(vulkan_pool: Pool) -> None:
    """One slot: a second conversation's start copies the first's cache from device memory
    to the host-RAM cache; the first's next turn is loaded back from there."""
    async with vulkan_pool(n=1, slots=1, ctx_per_slot=2048, cache_ram_mib=64) as sup, \
            proxy(sup) as client:
        mine = [{"role": "user", "content": words(90, 21)}]
        _, first = await chat(client, mine, max_tokens=2)
        await chat(client, [{"role": "user", "content": words(40, 22)}], max_tokens=2)
        mine += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]
                  or ""}, {"role": "user", "content": words(10, 23)}]
        headers, data = await chat(client, mine, max_tokens=2)
    assert headers["X-Kvroute-Tier"] == "ram", headers
    assert cached_of(data) >= first["usage"]["prompt_tokens"] - 4, data["timings"]
    acc = Accuracy()
    acc.add(headers, data)
    assert not acc.bad(), acc.rows


async def test_a_slot_saved_by_one_backend_is_restored_into_another(
        vulkan_pool: Pool, tmp_path: Path) -> None:
    """Two backends on the device sharing kv_disk: a conversation saved from one (its
    device's KV in the file) continues on the other once the first stops answering
    (restored though short: lavapipe prefills too slowly for the usual prompts)."""
    disk = KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.3, min_tokens=64)
    stopped = None
    async with vulkan_pool(n=2, slots=1, ctx_per_slot=2048, cache_ram_mib=0, kv_disk=disk,
                           settings={"disk_min_gain_tokens": 64}) as sup:
        try:
            async with proxy(sup, ProxySettings(health=FAST_HEALTH)) as client:
                mine = [{"role": "user", "content": words(100, 31)}]
                headers, first = await chat(client, mine, max_tokens=2)
                await until(lambda: counted(client, "saved") >= 1, 30)
                stopped = sup.pid(headers["X-Kvroute-Backend"])
                assert stopped is not None
                os.kill(stopped, signal.SIGSTOP)
                router = client.server.app[ROUTER]
                await until(lambda: headers["X-Kvroute-Backend"] not in
                            router.snapshot()["backends"], 30)
                mine += [{"role": "assistant", "content": "Noted."},
                         {"role": "user", "content": words(10, 32)}]
                moved, data = await chat(client, mine, max_tokens=2)
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)
    assert moved["X-Kvroute-Backend"] != headers["X-Kvroute-Backend"]
    assert moved["X-Kvroute-Tier"] == "disk", moved
    assert cached_of(data) >= first["usage"]["prompt_tokens"] - 4, data["timings"]
    assert abs(int(moved["X-Kvroute-Predicted-Cached"]) - cached_of(data)) <= 1


@pytest.mark.parametrize("kind", ["demo-swa", "demo-hybrid"])
async def test_sliding_window_and_hybrid_models_run_offloaded(vulkan_pool: Pool,
                                                               kind: str) -> None:
    """Their per-slot state beside the KV cache (sliding layers' windows, recurrent
    states) lives on the device too: a second turn reuses the first, as predicted."""
    model = ensure_demo_model(kind=kind)
    async with vulkan_pool(n=1, slots=1, ctx_per_slot=2048, model=model) as sup, \
            proxy(sup) as client:
        if kind == "demo-hybrid":  # the recurrent layers' state too
            assert f"{DEVICE} RS buffer size" in Path(str(sup.statuses()[0]["log"])).read_text()
        acc = Accuracy()
        messages = [{"role": "user", "content": words(60, 41)}]
        for turn in range(2):
            headers, data = await chat(client, messages, max_tokens=2)
            acc.add(headers, data)
            messages += [{"role": "assistant",
                          "content": data["choices"][0]["message"]["content"] or ""},
                         {"role": "user", "content": words(10, 42 + turn)}]
    assert cached_of(data) >= 55, data["timings"]
    assert not acc.bad(), acc.rows


async def test_kvroute_init_writes_a_config_served_unchanged(
        vulkan_bin: Path, demo_model: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvroute init` with the Vulkan build sizes a backend for its device; `kvroute serve`
    runs that file as written (the device shown as init saw it), predicting as reported."""
    monkeypatch.setenv("KVROUTE_GPU", "vulkan")
    out = tmp_path / "vk.yaml"
    assert main(["init", str(demo_model), "--out", str(out), "--alias", "kvroute-demo"]) == 0
    cfg = load_config(out, check_port=False)
    (b,) = cfg.managed()
    assert (b.devices, b.extra_args, dict(b.env)) == ((DEVICE,), ("-ngl", "all"), {})
    sup = Supervisor(cfg)
    await sup.start()
    try:
        assert len(sup.ready()) == 1, sup.statuses()
        assert sup.config.llama_server is None  # the build KVROUTE_GPU names
        async with proxy(sup) as client:
            acc = Accuracy()
            for turn in range(2):
                headers, data = await chat(client, [
                    {"role": "system", "content": words(60, 51)},
                    {"role": "user", "content": words(10, 52 + turn)}], max_tokens=2)
                acc.add(headers, data)
        assert cached_of(data) >= 55, data["timings"]
        assert not acc.bad(), acc.rows
    finally:
        await sup.stop()
