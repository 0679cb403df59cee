"""Every chat template in llama.cpp's corpus: kvroute's prompt ids equal llama-server's.

For each template of the vendored tree's `models/templates/`, a real llama-server runs the
demo model with `--chat-template-file` (one at a time, ~1 s to start) and kvroute loads
the same text as the proxy does (`PromptBuilder.load(model, chat_template=...)`). Each
conversation shape of `template_shapes.SHAPES` is sent to the server's `/apply-template`:
where it answers 200, kvroute must render the same text and the same token ids as its
`/tokenize`; where it refuses, kvroute must refuse too (`PromptError`).

Pairs kvroute does not get right yet are listed in `KNOWN` with the reason, as strict
xfails: the test says so the day they start passing.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import healthy
from prompt_corpus import Backend
from template_shapes import SHAPES

from backends.binary import llama_cpp_source
from backends.process import ServerSpec, free_port
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError
from proxy.prompt.template import TemplateError

TEMPLATE_DIR = llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
TEMPLATES = sorted(p.name for p in TEMPLATE_DIR.glob("*.jinja"))

# Templates whose continued assistant message (a trailing one: `prefill`) kvroute renders
# differently: the server rebuilds that turn's opening from the reasoning tags its
# handler or autoparser infers (`<think>`, `[THINK]`, a channel...), then appends the
# reasoning and the text; kvroute appends the text to the plain generation prompt.
CONTINUATION_DIFFERS = (
    "Apriel-1.6-15b-Thinker-fixed",
    "Bielik-11B-v3.0-Instruct",
    "ByteDance-Seed-OSS",
    "Cohere2MoE",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6",
    "GLM-4.7-Flash",
    "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct",
    "Kimi-K2-Thinking",
    "Kimi-K3",
    "LFM2-8B-A1B",
    "LFM2.5-8B-A1B",
    "LFM2.5-Instruct",
    "MiniMax-M2",
    "MiniMax-M3",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "NVIDIA-Nemotron-Nano-v2",
    "Qwen-QwQ-32B",
    "Qwen-Qwen3-0.6B",
    "Qwen3.5-4B",
    "Reka-Edge",
    "Spark2.5",
    "StepFun3.5-Flash",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731",
    "deepseek-ai-DeepSeek-V4",
    "google-gemma-4-31B-it-interleaved",
    "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct",
    "inclusionai-ling-3.0-flash",
    "llama-cpp-deepseek-r1",
    "llama-cpp-rwkv-world",
    "meetkai-functionary-medium-v3.2",
    "mistralai-Ministral-3-14B-Reasoning-2512",
    "moonshotai-Kimi-K2",
    "muse-glimmer",
    "openai-gpt-oss-120b",
    "openbmb-MiniCPM5-1B",
    "poolside-Laguna-S-2.1",
    "poolside-Laguna-XS-2.1",
    "poolside-Laguna-XS.2",
    "unsloth-mistral-Devstral-Small-2507",
)
_CONTINUATION = ("a continued assistant message: the server reopens it with the reasoning "
                 "tags its handler infers; kvroute does not port that yet")
# (template, shape) -> why kvroute's prompt still differs from the server's
KNOWN: dict[tuple[str, str], str] = {
    **{(f"{name}.jinja", shape): _CONTINUATION for name in CONTINUATION_DIFFERS
       for shape in ("prefill", "prefill_reasoning")},
    ("tencent-Hy3.jinja", "prefill_reasoning"): _CONTINUATION,
}


@dataclass
class Running:
    """One llama-server on the demo model with one template, and kvroute's builder for it."""

    template: str
    proc: subprocess.Popen[bytes] | None
    backend: Backend | None
    builder: PromptBuilder | None
    load_error: Exception | None
    log: str = ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(template: str, binary: Path, model: Path, log_dir: Path) -> Running:
    path = TEMPLATE_DIR / template
    spec = ServerSpec(binary=binary, model=model, port=free_port(), slots=1,
                      ctx_per_slot=4096, cache_ram_mib=0,
                      extra_args=("--chat-template-file", str(path)))
    log = log_dir / f"{template}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(spec.argv(), stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    builder, error = None, None
    try:
        builder = PromptBuilder.load(model, chat_template=path.read_text())
    except (TemplateError, PromptError) as e:
        error = e
    deadline = time.monotonic() + 60
    while proc.poll() is None and not healthy(spec.url) and time.monotonic() < deadline:
        time.sleep(0.05)
    backend = Backend(spec.url, None) if proc.poll() is None else None
    return Running(template, proc, backend, builder, error, log.read_text()[-2000:])


@pytest.fixture(scope="session")
def corpus_server(llama_server_bin: Path, demo_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """`get(template)`: the running server for `template`, started on first use; the
    previous template's server is stopped (tests run grouped by template)."""
    log_dir = tmp_path_factory.mktemp("template-corpus")
    current: list[Running] = []

    def get(template: str) -> Running:
        if current and current[0].template == template:
            return current[0]
        if current:
            current.pop().stop()
        current.append(_start(template, llama_server_bin, demo_model, log_dir))
        return current[0]

    yield get
    if current:
        current.pop().stop()


def _params() -> list[object]:
    out = []
    for template in TEMPLATES:
        for shape in SHAPES:
            reason = KNOWN.get((template, shape))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(template, shape, marks=marks, id=f"{template}-{shape}"))
    return out


def _first_difference(ours: str, theirs: str) -> str:
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
             min(len(ours), len(theirs)))
    return f"at char {n}: ours {ours[n - 40:n + 80]!r}\n    server {theirs[n - 40:n + 80]!r}"


def test_template_corpus_is_there() -> None:
    assert len(TEMPLATES) >= 70, TEMPLATE_DIR


@pytest.mark.parametrize(("template", "shape"), _params())
def test_template_shape_matches_server(template: str, shape: str, corpus_server) -> None:
    run = corpus_server(template)
    assert run.backend is not None, f"llama-server did not start:\n{run.log}"
    assert run.builder is not None, f"kvroute cannot load the template: {run.load_error}"
    body = SHAPES[shape]
    status, out = run.backend.call("/apply-template", body)
    if status != 200:
        with pytest.raises(PromptError) as refused:
            run.builder.chat_tokens(body)
        assert refused.value.status // 100 == status // 100, (refused.value.status, out)
        return
    theirs = str(out["prompt"])
    try:
        ours = run.builder.render_chat(body)
    except PromptError as e:
        pytest.fail(f"kvroute refuses what the server renders: {e}")
    assert ours == theirs, _first_difference(ours, theirs)
    assert run.builder.chat_tokens(body) == run.backend.tokenize(theirs)
