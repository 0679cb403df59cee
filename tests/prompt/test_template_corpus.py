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
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prompt_corpus import Backend
from template_shapes import SHAPES

from backends.binary import llama_cpp_source
from backends.process import ServerSpec, free_port
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError
from proxy.prompt.template import TemplateError

TEMPLATE_DIR = llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
TEMPLATES = sorted(p.name for p in TEMPLATE_DIR.glob("*.jinja"))

# (template, shape) -> why kvroute's prompt still differs from the server's; a shape of
# "*" covers every shape of that template.
KNOWN: dict[tuple[str, str], str] = {}


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


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


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
    while proc.poll() is None and not _healthy(spec.url) and time.monotonic() < deadline:
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
            reason = KNOWN.get((template, shape)) or KNOWN.get((template, "*"))
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
        with pytest.raises(PromptError):
            run.builder.chat_tokens(body)
        return
    theirs = str(out["prompt"])
    try:
        ours = run.builder.render_chat(body)
    except PromptError as e:
        pytest.fail(f"kvroute refuses what the server renders: {e}")
    assert ours == theirs, _first_difference(ours, theirs)
    assert run.builder.chat_tokens(body) == run.backend.tokenize(theirs)
