"""The `demo-hybrid` model: lfm2, gated short-convolution layers next to attention.

Every ATTENTION_EVERY-th layer is attention (llama.cpp reads the layout from the
per-layer KV head counts: 0 makes a layer recurrent); the others are LFM2's gated short
convolutions, whose state (the last L_CACHE - 1 inputs) llama-server keeps in a
recurrent memory that cannot be cut back to an arbitrary token. So a prompt that
diverges from a slot's content can reuse it only from a context checkpoint
(docs/checkpoints.md). lfm2 is the cheapest hybrid to synthesise: dense layers, three
small tensors per convolution, no SSM parameters to keep stable.
"""

from __future__ import annotations

from typing import Any

from backends.demo_gguf import ModelShape, Weights, kv_bytes

ARCH = "lfm2"
ATTENTION_EVERY = 3
L_CACHE = 3  # the convolution's kernel length, LFM2's own
LAYOUT = f"lfm2-a{ATTENTION_EVERY}-c{L_CACHE}"


def attention_layers(params: ModelShape) -> list[int]:
    return [i for i in range(params.n_layer) if i % ATTENTION_EVERY == ATTENTION_EVERY - 1]


def kv_bytes_per_token(params: ModelShape) -> int:
    """f16 KV bytes per token of the attention layers (the convolutions' state has a
    fixed size, whatever the context)."""
    return kv_bytes(len(attention_layers(params)), params)


def add_model(w: Any, n_vocab: int, params: ModelShape, r: Weights) -> None:
    """Add this architecture's keys and tensors to a writer that holds the vocabulary."""
    attn = set(attention_layers(params))
    w.add_head_count_kv([params.n_head_kv if i in attn else 0 for i in range(params.n_layer)])
    w.add_key_length(params.head_dim)
    w.add_value_length(params.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_shortconv_l_cache(L_CACHE)
    w.add_uint64("kvroute.kv_bytes_per_token", kv_bytes_per_token(params))
    e, hd, ff = params.n_embd, params.head_dim, params.n_ff
    w.add_tensor("token_embd.weight", r.mat(n_vocab, e))
    # lfm2's final norm has this name in GGUF files (llama-arch.cpp: "fix for wrong name")
    w.add_tensor("token_embd_norm.weight", r.ones(e))
    for i in range(params.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", r.ones(e))
        if i in attn:
            w.add_tensor(p + "attn_q_norm.weight", r.ones(hd))
            w.add_tensor(p + "attn_k_norm.weight", r.ones(hd))
            w.add_tensor(p + "attn_q.weight", r.mat(params.n_head * hd, e))
            w.add_tensor(p + "attn_k.weight", r.mat(params.n_head_kv * hd, e))
            w.add_tensor(p + "attn_v.weight", r.mat(params.n_head_kv * hd, e))
            w.add_tensor(p + "attn_output.weight", r.mat(e, e))
        else:
            w.add_tensor(p + "shortconv.conv.weight", r.mat(e, L_CACHE, scale=0.5).astype("f4"))
            w.add_tensor(p + "shortconv.in_proj.weight", r.mat(3 * e, e))
            w.add_tensor(p + "shortconv.out_proj.weight", r.mat(e, e))
        w.add_tensor(p + "ffn_norm.weight", r.ones(e))
        w.add_tensor(p + "ffn_gate.weight", r.mat(ff, e))
        w.add_tensor(p + "ffn_up.weight", r.mat(ff, e))
        w.add_tensor(p + "ffn_down.weight", r.mat(e, ff))
