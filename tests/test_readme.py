"""The README as a reader follows it: its commands, taken from its own text, run against a
real kvroute (`kvroute serve` on the shipped config.yaml and its demo backends), and the
output it shows checked against what they print. A README edit that changes a command
or an output changes what runs here.

The shipped config runs as `make run` serves it, but for its port, its log directory,
the llama-server the suite uses and smaller slots (4,096 tokens: the README's prompts are
~1,600). `make run` and `make test` themselves are not run here: the suite runs inside
`make test`, after the set-up `make run` does too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from procs import gone
from test_claude_code import claude_env

from backends.process import free_port

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
KVROUTE = [sys.executable, "-m", "proxy.cli"]
SHOWN = "127.0.0.1:8080"  # where the README's commands find kvroute


def section(title: str) -> str:
    """The text of the README's `## title` section."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of `text` in language `lang` ("" for plain ones)."""
    return [body for fence, body in re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)
                if fence == lang]


def only(items: list[str], what: str) -> str:
    assert len(items) == 1, f"expected one {what}, found {len(items)}"
    return items[0]


FIRST = section("The first ten minutes")


@pytest.fixture(scope="module")
def kvroute(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
            demo_model: Path) -> Iterator[int]:
    """`kvroute serve` on the shipped config.yaml, ready; its port."""
    tmp = tmp_path_factory.mktemp("readme")
    data = yaml.safe_load((REPO / "config.yaml").read_text())
    port = free_port()
    data["proxy"]["port"] = port
    data["log_dir"] = str(tmp / "logs")
    data["llama_server"] = str(llama_server_bin)
    for b in data["backends"]:
        b["ctx_per_slot"] = 4096
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*KVROUTE, "serve", "--config", str(config)], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"kvroute exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"kvroute not ready:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        state = json.loads((tmp / "logs" / "backends.json").read_text())
        pids = [b["pid"] for b in state["backends"] if b["pid"]]
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in pids:  # never leave a server behind
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_first_ten_minutes(kvroute: int) -> None:
    """The curl command and its headers, then the OpenAI SDK script and what it prints,
    in the README's order, on a kvroute nothing else has used."""
    here = f"127.0.0.1:{kvroute}"
    curl = only([b for b in blocks(FIRST, "sh") if b.startswith("curl ")], "curl command")
    out = subprocess.run(["bash", "-c", curl.replace(SHOWN, here)], capture_output=True,
                         timeout=120, check=True).stdout.decode()
    head = out.split("\r\n\r\n", 1)[0].split("\r\n")
    assert head[0].startswith("HTTP/1.1 200"), out
    got = dict(line.split(": ", 1) for line in head[1:])
    shown = only([b for b in blocks(FIRST, "") if b.startswith("X-Kvroute-")], "header list")
    for line in shown.splitlines():
        name, value = line.split(": ", 1)
        assert got.get(name) == value, (line, got)

    script = only(blocks(FIRST, "python"), "Python script")
    assert SHOWN in script
    printed = re.search(r"This prints `([^`]+)`, then `([^`]+)`", FIRST)
    assert printed, "the README no longer says what the script prints"
    run = subprocess.run([sys.executable, "-c", script.replace(SHOWN, here)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == list(printed.groups())


def _labels(lines: list[str]) -> list[str]:
    """What each check line is about: `[ok ] llama-server build: ...` -> llama-server build."""
    out = []
    for line in lines:
        m = re.match(r"\[(?:ok |BAD|!! |-- )\] ([\w.-]+(?: [a-z]+)*)", line)
        if m:
            out.append(m.group(1))
    return out


def test_doctor_on_a_config_whose_gguf_is_missing(tmp_path: Path) -> None:
    """The README's `kvroute doctor` command on the config it describes: the same checks
    in the same order, the same BAD line (its path made this test's), exit code 1."""
    command = only([b for b in blocks(FIRST, "sh") if "kvroute doctor" in b], "doctor command")
    argv = shlex.split(command)
    assert argv[0] == ".venv/bin/kvroute", argv
    shown = only([b for b in blocks(FIRST, "") if b.startswith("[ok ]")], "doctor output")
    bad = re.search(r"^\[BAD\] config: (\S+): backends\[0\]\.model: file not found: (\S+) ",
                    shown, re.M)
    assert bad, shown
    shown_config, gguf = bad.groups()
    assert not Path(gguf).exists()
    name = argv[argv.index("--config") + 1]
    assert Path(shown_config).name == name
    (tmp_path / name).write_text(yaml.safe_dump({"backends": [{"name": "a", "model": gguf}]}))
    run = subprocess.run([*KVROUTE, *argv[1:]], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert _labels(lines) == _labels(shown.splitlines()), run.stdout
    want = next(x for x in shown.splitlines() if x.startswith("[BAD]"))
    assert want.replace(shown_config, str(tmp_path / name)) in lines, run.stdout
    assert lines[-1] == shown.splitlines()[-1], run.stdout


def test_claude_code_is_started_as_its_end_to_end_test_starts_it(tmp_path: Path) -> None:
    """The README's environment for Claude Code is what tests/test_claude_code.py gives
    the real CLI (which needs more there: a home of its own, short answers, a timeout)."""
    block = only(blocks(section("Claude Code"), "sh"), "Claude Code command")
    shown = dict(re.findall(r"^([A-Z_]+)=(\S+) \\$", block, re.M))
    assert "ANTHROPIC_BASE_URL" in shown and "ANTHROPIC_API_KEY" in shown, block
    env = claude_env(shown["ANTHROPIC_BASE_URL"], tmp_path)
    assert {k: env.get(k) for k in shown} == shown
    assert shown["ANTHROPIC_BASE_URL"] == f"http://{SHOWN}"


def test_the_codex_provider_is_served(kvroute: int) -> None:
    """The README's Codex provider: its base URL, wire API and model answer a Responses
    request (what Codex sends there) through the real kvroute."""
    cfg = tomllib.loads(only(blocks(section("Codex"), "toml"), "Codex config"))
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert provider["wire_api"] == "responses"
    base = provider["base_url"]
    assert base.startswith(f"http://{SHOWN}/")
    url = base.replace(SHOWN, f"127.0.0.1:{kvroute}") + "/responses"
    body = {"model": cfg["model"], "input": "Say hello", "max_output_tokens": 8}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
        assert r.headers["X-Kvroute-Backend"] in ("a", "b")
    assert answer["object"] == "response" and answer["status"] == "completed", answer
    assert answer["model"] == cfg["model"], answer


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings."""
    text = re.sub(r"^```.*?^```$", "", doc.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_to_a_file_exists() -> None:
    """Links of the README and the guides in docs/ point at files that are there, and at
    headings those files have."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            if "://" in target:
                continue
            path = doc.parent / target if target else doc
            assert path.exists(), f"{doc.name}: {target}"
            if anchor:
                assert anchor in anchors(path), f"{doc.name}: {target}#{anchor}"


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 200


def _loadtest_commands() -> list[list[str]]:
    """Each `python -m loadtest ...` line in the guides' shell blocks, continuations
    joined, comments and `...` (a placeholder) dropped."""
    out = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        for block in re.findall(r"^```sh\n(.*?)^```$", doc.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if "-m loadtest " in line and not line.lstrip().startswith("#"):
                    argv = shlex.split(line.split("-m loadtest ", 1)[1], comments=True)
                    out.append([a for a in argv if a != "..."])
    return out


def test_the_guides_loadtest_commands_parse() -> None:
    """A loadtest flag renamed or dropped fails here, not in a reader's shell."""
    from loadtest.__main__ import parser

    commands = _loadtest_commands()
    assert {c[0] for c in commands} >= {"simulate", "run", "soak", "sweep"}
    for argv in commands:
        parser().parse_args(argv)
