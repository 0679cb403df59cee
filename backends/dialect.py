"""What a backend's server speaks: one `Dialect` per kind of backend (config.yaml's
`kind:`), with what it accepts and the paths it serves.

Every place that treats kinds of backend differently reads a capability here
(`BackendInfo.dialect`, or `dialect_of(kind)` for a configuration), so that a kind's
differences are listed in one place and a new kind is one more `Dialect`; no other
module compares a backend's kind (tests/test_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.config import LLAMA, OPENAI

CHAT_PATH = "/v1/chat/completions"
# The OpenAI API's endpoints: all that a backend of kind openai serves, and those whose
# streams report usage only when asked (`stream_options.include_usage`).
OPENAI_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
# llama-server's own answers: /infill answers as /completion does
NATIVE_PATHS = frozenset({"/completion", "/infill"})
# llama-server's calls the proxy forwards as they are (no prefix to route by)
PASSTHROUGH_POST = ("/tokenize", "/detokenize", "/apply-template", "/v1/embeddings",
                    "/embeddings")
PASSTHROUGH_GET = ("/props", "/lora-adapters")


@dataclass(frozen=True)
class Dialect:
    """What one kind of backend accepts and answers."""

    kind: str  # config.yaml's `kind:` (BackendInfo.kind)
    paths: frozenset[str] | None  # the paths it serves; None: any (its own included)
    pins_slots: bool  # takes `id_slot`: a request runs in the slot kvroute chose
    has_slots: bool  # GET /slots says what each slot holds and whether it is busy
    saves_slots: bool  # POST /slots/{id}?action=save|restore (--slot-save-path)
    has_health: bool  # GET /health says whether it is up; else: up while it lists models
    renders_prompts: bool  # /apply-template and /tokenize give the ids it would cache
    returns_tokens: bool  # `return_tokens` on its own paths: the generated ids
    any_model_name: bool  # takes any `model` in a body; else only its own
    has_metrics: bool  # GET /metrics in llama-server's families (`llamacpp:`)

    def serves(self, path: str) -> bool:
        """Is ``path`` one it answers? ("": a call of llama-server's own)"""
        return self.paths is None or path in self.paths


# a llama-server: slots pinned by id_slot, /props, /slots, its own endpoints
LLAMA_SERVER = Dialect(
    kind=LLAMA, paths=None, pins_slots=True, has_slots=True, saves_slots=True,
    has_health=True, renders_prompts=True, returns_tokens=True, any_model_name=True,
    has_metrics=True)
# any server of the OpenAI API (vLLM, SGLang, another kvroute): nothing of llama-server's
# is asked or sent
OPENAI_API = Dialect(
    kind=OPENAI, paths=OPENAI_PATHS, pins_slots=False, has_slots=False, saves_slots=False,
    has_health=False, renders_prompts=False, returns_tokens=False, any_model_name=False,
    has_metrics=False)

DIALECTS = {d.kind: d for d in (LLAMA_SERVER, OPENAI_API)}


def dialect_of(kind: str) -> Dialect:
    """The dialect of a backend of ``kind`` (one of backends.config.BACKEND_KINDS)."""
    return DIALECTS[kind]
