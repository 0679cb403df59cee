"""The shipped config.yaml's demo backends, run on the real llama-server.

The demo model's random weights never emit an end token: an answer whose request names no
length (Codex CLI sends none) would run to the slot's context. config.yaml caps it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp

from backends.supervisor import Supervisor
from proxy.config.load import load_config

REPO = Path(__file__).resolve().parents[2]
CAP = 256  # config.yaml's -n


async def test_an_answer_without_max_tokens_ends(tmp_path: Path) -> None:
    shipped = load_config(REPO / "config.yaml", check_port=False)
    demo = shipped.managed()[0]
    assert ("-n", str(CAP)) == demo.extra_args[-2:], demo.extra_args
    # a context well above the cap, so that only -n ends the answer
    small = dataclasses.replace(demo, slots=1, ctx_per_slot=4 * CAP, cache_ram_mib=0)
    cfg = dataclasses.replace(shipped, backends=(small,), log_dir=tmp_path / "logs")
    sup = Supervisor(cfg)
    await sup.start()
    try:
        (info,) = sup.ready()
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}]}
        async with aiohttp.ClientSession() as s, s.post(
                f"{info.url}/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {info.api_key}"}) as r:
            answer = await r.json()
        assert r.status == 200, answer
        assert answer["usage"]["completion_tokens"] == CAP
        assert answer["choices"][0]["finish_reason"] == "length"
    finally:
        await sup.stop()
