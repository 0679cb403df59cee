"""Each kind of backend has its dialect, and what it serves is what the proxy sends it."""

from __future__ import annotations

from backends.config import BACKEND_KINDS, LLAMA, OPENAI
from backends.dialect import (
    CHAT_PATH,
    DIALECTS,
    NATIVE_PATHS,
    OPENAI_PATHS,
    PASSTHROUGH_GET,
    PASSTHROUGH_POST,
    dialect_of,
)
from backends.info import BackendInfo


def test_every_kind_has_a_dialect() -> None:
    assert set(DIALECTS) == set(BACKEND_KINDS)
    assert all(dialect_of(kind).kind == kind for kind in BACKEND_KINDS)


def test_a_llama_server_serves_any_path_and_an_openai_server_the_api() -> None:
    llama, openai = dialect_of(LLAMA), dialect_of(OPENAI)
    for path in (*OPENAI_PATHS, *NATIVE_PATHS, *PASSTHROUGH_POST, *PASSTHROUGH_GET, ""):
        assert llama.serves(path)
        assert openai.serves(path) == (path in OPENAI_PATHS)
    assert CHAT_PATH in OPENAI_PATHS
    # nothing of llama-server's is asked of or sent to a server of the OpenAI API
    assert not any(getattr(openai, f) for f in ("pins_slots", "has_slots", "saves_slots",
                                                "has_health", "renders_prompts",
                                                "returns_tokens", "any_model_name",
                                                "has_metrics"))


def test_a_backend_reads_its_dialect_from_its_kind() -> None:
    info = BackendInfo(name="b", url="http://x", api_key=None, n_slots=1, slot_ctx=8,
                       ram_cache_bytes=0, kv_bytes_per_token=1, model="m", managed=False)
    assert info.dialect is dialect_of(LLAMA)
    assert BackendInfo(**{**info.__dict__, "kind": OPENAI}).dialect is dialect_of(OPENAI)
