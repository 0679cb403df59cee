"""A copy of a demo GGUF whose vocabulary has the chat templates' markers as control
tokens, for tests/prompt/test_delimiters.py.

The demo vocabulary (Qwen2's) knows `<|im_start|>` but not `<|start_header_id|>`,
`<|start|>` or `<｜User｜>`. There, a message delimiter is plain text whose BPE pieces
merge with the characters around it in a prompt, so neither the server nor kvroute
finds it anywhere, and a test of where they find it would pass whatever the delimiter.
With the markers as control tokens (as in the models the templates come from) the
delimiters match. The markers are taken from the template sources; each becomes a
control token in place of one of the vocabulary's `[PAD...]` entries, or, if the
vocabulary has it already, that token turns control.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

import gguf

# <|x|>, <｜x｜>, <|x>, <x|>, <x>, </x>, [X]: the shapes of the corpus's special tokens
MARKER = re.compile(r"<[|｜][^<>|｜\s'\"{}]{1,40}[|｜]>|<\|[A-Za-z_]{1,40}>|<[A-Za-z_]{1,40}\|>"
                    r"|\[[A-Z][A-Z_]{1,30}\]|</?[a-z][a-z_:]{1,30}>")
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


def template_markers(sources: Iterable[str]) -> list[str]:
    return sorted({m for src in sources for m in MARKER.findall(src)})


def model_with_markers(src: Path, sources: Iterable[str]) -> Path:
    """`src` with the markers of these template sources as control tokens, written once
    beside it (reading the vocabulary takes seconds) and reused while neither changes."""
    markers = template_markers(sources)
    digest = hashlib.sha256("\n".join(markers).encode()).hexdigest()[:10]
    dst = src.with_name(f"{src.stem}-markers-{digest}.gguf")
    if not dst.is_file():
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        with_control_tokens(src, tmp, markers)
        os.replace(tmp, dst)  # a concurrent session writes the same bytes
    return dst


def with_control_tokens(src: Path, dst: Path, texts: Iterable[str]) -> Path:
    """Write `src` to `dst` with every text of `texts` a control token."""
    reader = gguf.GGUFReader(src)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    index = {t: i for i, t in enumerate(tokens)}
    free = [i for i, t in enumerate(tokens)
            if types[i] == _USER_DEFINED and t.startswith("[PAD")]
    for text in texts:
        i = index.get(text)
        if i is None:
            assert free, "no [PAD] entry left for another marker"
            i = free.pop(0)
            tokens[i] = text
        types[i] = _CONTROL
    changed = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer adds them
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, changed.get(field.name, field.contents()), kind,
                             sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                               t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst
