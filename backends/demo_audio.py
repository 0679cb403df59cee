"""The demo audio projector: an Ultravox-style whisper encoder with random weights, for
`--mmproj` next to any of the demo models, so that tests can send real audio
(`input_audio` chat parts) to real llama-servers.

llama-server loads it with `--mmproj` (tools/mtmd/clip.cpp) and then takes WAV, MP3 and
FLAC. Ultravox is the audio projector clip.cpp has that fits a llama text model best
(Ultravox itself is Llama 3 with a whisper encoder): mtmd writes no marker tokens around
its audio, where `qwen2a` writes `<|audio_bos|>` and `<|audio_eos|>`, which the Qwen2
vocabulary does not have (they would become several text tokens each), and its stack
factor sets how many positions a clip takes. mtmd decodes the file to 16 kHz mono,
computes a whisper log-mel spectrogram of it with 30 s of silence appended, and cuts that
into whole 30 s windows (3000 frames, the last partial one dropped): each window is one
chunk of 1500 / stack_factor positions, so a clip under 29.99 s takes one window and one
of 29.99 s to 59.98 s two. The encoder is tiny (2 layers of width 64) so that a window
costs about as much CPU as its positions in text tokens. Output is noise, as the text
model's is.

`mmproj: demo-audio` gives it to a demo model's backend. The file is cached by its sizes
and seed, as the demo models are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.binary import Progress, _print, cache_dir
from backends.demo_gguf import ModelShape, Weights, synthesised

PROJECTOR = "ultravox"  # clip.projector_type
DEMO_AUDIO = "demo-audio"  # `mmproj: demo-audio` in config.yaml
SAMPLE_RATE = 16000  # what mtmd resamples every clip to (whisper's)
HOP = 160  # samples per mel frame (whisper's; clip.cpp fixes it, as the rate and the FFT)
WINDOW_FRAMES = 3000  # mel frames per chunk: 30 s, whisper's input
CONV_FRAMES = WINDOW_FRAMES // 2  # the encoder's positions: its second convolution strides 2


@dataclass(frozen=True)
class DemoAudioParams:
    n_mel: int = 80  # whisper's mel bins (large-v3's 128 would only cost more)
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    # encoder frames stacked into one position: 1500 / 10 = 150 positions per window
    stack_factor: int = 10
    n_embd_text: int = 512  # the text model's width (the demo models': 512)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError("demo_audio: n_embd must be a multiple of n_head")
        if not 0 < self.n_mel <= 256:
            raise ValueError("demo_audio: n_mel must be in [1, 256] (clip.cpp's bound)")
        # clip.cpp counts ceil(3000 / f) / 2 positions, its graph makes ceil(1500 / f): they
        # differ (and every clip fails to encode) unless f divides 1500
        if self.stack_factor <= 0 or CONV_FRAMES % self.stack_factor:
            raise ValueError(f"demo_audio: stack_factor must divide {CONV_FRAMES}")

    @property
    def window_positions(self) -> int:
        """The positions one 30 s window takes in the text model's context."""
        return CONV_FRAMES // self.stack_factor

    def windows(self, n_samples: int) -> int:
        """The 30 s windows (chunks) a clip of this many 16 kHz samples becomes: the
        frames of the clip plus 30 s of silence (mtmd-audio.cpp), in whole windows."""
        n_fft = 400  # whisper's (clip.cpp fixes it); mtmd pads a shorter clip to half of it
        n = max(n_samples, n_fft // 2 + 1) + SAMPLE_RATE * 30
        return (n // HOP + 1) // WINDOW_FRAMES

    def positions(self, n_samples: int) -> int:
        """The positions a clip of this many 16 kHz samples takes: its windows'."""
        return self.windows(n_samples) * self.window_positions

    def tag(self) -> str:
        return (f"M{self.n_mel}-L{self.n_layer}-E{self.n_embd}-H{self.n_head}-F{self.n_ff}"
                f"-S{self.stack_factor}-T{self.n_embd_text}-s{self.seed}")


def for_model(text: ModelShape) -> DemoAudioParams:
    """The projector that fits a demo text model of these sizes (llama-server refuses
    one whose output width is not the text model's)."""
    return DemoAudioParams(n_embd_text=text.n_embd)


def demo_audio_path(params: DemoAudioParams | None = None) -> Path:
    """Where the demo audio projector of these sizes lives (may not exist)."""
    params = params or DemoAudioParams()
    return cache_dir() / "models" / f"kvroute-mmproj-{PROJECTOR}-{params.tag()}.gguf"


def ensure_if_used(text: ModelShape, mmprojs: Iterable[Path | None],
                   progress: Progress = _print) -> Path | None:
    """The demo audio projector for these text sizes, built if it is among ``mmprojs``
    (the managed backends'): what `prepare` and `serve` build for a config."""
    params = for_model(text)
    if demo_audio_path(params) not in set(mmprojs):
        return None
    return ensure_demo_audio(params, progress)


def _add_keys(w: Any, p: DemoAudioParams) -> None:
    import gguf

    w.add_name("kvroute-demo-audio")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", PROJECTOR)
    w.add_uint32("clip.audio.num_mel_bins", p.n_mel)
    w.add_uint32("clip.audio.embedding_length", p.n_embd)
    w.add_uint32("clip.audio.feed_forward_length", p.n_ff)
    w.add_uint32("clip.audio.block_count", p.n_layer)
    w.add_uint32("clip.audio.projection_dim", p.n_embd_text)  # required, unused by ultravox
    w.add_uint32("clip.audio.attention.head_count", p.n_head)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.audio.projector.stack_factor", p.stack_factor)


def _add_tensors(w: Any, p: DemoAudioParams, r: Weights) -> None:
    import numpy as np

    e, ff, t, stacked = p.n_embd, p.n_ff, p.n_embd_text, p.n_embd * p.stack_factor

    def zeros(*shape: int) -> Any:
        return np.zeros(shape, dtype=np.float32)

    # whisper's two convolutions, kernel 3: ggml {kernel, in, out}; a bias {1, out} so that
    # it broadcasts over the frames (what convert_hf_to_gguf.py writes for whisper)
    w.add_tensor("a.conv1d.1.weight", r.mat(e, p.n_mel * 3).reshape(e, p.n_mel, 3))
    w.add_tensor("a.conv1d.1.bias", zeros(e, 1))
    w.add_tensor("a.conv1d.2.weight", r.mat(e, e * 3).reshape(e, e, 3))
    w.add_tensor("a.conv1d.2.bias", zeros(e, 1))
    w.add_tensor("a.position_embd.weight", r.mat(CONV_FRAMES, e).astype(np.float32))
    for i in range(p.n_layer):
        b = f"a.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(b + name + ".weight", r.mat(e, e))
            if name != "attn_k":  # whisper's key projection has no bias (the graph asserts it)
                w.add_tensor(b + name + ".bias", zeros(e))
        for norm in ("ln1", "ln2"):
            w.add_tensor(b + norm + ".weight", r.ones(e))
            w.add_tensor(b + norm + ".bias", zeros(e))
        w.add_tensor(b + "ffn_up.weight", r.mat(ff, e))
        w.add_tensor(b + "ffn_up.bias", zeros(ff))
        w.add_tensor(b + "ffn_down.weight", r.mat(e, ff))
        w.add_tensor(b + "ffn_down.bias", zeros(e))
    w.add_tensor("a.post_ln.weight", r.ones(e))
    w.add_tensor("a.post_ln.bias", zeros(e))
    # Ultravox's projector over the stacked frames: RMS norm, linear to 2 x t, SwiGLU
    # (halves it), RMS norm, linear to the text model's width
    w.add_tensor("mm.a.norm_pre.weight", r.ones(stacked))
    w.add_tensor("mm.a.mlp.1.weight", r.mat(2 * t, stacked))
    w.add_tensor("mm.a.norm_mid.weight", r.ones(t))
    w.add_tensor("mm.a.mlp.2.weight", r.mat(t, t))


def write_audio_mmproj(path: Path, params: DemoAudioParams) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    _add_keys(w, params)
    _add_tensors(w, params, Weights(params.seed))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_demo_audio(params: DemoAudioParams | None = None,
                      progress: Progress = _print) -> Path:
    """Path of the demo audio projector, synthesised first if missing (well under a
    second, ~2.4 MB by default)."""
    p = params or DemoAudioParams()
    return synthesised(demo_audio_path(p), "the demo audio projector",
                       lambda tmp: write_audio_mmproj(tmp, p), progress)
