"""The demo multimodal projector: a llava-style (`mlp`) CLIP vision tower with random
weights, for `mmproj: demo` next to any of the demo models.

llama-server loads it with `--mmproj` (tools/mtmd/clip.cpp) and then serves images. The
`mlp` projector is the simplest clip.cpp has that fits a llama text model: a ViT over
fixed-size patches, then two linear layers out to the text model's width. mtmd resizes
(and pads) every image to `image_size` square first, so each image takes exactly
(image_size / patch_size)^2 positions, however large it is, and mtmd writes no marker
tokens around it. The tower is tiny (2 layers of width 64) so that an image costs about
as much CPU as a few dozen prompt tokens. Output is noise, as the text model's is.

The file is cached by its sizes and seed, as the demo models are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.binary import Progress, _print, cache_dir
from backends.demo_gguf import ModelShape, Weights, synthesised

PROJECTOR = "mlp"  # clip.projector_type: llava 1.5's two-layer MLP
DEMO_MMPROJ = "demo"  # `mmproj: demo` in config.yaml
# CLIP's normalisation constants (what llava's image processor applies)
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class DemoMmprojParams:
    image_size: int = 64  # every image is resized to this square
    patch_size: int = 8
    n_layer: int = 2  # llava reads the second-to-last layer's output: 1 layer runs
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    n_embd_text: int = 512  # the text model's width (the demo models': 512)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError("demo_mmproj: image_size must be a multiple of patch_size")
        if self.n_embd % self.n_head:
            raise ValueError("demo_mmproj: n_embd must be a multiple of n_head")
        if self.n_layer < 2:
            raise ValueError("demo_mmproj: n_layer must be >= 2 (llava skips the last)")

    @property
    def n_patches(self) -> int:
        """The positions one image takes in the text model's context."""
        return (self.image_size // self.patch_size) ** 2

    def tag(self) -> str:
        return (f"I{self.image_size}-P{self.patch_size}-L{self.n_layer}-E{self.n_embd}"
                f"-H{self.n_head}-F{self.n_ff}-T{self.n_embd_text}-s{self.seed}")


def for_model(text: ModelShape) -> DemoMmprojParams:
    """The projector that fits a demo text model of these sizes (llama-server refuses
    one whose output width is not the text model's)."""
    return DemoMmprojParams(n_embd_text=text.n_embd)


def demo_mmproj_path(params: DemoMmprojParams | None = None) -> Path:
    """Where the demo projector of these sizes lives (may not exist)."""
    params = params or DemoMmprojParams()
    return cache_dir() / "models" / f"kvroute-mmproj-{PROJECTOR}-{params.tag()}.gguf"


def ensure_if_used(text: ModelShape, mmprojs: Iterable[Path | None],
                   progress: Progress = _print) -> Path | None:
    """The demo projector for these text sizes, built if it is among ``mmprojs`` (the
    managed backends'): what `prepare` and `serve` build for a config."""
    params = for_model(text)
    if demo_mmproj_path(params) not in set(mmprojs):
        return None
    return ensure_demo_mmproj(params, progress)


def _add_keys(w: Any, p: DemoMmprojParams) -> None:
    import gguf

    w.add_name("kvroute-demo-mmproj")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", PROJECTOR)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", p.image_size)
    w.add_uint32("clip.vision.patch_size", p.patch_size)
    w.add_uint32("clip.vision.embedding_length", p.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", p.n_ff)
    w.add_uint32("clip.vision.block_count", p.n_layer)
    w.add_uint32("clip.vision.projection_dim", p.n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", p.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_array("clip.vision.image_mean", list(IMAGE_MEAN))
    w.add_array("clip.vision.image_std", list(IMAGE_STD))


def _add_tensors(w: Any, p: DemoMmprojParams, r: Weights) -> None:
    import numpy as np

    e, ff, t = p.n_embd, p.n_ff, p.n_embd_text

    def zeros(n: int) -> Any:
        return np.zeros(n, dtype=np.float32)

    # ggml {ne0..ne3} = {patch, patch, 3, n_embd}: the convolution that cuts the patches
    conv = r.mat(e, 3 * p.patch_size ** 2, scale=0.1)
    w.add_tensor("v.patch_embd.weight", conv.reshape(e, 3, p.patch_size, p.patch_size))
    w.add_tensor("v.position_embd.weight", r.mat(p.n_patches, e).astype(np.float32))
    w.add_tensor("v.pre_ln.weight", r.ones(e))
    w.add_tensor("v.pre_ln.bias", zeros(e))
    for i in range(p.n_layer):
        b = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(b + name + ".weight", r.mat(e, e))
            w.add_tensor(b + name + ".bias", zeros(e))
        for norm in ("ln1", "ln2"):
            w.add_tensor(b + norm + ".weight", r.ones(e))
            w.add_tensor(b + norm + ".bias", zeros(e))
        w.add_tensor(b + "ffn_up.weight", r.mat(ff, e))
        w.add_tensor(b + "ffn_up.bias", zeros(ff))
        w.add_tensor(b + "ffn_down.weight", r.mat(e, ff))
        w.add_tensor(b + "ffn_down.bias", zeros(e))
    # the projector: n_embd -> n_embd_text -> n_embd_text, GELU between (llava's mm.0, mm.2)
    w.add_tensor("mm.0.weight", r.mat(t, e))
    w.add_tensor("mm.0.bias", zeros(t))
    w.add_tensor("mm.2.weight", r.mat(t, t))
    w.add_tensor("mm.2.bias", zeros(t))


def write_mmproj(path: Path, params: DemoMmprojParams) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    _add_keys(w, params)
    _add_tensors(w, params, Weights(params.seed))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_demo_mmproj(params: DemoMmprojParams | None = None,
                       progress: Progress = _print) -> Path:
    """Path of the demo projector, synthesised first if missing (well under a second,
    ~0.4 MB by default)."""
    p = params or DemoMmprojParams()
    return synthesised(demo_mmproj_path(p), "the demo projector",
                       lambda tmp: write_mmproj(tmp, p), progress)
