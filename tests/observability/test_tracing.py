"""OpenTelemetry spans (`proxy.otel: true`): one per routed attempt, a child of the
client's trace, carrying the decision and what the backend reported; none when off; a
config asking for them without the SDK and exporter installed is refused at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from proxy_client import proxy
from texts import words

from proxy.config.settings import ProxySettings

EXPORTED = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(EXPORTED))
trace.set_tracer_provider(_provider)  # (once per process: the API allows one)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def turn(client: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    async with client.post("/v1/chat/completions", headers={"traceparent": PARENT},
                           json={"model": "m", "max_tokens": 2, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        messages.append({"role": "assistant", "content": "Noted."})
        return {"backend": r.headers["X-Kvroute-Backend"], "reused": body["timings"]["cache_n"],
                "predicted": int(r.headers["X-Kvroute-Predicted-Cached"])}


@pytest.mark.parametrize("otel", [True, False])
async def test_a_span_per_request_in_the_clients_trace(backend_pool: Any, otel: bool) -> None:
    EXPORTED.clear()
    sup = await backend_pool()
    async with proxy(sup, ProxySettings(otel=otel)) as client:
        conv = [{"role": "user", "content": words(80, 900)}]
        answers = [await turn(client, conv)]
        conv.append({"role": "user", "content": words(10, 901)})
        answers.append(await turn(client, conv))
    spans = [s for s in EXPORTED.get_finished_spans() if s.name == "kvroute.route"]
    if not otel:
        assert spans == []
        return
    assert len(spans) == 2
    for span, answer in zip(spans, answers, strict=True):
        assert format(span.context.trace_id, "032x") == TRACE_ID  # the client's trace
        assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT[36:52]
        a = span.attributes
        assert a["kvroute.backend"] == answer["backend"]
        assert a["kvroute.reported_cached"] == answer["reused"]
        assert a["kvroute.predicted_cached"] == answer["predicted"]
        assert a["http.response.status_code"] == 200 and a["kvroute.endpoint"] == "chat"
    assert spans[1].attributes["kvroute.tier"] == "slot"


def test_asking_for_spans_with_the_api_alone_is_refused_at_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from proxy.config.fields import ConfigError
    from proxy.config.load import parse_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry.sdk")
                        else real(name, *a))  # (the API alone, as other packages pull in)
    with pytest.raises(ConfigError, match="pip install 'kvroute\\[otel\\]'"):
        parse_config({"backends": [{"name": "a", "model": "demo"}], "proxy": {"otel": True}},
                     tmp_path, allow_missing_demo=True)
