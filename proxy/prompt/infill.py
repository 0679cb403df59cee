"""`/infill` body -> the exact token ids llama-server builds for it (llama.vim, llama.vscode).

The server (tools/server: `post_infill`, `format_prompt_infill` in server-common.cpp)
builds the prompt itself from the body and the model's FIM tokens, in the repo-level
layout when the vocabulary has a repo and a file-separator token:

    [extra: <repo>myproject\\n (<sep>filename\\n text)... <sep>filename\\n, its tail]
    [BOS if the vocabulary adds one] <pre> prefix-tail prompt <suf> suffix-head <mid>

Without a file separator each chunk is "\\n\\n--- snippet ---\\n\\n" + text, and no file
names. `input_prefix`, `input_suffix` and the chunks are tokenized without parsing
special tokens (a `<fim_prefix>` typed in the file is text); `prompt` with them parsed.
What is kept depends on the server: its batch size `-b`, its `-n` and the slot's context
(`InfillShape`): the prefix's last 3/4 of a batch, the suffix's first quarter of a batch
less the prompt, the extra context's last `n_ctx - n_batch - 2 n_predict` tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.prompt.chat_request import PromptError
from proxy.prompt.tokenizer import FragmentTokenizer

NO_TOKEN = -1  # LLAMA_TOKEN_NULL
REPO = "myproject\n"  # the project name the server puts after the repo token
CURRENT_FILE = "filename\n"  # and the current file's name after the last separator
SNIPPET = "\n\n--- snippet ---\n\n"  # a chunk's separator without a file-separator token


class InfillUnmodelled(Exception):
    """A body whose prompt is not modelled here (its server answers it, perhaps with an
    error); it is forwarded unrouted."""


@dataclass(frozen=True)
class InfillShape:
    """The server settings the prompt depends on."""

    n_batch: int = 2048  # -b
    n_ctx: int = 8192  # tokens per slot
    n_predict: int = -1  # -n (the server's, not the request's)
    spm: bool = False  # --spm-infill: suffix before prefix


def server_shape(n_batch: int, n_ctx: int, args: Sequence[str] = ()) -> InfillShape:
    """The shape of a server with these batch and slot sizes started with ``args`` (its
    command line's -n and --spm-infill; an external server's are unknown: the defaults)."""
    n_predict = -1
    for i, a in enumerate(args):
        key, eq, inline = a.partition("=")
        if key in ("-n", "--predict", "--n-predict"):
            raw = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            # (not a number: the server refuses to start, nothing to model)
            if raw.lstrip("-").isdigit():
                n_predict = int(raw)
    return InfillShape(n_batch=n_batch, n_ctx=n_ctx, n_predict=n_predict,
                       spm="--spm-infill" in args)


def fim_missing(tok: FragmentTokenizer) -> str:
    """What the server names when it refuses `/infill` (empty: it serves it)."""
    pre, suf, mid, _, _ = tok.fim_ids()
    return "".join(f"{what} token is missing. " for what, t in
                   (("prefix", pre), ("suffix", suf), ("middle", mid)) if t == NO_TOKEN)


def common_shape(shapes: Iterable[InfillShape]) -> InfillShape:
    """The shape most backends share (one list of ids is routed: where backends differ,
    the others' prompt differs only in how much extra context is kept)."""
    counts: dict[InfillShape, int] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    return max(counts, key=lambda s: counts[s]) if counts else InfillShape()


def infill_ids(tok: FragmentTokenizer, body: Mapping[str, Any], shape: InfillShape) -> array:
    """The ids llama-server puts in the slot for `body` on a server of `shape`.

    PromptError: a body the server refuses (or fails on) for its shape, with the message
    it gives; InfillUnmodelled: one this does not model.
    """
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            # the server reads it unchecked: a 500 naming a JSON exception
            raise PromptError(f'"{key}" is required')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise PromptError('"input_extra" must be an array of {"filename": string, '
                          '"text": string}')
    chunks: list[tuple[str, str]] = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise PromptError('extra_context chunk must contain a "text" field with a '
                              'string value')
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):  # null included
            raise PromptError('extra_context chunk\'s "filename" field must be a string')
        chunks.append((name, chunk["text"]))
    # a "prompt" that is not a string is the server's default, "" (it logs a warning)
    text = body.get("prompt")
    prompt = _text(tok, text, parse=True) if isinstance(text, str) else []
    return _assemble(tok, _mixed(tok, body["input_prefix"]), _mixed(tok, body["input_suffix"]),
                     _extra(tok, chunks), prompt, shape)


def _extra(tok: FragmentTokenizer, chunks: list[tuple[str, str]]) -> list[int]:
    """The extra context, whole (the server keeps its tail)."""
    _, _, _, rep, sep = tok.fim_ids()
    out: list[int] = []
    if rep != NO_TOKEN:
        out += [rep, *_text(tok, REPO)]
    for name, text in chunks:
        out += [sep, *_text(tok, name + "\n")] if sep != NO_TOKEN else _text(tok, SNIPPET)
        out += _text(tok, text)
    if sep != NO_TOKEN:
        out += [sep, *_text(tok, CURRENT_FILE)]
    return out


def _assemble(tok: FragmentTokenizer, prefix: list[int], suffix: list[int],
              extra: list[int], prompt: list[int], shape: InfillShape) -> array:
    pre, suf, mid, _, _ = tok.fim_ids()
    quarter = int(shape.n_batch / 4)  # C++ int division truncates toward zero
    n_prefix = min(len(prefix), 3 * quarter)
    n_suffix = min(len(suffix), max(0, quarter - (2 + len(prompt))))
    n_extra = min(max(0, shape.n_ctx - shape.n_batch - 2 * shape.n_predict), len(extra))
    head = [pre, *prefix[len(prefix) - n_prefix:], *prompt]
    tail = [suf, *suffix[:n_suffix]]
    if shape.spm:
        head, tail = tail, head
    bos = [tok.bos_id] if tok.add_bos else []
    return array("i", [*extra[len(extra) - n_extra:], *bos, *head, *tail, mid])


def _mixed(tok: FragmentTokenizer, value: object) -> list[int]:
    """`tokenize_mixed(value, add_special=false, parse_special=false)`: a string, or a
    list of strings and token ids."""
    if isinstance(value, str):
        return _text(tok, value)
    if isinstance(value, list):
        out: list[int] = []
        for part in value:
            if isinstance(part, str):
                out += _text(tok, part)
            elif isinstance(part, int) and not isinstance(part, bool) \
                    and 0 <= part < tok.n_vocab:
                out.append(part)
            else:
                raise InfillUnmodelled(f"an input part {str(part)[:40]!r}")
        return out
    raise InfillUnmodelled(f"an input of type {type(value).__name__}")


def _text(tok: FragmentTokenizer, text: str, *, parse: bool = False) -> list[int]:
    try:
        return tok.tokenize_uncached(text, add_special=False, parse_special=parse)
    except UnicodeEncodeError as e:
        raise PromptError(f"infill text is not valid Unicode: {e.reason}") from e
