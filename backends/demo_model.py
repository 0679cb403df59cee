"""Synthesise the demo models: the real Qwen2 BPE vocabulary with random f16 weights.

The vocabulary comes from `models/ggml-vocab-qwen2.gguf` in the llama.cpp tree vendored
in the pinned llama-cpp-python sdist, so the proxy's tokenizer and llama-server agree
token for token. Weights are random (seeded), so output is gibberish but prompt
processing costs what a real model of this shape costs, which is what routing cares
about. The chat template is ours (`backends/templates/chatml-tools.jinja`, which renders
tools); its hash is part of the file name so editing the template rebuilds the model.

Three architectures share the vocabulary, the template and the sizes: `demo` is llama
(plain attention: llama-server can cut its cache at any token), `demo-swa` is gemma3
with interleaved sliding-window attention (backends/demo_swa.py) and `demo-hybrid` is
lfm2, short convolutions next to attention (backends/demo_hybrid.py). The last two
reuse cache only from llama-server's context checkpoints (docs/checkpoints.md).
`demo-coder` is `demo` with StarCoder's vocabulary (49,152 tokens), whose FIM tokens
(`<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`, `<repo_name>`, `<file_sep>`) the GGUF
names, so its servers answer `/infill` in the repo-level layout (Qwen2's vocabulary file
has no FIM tokens; llama.cpp would find the first three by their text, not the others).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import backends.demo_hybrid as demo_hybrid
import backends.demo_swa as demo_swa
from backends.binary import Progress, _print, cache_dir, cache_lock, llama_cpp_source
from backends.demo_gguf import Weights

TEMPLATE_PATH = Path(__file__).parent / "templates" / "chatml-tools.jinja"
VOCAB_DIR = Path("vendor") / "llama.cpp" / "models"
ARCH = "llama"


@dataclass(frozen=True)
class DemoVocab:
    """A vocabulary file of the vendored tree and the ids the GGUF names."""

    file: str  # under VOCAB_DIR
    pre: str  # tokenizer.ggml.pre: the pre-tokenizer llama.cpp applies
    eos: int
    bos: int  # also the padding id; add_bos_token is false for both vocabularies
    fim: dict[str, int] | None = None  # tokenizer.ggml.fim_<name>_token_id


# EOS <|im_end|> ends a ChatML turn; BOS <|endoftext|>
QWEN2 = DemoVocab("ggml-vocab-qwen2.gguf", "qwen2", eos=151645, bos=151643)
# <|endoftext|> (id 0) is both, as in StarCoder's own GGUFs
STARCODER = DemoVocab("ggml-vocab-starcoder.gguf", "starcoder", eos=0, bos=0,
                      fim={"pre": 1, "mid": 2, "suf": 3, "pad": 4, "rep": 5, "sep": 6})


@dataclass(frozen=True)
class DemoModelParams:
    n_layer: int = 8
    n_embd: int = 512
    n_head: int = 8
    n_head_kv: int = 4
    n_ff: int = 1536
    n_ctx_train: int = 131072  # only what llama-server warns about; RoPE has no limit
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_ctx_train"):
            if getattr(self, name) <= 0:
                raise ValueError(f"demo_model.{name}: must be a positive integer")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError(
                "demo_model: n_embd must be a multiple of n_head and n_head of n_head_kv"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, f16 (2 bytes) each
        return self.n_layer * self.n_head_kv * self.head_dim * 2 * 2

    def tag(self) -> str:
        """What tells the files of two sets of sizes apart (the default context
        unnamed, so the files built before it was named keep their names)."""
        ctx = "" if self.n_ctx_train == DemoModelParams.n_ctx_train else f"-C{self.n_ctx_train}"
        return (
            f"L{self.n_layer}-E{self.n_embd}-H{self.n_head}-KV{self.n_head_kv}"
            f"-F{self.n_ff}{ctx}-s{self.seed}"
        )


def template_text(vocab_template: str | None = None) -> str | None:
    """Our tool-capable template; the vocabulary's own template until ours exists."""
    if TEMPLATE_PATH.is_file():
        return TEMPLATE_PATH.read_text()
    return vocab_template


def _vocab_path(progress: Progress, vocab: DemoVocab) -> Path:
    return llama_cpp_source(progress) / VOCAB_DIR / vocab.file


def _new_writer(path: Path, arch: str, vocab: Path, params: DemoModelParams,
                ids: DemoVocab = QWEN2) -> tuple[Any, int]:
    """A gguf.GGUFWriter holding the vocabulary, the template and the sizes every
    architecture reads, and the vocabulary's size; the architecture adds the rest."""
    import gguf

    meta = read_gguf_metadata(vocab, arrays=True)
    tokens, token_types, merges = (meta[f"tokenizer.ggml.{k}"]
                                   for k in ("tokens", "token_type", "merges"))
    vocab_template = meta.get("tokenizer.chat_template")
    template = template_text(vocab_template if isinstance(vocab_template, str) else None)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("kvroute-demo")
    w.add_block_count(params.n_layer)
    w.add_context_length(params.n_ctx_train)
    w.add_embedding_length(params.n_embd)
    w.add_feed_forward_length(params.n_ff)
    w.add_head_count(params.n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(ids.pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(ids.eos)
    w.add_bos_token_id(ids.bos)
    w.add_pad_token_id(ids.bos)
    w.add_add_bos_token(False)
    for name, token in (ids.fim or {}).items():
        w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", token)
    if template:
        w.add_chat_template(template)
    return w, len(tokens)


def _add_llama(w: Any, n_vocab: int, params: DemoModelParams, r: Weights) -> None:
    w.add_head_count_kv(params.n_head_kv)
    w.add_rope_dimension_count(params.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_uint64("kvroute.kv_bytes_per_token", params.kv_bytes_per_token)
    e, hd, ff = params.n_embd, params.head_dim, params.n_ff
    # no output.weight: llama.cpp ties the output projection to token_embd
    w.add_tensor("token_embd.weight", r.mat(n_vocab, e))
    w.add_tensor("output_norm.weight", r.ones(e))
    for i in range(params.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", r.ones(e))
        w.add_tensor(p + "attn_q.weight", r.mat(params.n_head * hd, e))
        w.add_tensor(p + "attn_k.weight", r.mat(params.n_head_kv * hd, e))
        w.add_tensor(p + "attn_v.weight", r.mat(params.n_head_kv * hd, e))
        w.add_tensor(p + "attn_output.weight", r.mat(e, params.n_head * hd))
        w.add_tensor(p + "ffn_norm.weight", r.ones(e))
        w.add_tensor(p + "ffn_gate.weight", r.mat(ff, e))
        w.add_tensor(p + "ffn_up.weight", r.mat(ff, e))
        w.add_tensor(p + "ffn_down.weight", r.mat(e, ff))


@dataclass(frozen=True)
class DemoKind:
    """One demo architecture: `model:` names it in config.yaml."""

    arch: str
    layout: str  # architecture and layer layout, in the file name: a change rebuilds
    add_model: Callable[[Any, int, DemoModelParams, Weights], None]
    vocab: DemoVocab = QWEN2


DEMO = "demo"
DEMO_KINDS = {
    DEMO: DemoKind(ARCH, "", _add_llama),
    "demo-swa": DemoKind(demo_swa.ARCH, demo_swa.LAYOUT, demo_swa.add_model),
    "demo-hybrid": DemoKind(demo_hybrid.ARCH, demo_hybrid.LAYOUT, demo_hybrid.add_model),
    "demo-coder": DemoKind(ARCH, "starcoder", _add_llama, STARCODER),
}


def write_model(path: Path, spec: DemoKind, params: DemoModelParams,
                progress: Progress = _print) -> None:
    """Write a model of `spec` to `path` (tests write variants of the demo kinds)."""
    vocab = _vocab_path(progress, spec.vocab)
    w, n_vocab = _new_writer(path, spec.arch, vocab, params, spec.vocab)
    spec.add_model(w, n_vocab, params, Weights(params.seed))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def demo_model_path(params: DemoModelParams | None = None, progress: Progress = _print,
                    kind: str = DEMO) -> Path:
    """Where the demo model of this kind, these params and the current template lives
    (may not exist).

    Without our template file the name carries the hash of the vocabulary's template,
    which needs the sdist; "vocab" is used instead so that this stays cheap.
    """
    params = params or DemoModelParams()
    layout = DEMO_KINDS[kind].layout
    tpl = TEMPLATE_PATH.read_bytes() if TEMPLATE_PATH.is_file() else b"vocab"
    digest = hashlib.sha256(tpl).hexdigest()[:10]
    stem = f"kvroute-{kind}-{layout}-" if layout else "kvroute-demo-"
    return cache_dir() / "models" / f"{stem}{params.tag()}-t{digest}.gguf"


def demo_kinds_for(params: DemoModelParams, models: Iterable[Path]) -> list[str]:
    """The demo kinds whose files (for these params) are among `models`, e.g. the
    managed backends' model paths: what `prepare` builds for a config."""
    wanted = set(models)
    return [k for k in DEMO_KINDS if demo_model_path(params, kind=k) in wanted]


def ensure_demo_model(params: DemoModelParams | None = None, progress: Progress = _print,
                      kind: str = DEMO) -> Path:
    """Path of the demo model, synthesised first if missing (~5 s, 212 MB by default)."""
    params = params or DemoModelParams()
    path = demo_model_path(params, kind=kind)
    if path.is_file():
        return path
    with cache_lock():
        if path.is_file():  # built by a concurrent prepare while we waited for the lock
            return path
        if not TEMPLATE_PATH.is_file():
            progress(f"note: {TEMPLATE_PATH} missing; using the vocabulary's chat template")
        progress(f"==> synthesising the demo model {path.name} (a few seconds)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            write_model(tmp, DEMO_KINDS[kind], params, progress)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar; 8 = string, 9 = array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}


def read_gguf_metadata(path: Path, arrays: bool = False) -> dict[str, Any]:
    """A GGUF file's metadata; arrays (as lists) only if asked, else skipped.

    NOTE: gguf.GGUFReader builds numpy views of every array element (151,936 tokens,
    151,387 merges): 5-10 s. Walking the header with struct takes ~0.1 s.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        (_version, _n_tensors, n_kv), off = struct.unpack_from("<IQQ", m, 4), 24
        out: dict[str, Any] = {}

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n

        for _ in range(n_kv):
            key, off = string(off)
            (vtype,) = struct.unpack_from("<I", m, off)
            off += 4
            if vtype == 8:
                out[key], off = string(off)
            elif vtype == 9:
                etype, count = struct.unpack_from("<IQ", m, off)
                off += 12
                items: list[Any] = []
                if etype == 8:
                    for _ in range(count):
                        if arrays:
                            item, off = string(off)
                            items.append(item)
                        else:
                            off += 8 + struct.unpack_from("<Q", m, off)[0]
                elif etype in _SCALAR:
                    fmt = f"<{count}{_SCALAR[etype]}"
                    if arrays:
                        items = list(struct.unpack_from(fmt, m, off))
                    off += struct.calcsize(fmt)
                else:
                    raise ValueError(f"{path}: nested arrays in {key} are not supported")
                if arrays:
                    out[key] = items
            else:
                fmt = "<" + _SCALAR[vtype]
                (out[key],) = struct.unpack_from(fmt, m, off)
                off += struct.calcsize(fmt)
        return out
