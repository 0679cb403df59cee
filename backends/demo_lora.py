"""The demo LoRA adapters: random low-rank deltas on the demo model's attention, for
`lora: [demo]` (and `demo1`, a second one, and `demo-alora`, an activated LoRA) next to
a demo model.

llama-server loads them with `--lora` (src/llama-adapter.cpp) and applies them to every
request at their global scale, or per request by the body's `lora` field; the output
differs from the base model's, and so does the KV the prompt leaves in a slot, which is
what makes adapters part of what the server reuses. An adapter names its base
architecture (general.architecture must be the model's) and holds, for each tensor it
changes, a pair `NAME.lora_a` (ggml {n_in, rank}) and `NAME.lora_b` ({rank, n_out}); the
server adds scale * alpha / rank * B(A x) to that tensor's product. These change
attn_q, attn_k and attn_v of every layer (K and V land in the cache) at rank 4 (~0.2 MB).
Two seeds give two adapters; output is noise, as the model's is. `demo-alora` is a third
seed whose file also names invocation tokens (`adapter.alora.invocation_tokens`, the
Qwen2 tokens of " certainty check:"), which makes llama-server run it as an aLoRA: only
from where those tokens last occur in the prompt, the KV before them left as the base
model makes it (see proxy/routing/cache/lora.py).

The file is cached by its architecture, sizes, rank, alpha and seed, as the demo models
are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from backends.binary import Progress, _print, cache_dir
from backends.demo_gguf import ModelShape, Weights, synthesised

# `lora: [demo, demo1]` in config.yaml: the name -> the adapter's seed
DEMO_LORAS = {"demo": 0, "demo1": 1, "demo-alora": 2}
# the Qwen2 ids of " certainty check:" (a granite-style intrinsic's invocation)
DEMO_INVOCATION = (43643, 1779, 25)
INVOCATIONS = {DEMO_LORAS["demo-alora"]: DEMO_INVOCATION}  # seed -> aLoRA invocation
TARGETS = ("attn_q", "attn_k", "attn_v")  # in every layer of the llama and gemma3 demos
ARCHS = ("llama", "gemma3")  # the demo architectures with those tensors in every layer


@dataclass(frozen=True)
class DemoLoraParams:
    arch: str = "llama"  # the base model's general.architecture
    n_layer: int = 8
    n_embd: int = 512
    n_q: int = 512  # attn_q's output width (n_head * head_dim)
    n_kv: int = 256  # attn_k's and attn_v's (n_head_kv * head_dim)
    rank: int = 4
    alpha: float = 8.0  # the delta is scaled by alpha / rank
    seed: int = 0
    invocation: tuple[int, ...] = ()  # aLoRA invocation tokens (): a plain adapter

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"demo_lora: arch must be one of {ARCHS}, not {self.arch!r}")
        if self.rank <= 0:
            raise ValueError("demo_lora: rank must be a positive integer")

    def tag(self) -> str:
        inv = "-i" + ".".join(map(str, self.invocation)) if self.invocation else ""
        return (f"{self.arch}-L{self.n_layer}-E{self.n_embd}-Q{self.n_q}-KV{self.n_kv}"
                f"-R{self.rank}-A{self.alpha:g}-s{self.seed}{inv}")


def for_model(text: ModelShape, seed: int = 0, arch: str = "llama") -> DemoLoraParams:
    """The adapter that fits a demo model of these sizes and architecture (llama-server
    refuses one whose shapes or architecture differ)."""
    return DemoLoraParams(arch=arch, n_layer=text.n_layer, n_embd=text.n_embd,
                          n_q=text.n_head * text.head_dim,
                          n_kv=text.n_head_kv * text.head_dim, seed=seed,
                          invocation=INVOCATIONS.get(seed, ()))


def demo_lora_path(params: DemoLoraParams | None = None) -> Path:
    """Where the demo adapter of these sizes lives (may not exist)."""
    params = params or DemoLoraParams()
    return cache_dir() / "models" / f"kvroute-lora-{params.tag()}.gguf"


def demo_lora_paths(text: ModelShape, arch: str) -> dict[str, Path] | None:
    """Each demo adapter's name (`lora: [demo]`) -> its file for a demo model of this
    architecture (None: one the adapters do not fit)."""
    if arch not in ARCHS:
        return None
    return {name: demo_lora_path(for_model(text, seed, arch))
            for name, seed in DEMO_LORAS.items()}


def ensure_if_used(text: ModelShape, loras: Iterable[Path],
                   progress: Progress = _print) -> list[Path]:
    """The demo adapters for these sizes that are among ``loras`` (the managed backends'),
    built if missing: what `prepare` and `serve` build for a config."""
    wanted = set(loras)
    params = [for_model(text, seed, arch) for arch in ARCHS for seed in DEMO_LORAS.values()]
    return [ensure_demo_lora(p, progress) for p in params if demo_lora_path(p) in wanted]


def write_lora(path: Path, params: DemoLoraParams) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), params.arch)
    w.add_name("kvroute-demo-lora")
    w.add_type("adapter")  # general.type: llama.cpp refuses a model file as an adapter
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", params.alpha)
    if params.invocation:
        # (an array of uint32, as convert_lora_to_gguf.py writes it: the server refuses
        # another element type)
        w.add_key_value("adapter.alora.invocation_tokens", list(params.invocation),
                        gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    r = Weights(params.seed)
    outs = {"attn_q": params.n_q, "attn_k": params.n_kv, "attn_v": params.n_kv}
    for i in range(params.n_layer):
        for name in TARGETS:
            # numpy (rows, cols) is ggml {cols, rows}: A is {n_embd, rank}, B {rank, out}
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a",
                         r.mat(params.rank, params.n_embd, scale=0.1))
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b",
                         r.mat(outs[name], params.rank, scale=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_demo_lora(params: DemoLoraParams | None = None,
                     progress: Progress = _print) -> Path:
    """Path of the demo adapter, synthesised first if missing (well under a second)."""
    p = params or DemoLoraParams()
    return synthesised(demo_lora_path(p), "the demo LoRA adapter",
                       lambda tmp: write_lora(tmp, p), progress)
