"""The `demo-swa` model: gemma3 with interleaved sliding-window attention.

Of every SLIDING_PATTERN layers the last attends to the whole context and the others to
the last SLIDING_WINDOW tokens only (gemma3's own layout with a 4-layer period instead
of 6, so 8 layers hold 2 full ones). llama-server keeps a sliding layer's cache for
about window + ubatch tokens, so a prompt that diverges from a slot's content can reuse
it only from a context checkpoint whose window still covers the divergence point
(docs/checkpoints.md). The window is small (256) so tests see that with short prompts.
"""

from __future__ import annotations

from typing import Any

from backends.demo_gguf import ModelShape, Weights, kv_bytes

ARCH = "gemma3"
SLIDING_WINDOW = 256
SLIDING_PATTERN = 4
LAYOUT = f"gemma3-w{SLIDING_WINDOW}-p{SLIDING_PATTERN}"


def full_layers(params: ModelShape) -> list[int]:
    """The layers that attend to the whole context (llama_hparams::set_swa_pattern)."""
    return [i for i in range(params.n_layer) if i % SLIDING_PATTERN == SLIDING_PATTERN - 1]


def kv_bytes_per_token(params: ModelShape) -> int:
    """f16 KV bytes per token of the full-attention layers: the part that grows with the
    context (the sliding layers hold at most window + ubatch tokens each)."""
    return kv_bytes(len(full_layers(params)), params)


def add_model(w: Any, n_vocab: int, params: ModelShape, r: Weights) -> None:
    """Add this architecture's keys and tensors to a writer that holds the vocabulary."""
    w.add_head_count_kv(params.n_head_kv)
    w.add_key_length(params.head_dim)
    w.add_value_length(params.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_float32(f"{ARCH}.rope.freq_base_swa", 10_000.0)
    w.add_sliding_window(SLIDING_WINDOW)
    w.add_uint32(f"{ARCH}.attention.sliding_window_pattern", SLIDING_PATTERN)
    w.add_uint64("kvroute.kv_bytes_per_token", kv_bytes_per_token(params))
    e, hd, ff = params.n_embd, params.head_dim, params.n_ff
    # gemma3 multiplies embeddings by sqrt(n_embd): smaller ones keep activations finite
    w.add_tensor("token_embd.weight", r.mat(n_vocab, e, scale=0.02 / e ** 0.5))
    w.add_tensor("output_norm.weight", r.ones(e))
    for i in range(params.n_layer):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + norm + ".weight", r.ones(e))
        w.add_tensor(p + "attn_q_norm.weight", r.ones(hd))
        w.add_tensor(p + "attn_k_norm.weight", r.ones(hd))
        w.add_tensor(p + "attn_q.weight", r.mat(params.n_head * hd, e))
        w.add_tensor(p + "attn_k.weight", r.mat(params.n_head_kv * hd, e))
        w.add_tensor(p + "attn_v.weight", r.mat(params.n_head_kv * hd, e))
        w.add_tensor(p + "attn_output.weight", r.mat(e, params.n_head * hd))
        w.add_tensor(p + "ffn_gate.weight", r.mat(ff, e))
        w.add_tensor(p + "ffn_up.weight", r.mat(ff, e))
        w.add_tensor(p + "ffn_down.weight", r.mat(e, ff))
