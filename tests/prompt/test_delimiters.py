"""Message delimiters and user-message starts (proxy/prompt/delimiters.py).

`user_starts` against a token-by-token reference of the server's `split`, on tables and
on generated prompts. Then every template of the vendored corpus against a real
llama-server on the hybrid demo model, which creates a context checkpoint at the start
of every user message when `--checkpoint-min-step` is 0: kvroute's user starts of a chat
prompt must be the positions of those checkpoints (besides the ones every prompt gets,
at n - 4 and n - 4 - n_ubatch). At log level 5 the server also names the handler it
uses and writes the autoparser's `user_msg_start` / `assistant_msg_start`, which must be
kvroute's delimiter texts. The model's vocabulary has the templates' markers as control
tokens (special_vocab.py), so that delimiters match in prompts as they do on the models
the templates come from. One server per template (~1 s), stopped once observed.
"""

from __future__ import annotations

import re
import subprocess
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import healthy
from prompt_corpus import Backend
from special_vocab import model_with_markers
from template_shapes import SYSTEM, TOOLS

from backends.binary import llama_cpp_source
from backends.demo_model import ensure_demo_model
from backends.process import ServerSpec, free_port
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.delimiters import server_delimiters, user_starts
from proxy.prompt.handlers import detect_handler, patch_source
from proxy.prompt.template import ChatTemplate

TEMPLATE_DIR = llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
TEMPLATES = sorted(p.name for p in TEMPLATE_DIR.glob("*.jinja"))


def _b(*ids: int) -> bytes:
    return array("i", ids).tobytes()


def _reference(ids: Sequence[int], delimiters: Sequence[tuple[str, Sequence[int]]]
               ) -> tuple[int, ...]:
    """common_chat_msg_delimiters::split, position by position, kept to the user spans."""
    out = []
    for i in range(len(ids)):
        for role, toks in delimiters:
            if i + len(toks) <= len(ids) and list(ids[i:i + len(toks)]) == list(toks):
                if role == "user":
                    out.append(i)
                break
    return tuple(out)


USER, ASSISTANT, TOOL = (("user", (7, 1)), ("assistant", (7, 2)), ("tool", (7, 1, 9)))


@pytest.mark.parametrize(("ids", "delimiters", "want"), [
    pytest.param((), [USER], (), id="empty-prompt"),
    pytest.param((7, 1, 5, 7, 2, 5, 7, 1), [ASSISTANT, USER], (0, 6), id="chatml"),
    pytest.param((7, 1, 5), [], (), id="no-delimiters"),
    pytest.param((7, 1, 5), [ASSISTANT], (), id="no-user-delimiter"),
    pytest.param((5, 7), [USER], (), id="cut-off-at-the-end"),
    pytest.param((1, 1, 1), [("user", (1, 1))], (0, 1), id="overlapping"),
    # a longer delimiter listed first takes the position from the user one
    pytest.param((7, 1, 9, 7, 1, 8), [TOOL, USER], (3,), id="tool-first"),
    pytest.param((7, 1, 9, 7, 1, 8), [USER, TOOL], (0, 3), id="user-first"),
    pytest.param((4, 7, 1, 4), [("system", (7,)), USER], (), id="shorter-earlier-wins"),
    pytest.param((3, 4, 3), [("user", ()), ("assistant", (3,))], (0, 1, 2),
                 id="empty-delimiter-matches-everywhere"),
    pytest.param((3, 4, 3), [("assistant", (3,)), ("user", ())], (1,),
                 id="empty-delimiter-after-another"),
    pytest.param((6, 1, 6, 2), [("user", (6,)), ("user", (2,))], (0, 2, 3),
                 id="two-user-delimiters"),
    # the bytes of 0x20000 (00 00 02 00, little-endian) are at byte 2, across two ids
    pytest.param((0x100, 2), [("user", (0x20000,))], (), id="unaligned-bytes"),
    pytest.param((-1, 7, 1), [USER], (1,), id="negative-ids"),
])
def test_user_starts(ids: tuple[int, ...], delimiters: list[tuple[str, tuple[int, ...]]],
                     want: tuple[int, ...]) -> None:
    tokenized = [(role, _b(*toks)) for role, toks in delimiters]
    assert user_starts(_b(*ids), tokenized) == want == _reference(ids, delimiters)


_ROLES = st.sampled_from(["user", "assistant", "system", "tool"])
_SMALL_IDS = st.integers(min_value=-2, max_value=3) | st.sampled_from([256, 65536, 2**31 - 1])


@settings(max_examples=500, deadline=None)
@given(st.lists(_SMALL_IDS, max_size=60),
       st.lists(st.tuples(_ROLES, st.lists(_SMALL_IDS, max_size=4)), max_size=5))
def test_user_starts_is_the_servers_split(ids: list[int],
                                          delimiters: list[tuple[str, list[int]]]) -> None:
    tokenized = [(role, _b(*toks)) for role, toks in delimiters]
    assert user_starts(_b(*ids), tokenized) == _reference(ids, delimiters)


def test_builder_keeps_the_tokenized_delimiters(builder: PromptBuilder) -> None:
    """The demo model's template (ChatML with tools): the autoparser's two starts."""
    tok = builder.tokenizer
    assert server_delimiters(builder.template, builder.caps) == (
        ("assistant", "<|im_start|>assistant"), ("user", "<|im_start|>user"))
    assert builder.message_delimiters == tuple(
        (role, array("i", tok.tokenize(text, add_special=False)).tobytes())
        for role, text in (("assistant", "<|im_start|>assistant"),
                           ("user", "<|im_start|>user")))
    body = {"messages": [SYSTEM, {"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}]}
    ids = builder.chat_ids(body)
    im_start, user = tok.tokenize("<|im_start|>user", add_special=False)
    want = tuple(i for i in range(len(ids) - 1) if ids[i] == im_start and ids[i + 1] == user)
    assert len(want) == 2
    assert user_starts(ids.tobytes(), builder.message_delimiters) == want


# -- the corpus against the server ---------------------------------------------------------

N_UBATCH = 512  # the server's default
CREATED = re.compile(r"created context checkpoint \d+ of \d+ \(pos_min = -?\d+, "
                     r"pos_max = -?\d+, n_tokens = (\d+)")
# the analyzer's log lines; a start may span lines, and is empty when not found
STARTS = re.compile(r" D user_msg_start: (.*?)\n[0-9.]+ D assistant_msg_start: (.*?)\n"
                    r"[0-9.]+ D reasoning_mode:", re.S)


def _call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# Conversations to observe, richest first: the first one the server renders is used.
# Several user messages (the checkpoints mark each), tool results (which some templates
# render inside a user turn), reasoning and a system prompt.
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [
        SYSTEM, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Simple."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            _call("call_a", "get_weather", '{"city": "Paris"}'),
            _call("call_b", "get_weather", '{"city": "Tokyo"}')]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "25C"},
        {"role": "assistant", "content": "Paris 18C, Tokyo 25C."},
        {"role": "user", "content": "Thanks! And Rome?"}], "tools": TOOLS},
    {"messages": [
        SYSTEM, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."}, {"role": "user", "content": "No."}]},
    {"messages": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}]},
]


@dataclass
class Observed:
    """What one llama-server did with a template's chat request."""

    template: str
    log: str                   # the server's whole log
    body: dict[str, Any] | None  # the conversation sent (None: it rendered none)
    ids: list[int]             # the prompt's token ids, as the server tokenizes them
    checkpoints: list[int]     # n_tokens of each checkpoint the request created


def _observe(template: str, binary: Path, model: Path, log_dir: Path
             ) -> tuple[Observed, PromptBuilder]:
    spec = ServerSpec(binary=binary, model=model, port=free_port(), slots=1,
                      ctx_per_slot=4096, cache_ram_mib=0, extra_args=(
                          "--chat-template-file", str(TEMPLATE_DIR / template),
                          "-lv", "5", "--checkpoint-min-step", "0"))
    log_path = log_dir / f"{template}.log"
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(spec.argv(), stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # loads while the server starts
        builder = PromptBuilder.load(model, chat_template=(TEMPLATE_DIR / template)
                                     .read_text())
        backend = Backend(spec.url, None)
        deadline = time.monotonic() + 60
        while _up(proc) and not healthy(spec.url):
            assert time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.05)
        assert _up(proc), _read(log_path)[-2000:]
        for body in CONVERSATIONS:
            status, out = backend.call("/apply-template", body)
            if status == 200:
                break
        else:
            return Observed(template, _read(log_path), None, [], []), builder
        ids = backend.tokenize(out["prompt"])
        start = len(log_path.read_bytes())
        # the answer may fail to parse (the demo model's token is no tool call): what
        # matters is the prompt the slot processed
        backend.call("/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0})
        log = _wait_for(log_path, "stop processing: n_tokens")
        created = [int(n) for n in CREATED.findall(log[start:])]
        return Observed(template, log, body, ids, created), builder
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _up(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def _read(log: Path) -> str:
    return log.read_bytes().decode("utf-8", "replace")


def _wait_for(path: Path, line: str) -> str:
    """The log once `line` is in it (the server writes its log from another thread)."""
    for _ in range(200):
        text = _read(path)
        if line in text:
            return text
        time.sleep(0.02)
    raise AssertionError(f"{line!r} not in {path}")


@pytest.fixture(scope="module")
def observe(llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Callable[[str], tuple[Observed, PromptBuilder]]:
    """`observe(template)`: the server's doings with it and kvroute's builder (the
    hybrid demo model with the corpus's markers as control tokens, the template as
    --chat-template-file); each template once."""
    model = model_with_markers(ensure_demo_model(kind="demo-hybrid"),
                               [(TEMPLATE_DIR / t).read_text() for t in TEMPLATES])
    log_dir = tmp_path_factory.mktemp("delimiters")
    seen: dict[str, tuple[Observed, PromptBuilder]] = {}

    def get(template: str) -> tuple[Observed, PromptBuilder]:
        if template not in seen:
            seen[template] = _observe(template, llama_server_bin, model, log_dir)
        return seen[template]

    return get


def test_corpus_is_there() -> None:
    assert len(TEMPLATES) >= 70, TEMPLATE_DIR


@pytest.mark.parametrize("template", TEMPLATES)
def test_delimiter_texts_match_server(template: str, observe) -> None:
    """The handler the server used, and the autoparser's starts as it logs them: for the
    chat request (the model's BOS and EOS in the template), and at start-up, where
    common_chat_verify_template analyses the template without a model (BOS, EOS "")."""
    run, builder = observe(template)
    handler = detect_handler(builder.template.source)
    autoparser = "using differential autoparser" in run.log
    assert autoparser == (handler is None), handler
    if handler is None:
        logged = STARTS.findall(run.log)
        assert len(logged) >= 2, "the server logged no message starts"
        bare = ChatTemplate(patch_source((TEMPLATE_DIR / template).read_text()))
        for tmpl, (user, assistant) in ((builder.template, logged[-1]), (bare, logged[0])):
            assert server_delimiters(tmpl, builder.caps) == tuple(
                (role, text) for role, text in (("assistant", assistant), ("user", user))
                if text), f"BOS {tmpl.bos_token!r}"


@pytest.mark.parametrize("template", TEMPLATES)
def test_user_starts_are_where_the_server_checkpoints(template: str, observe) -> None:
    """With no minimum spacing, the server checkpoints at every user start > 0; the other
    checkpoints are at n - 4 and n - 4 - n_ubatch (prompts here stay under one batch)."""
    run, builder = observe(template)
    assert run.body is not None, "the server renders none of the conversations"
    ids = builder.chat_ids(run.body)
    assert ids.tolist() == run.ids, "kvroute's prompt ids differ from the server's"
    n = len(ids)
    assert n < 2048  # one batch: no cut (nor checkpoint) at a multiple of n_batch
    assert n - 4 in run.checkpoints, run.checkpoints
    others = {n - 4, n - 4 - N_UBATCH}
    ours = set(user_starts(ids.tobytes(), builder.message_delimiters)) - others - {0}
    assert sorted(ours) == sorted(set(run.checkpoints) - others)
