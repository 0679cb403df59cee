"""The backends' own metrics on kvroute's /metrics: two real llama-servers behind keys of
kvroute's own, each family once, each sample labelled with its backend, and the counts
the servers keep (prompt tokens processed) adding up to what was sent through kvroute."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families
from proxy_client import proxy
from texts import words

from backends.supervisor import Supervisor
from proxy.config.load import Config


async def test_each_backends_metrics_come_labelled(pool_config: Callable[..., Config]) -> None:
    sup = Supervisor(pool_config(n=2, slots=1, cache_ram_mib=0))
    await sup.start()
    try:
        async with proxy(sup) as client:
            processed = generated = reused = 0
            for i in range(4):
                async with client.post("/v1/chat/completions", json={
                        "model": "kvroute-demo", "max_tokens": 2,
                        "messages": [{"role": "user", "content": words(60, 200 + i % 2)}]}
                        ) as r:
                    body = await r.json()
                    assert r.status == 200, body
                    processed += body["timings"]["prompt_n"]
                    generated += body["timings"]["predicted_n"]
                    reused += body["timings"]["cache_n"]
            async with client.get("/metrics") as r:
                assert r.status == 200
                text = await r.text()
    finally:
        await sup.stop()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # one family, whoever has it
    families = {f.name: f for f in text_string_to_metric_families(text)}
    up = {s.labels["backend"]: s.value for s in families["kvroute_backend_metrics_up"].samples}
    assert up == {"a": 1.0, "b": 1.0}
    prompt = [s for s in families["llamacpp:prompt_tokens"].samples
              if s.name == "llamacpp:prompt_tokens_total"]
    assert {s.labels["backend"] for s in prompt} == {"a", "b"}
    assert sum(s.value for s in prompt) == processed
    assert "kvroute_requests" in families  # kvroute's own, beside them

    def total(family: str, sample: str) -> float:
        return sum(s.value for s in families[family].samples if s.name == sample)

    assert total("kvroute_output_tokens", "kvroute_output_tokens_total") == generated
    by_tier: dict[str, float] = {}
    for s in families["kvroute_reused_tokens"].samples:
        if s.name == "kvroute_reused_tokens_total":
            by_tier[s.labels["tier"]] = by_tier.get(s.labels["tier"], 0.0) + s.value
    assert sum(by_tier.values()) == reused > 0 and by_tier.get("slot", 0) > 0, by_tier
    assert total("kvroute_time_per_output_token_seconds",
                 "kvroute_time_per_output_token_seconds_count") == 4
    assert total("kvroute_admission_wait_seconds", "kvroute_admission_wait_seconds_count") >= 4
    info = families["kvroute_build_info"].samples[0]
    assert info.value == 1 and info.labels["llama_cpp"] != "unknown"
