"""The tiny config of any causal-LM model type transformers ships, from its own config class: 2-4 layers, hidden
64, vocabulary 260, a sliding window of 8 where the type has one, and its special features kept (MoE routing,
multi-head latent attention, QK-norm, layer patterns, hybrids' linear-attention layers, per-layer overrides).

Used by the architecture sweep (kvviz.io.archsweep) and by the sweep's regression models in kvviz.models.tiny (tiny:<name>).
Pure config code: transformers only.
"""
from __future__ import annotations

import transformers

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, WINDOW, VOCAB = 64, 4, 2, 16, 96, 2, 8, 260

# config attribute -> tiny value (applied when the config class has that attribute)
_SIZES = {
    # widths
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN, "n_embed": HIDDEN,
    "word_embed_proj_dim": HIDDEN, "embed_dim": HIDDEN, "hidden_dim": HIDDEN,
    # depth
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "decoder_layers": LAYERS, "encoder_layers": LAYERS, "num_decoder_layers": LAYERS,
    # heads
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS, "n_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_size": HEAD_DIM,
    # feed-forward
    "intermediate_size": FFN, "n_inner": FFN, "ffn_dim": FFN, "decoder_ffn_dim": FFN, "encoder_ffn_dim": FFN,
    "ffn_hidden_size": FFN, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "intermediate_size_mlp": FFN,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "num_experts_per_token": 2, "moe_k": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "moe_num_shared_experts": 1,
    # MLA / low rank
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24, "rotary_dim": 8, "rotary_emb_base": None,
    # lengths
    "max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512, "max_sequence_length": 512,
    "seq_length": 512, "max_seq_len": 512, "sliding_window": WINDOW, "attention_window": WINDOW,
    # vocabulary and special tokens
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "decoder_start_token_id": 1,
    # state-space / recurrent
    "state_size": 8, "d_state": 8, "mamba_d_state": 8, "ssm_state_size": 8, "time_step_rank": 8,
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_head_dim": 32, "n_groups": 1, "mamba_n_groups": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "attention_hidden_size": HIDDEN, "lru_width": HIDDEN, "block_types": None,
    # vision / audio towers of multimodal types (text only is run)
    "image_size": 32, "patch_size": 8, "num_channels": 3, "projection_dim": HIDDEN,
    "vision_feature_layer": -1, "mm_tokens_per_image": 4, "adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN,
    "adapter_input_size": HIDDEN,
    # BLT: its byte n-gram hash embeddings (500,002 rows each) and the global transformer's width
    "encoder_hash_byte_group_vocab": 1024, "hidden_size_global": HIDDEN,
}
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "decoder", "encoder", "llm_config",
               "encoder_config", "decoder_config", "global_config", "patcher_config")  # BLT's four


def _shrink_layer_list(value, n: int):
    """A layer-type list cut to n entries, keeping every kind it has (a sliding/global mix stays a mix)."""
    if not isinstance(value, (list, tuple)) or not value:
        return value
    kinds = list(dict.fromkeys(value))
    out = list(value[:n])
    missing = [k for k in kinds if k not in out]
    if missing:
        out = out[:max(1, n - len(missing))] + missing
    return out


def _shrink_dict(d: dict, defaults: dict) -> dict:
    """The tiny overrides for one config's dict (recursing into sub-configs)."""
    out = {}
    for key, val in _SIZES.items():
        if key in defaults and val is not None:
            cur = defaults[key]
            if isinstance(cur, bool) or (cur is not None and not isinstance(cur, (int, float))):
                continue
            if key in ("sliding_window", "attention_window") and cur in (None, 0):
                continue  # keep "no window" as it is
            if key == "eos_token_id" and isinstance(cur, list):
                val = [2]
            out[key] = val
    n_layers = out.get("num_hidden_layers") or out.get("n_layer") or out.get("num_layers") or LAYERS
    for key in _LAYER_LISTS:
        if isinstance(defaults.get(key), (list, tuple)):
            lst = _shrink_layer_list(defaults[key], n_layers)
            out[key] = lst
            for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
                if k in defaults:
                    out[k] = len(lst)
        elif isinstance(defaults.get(key), str):  # e.g. nemotron_h's "M-M*-"
            pat = defaults[key]
            kinds = list(dict.fromkeys(pat))
            out[key] = "".join(kinds)
            for k in ("num_hidden_layers", "n_layer", "num_layers"):
                if k in defaults:
                    out[k] = len(kinds)
    _shrink_per_layer(defaults, out)
    if defaults.get("kv_lora_rank") and defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        # multi-head latent attention (DeepSeek-V2 style): the latent is expanded to every query head, so as many
        # key/value heads as query heads (a grouped count makes the attention repeat the expanded heads again)
        out["num_key_value_heads"] = HEADS
        if "head_dim" in defaults and "qk_rope_head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]  # the rotary embedding's width is head_dim: the rope part's
    if "sliding_window_pattern" in defaults and isinstance(defaults["sliding_window_pattern"], int):
        out["sliding_window_pattern"] = 2
    if "rope_parameters" in defaults and isinstance(defaults["rope_parameters"], dict):
        out["rope_parameters"] = _small_rope(defaults["rope_parameters"])
    for key in _SUBCONFIGS:
        sub = defaults.get(key)
        if isinstance(sub, dict):
            out[key] = {**sub, **_shrink_dict(sub, sub)}
    return out


def _n_layers(d: dict) -> int | None:
    for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            return d[k]
    return None


def _shrink_per_layer(defaults: dict, out: dict) -> None:
    """Per-layer lists (Gemma 3n's intermediate sizes and sparsity, dots3's MLP kinds) cut to the tiny depth, and
    per-layer overrides (`per_layer_config`: Gemma 4's wider global heads, dots3's MLA widths) moved onto the tiny
    layer of the same kind."""
    n_old, n_new = _n_layers(defaults), _n_layers(out)
    if not n_old or not n_new:
        return
    for key, val in defaults.items():
        if key in _LAYER_LISTS or key in out or not isinstance(val, list) or len(val) != n_old:
            continue
        if all(isinstance(v, str) for v in val):
            out[key] = _shrink_layer_list(val, n_new)
        elif key in _SIZES and _SIZES[key] is not None:
            out[key] = [_SIZES[key]] * n_new
        else:
            out[key] = list(val[:n_new])
    plc = defaults.get("per_layer_config")
    if isinstance(plc, dict) and plc:
        old_types = defaults.get("layer_types") or []
        new_types = out.get("layer_types") or []
        width = max(len(str(k)) for k in plc)
        new = {}
        for i in range(n_new):
            # the first original layer of this tiny layer's kind (or the same index) that has an override
            kind = new_types[i] if i < len(new_types) else None
            src = next((j for j in range(n_old) if (old_types[j] if j < len(old_types) else None) == kind
                        and _plc_get(plc, j) is not None), None) if kind is not None else \
                (i if _plc_get(plc, i) is not None else None)
            if src is None:
                continue
            over = _plc_get(plc, src)
            small = {k: (_SIZES[k] if k in _SIZES and _SIZES[k] is not None and isinstance(v, int) else v)
                     for k, v in over.items()}
            if "head_dim" in over and set(over) == {"head_dim"}:
                small["head_dim"] = 2 * HEAD_DIM  # a wider head on this kind of layer (Gemma 4's global layers)
            if over.get("kv_lora_rank") and over.get("num_key_value_heads") == over.get("num_attention_heads"):
                small["num_key_value_heads"] = HEADS
            new[str(i).zfill(width) if all(isinstance(k, str) for k in plc) else i] = small
        out["per_layer_config"] = new


def _plc_get(plc: dict, j: int):
    for k in (j, str(j), f"{j:02d}"):
        if k in plc:
            return plc[k]
    return None


def _small_rope(rp: dict) -> dict:
    """Rope scalings that need a long original context (yarn, longrope) kept, their lengths shrunk."""
    def fix(p):
        if not isinstance(p, dict):
            return p
        p = dict(p)
        if "original_max_position_embeddings" in p:
            p["original_max_position_embeddings"] = 128
        for k in ("short_factor", "long_factor"):
            if isinstance(p.get(k), list):
                p[k] = [1.0] * (HEAD_DIM // 2)
        if "mrope_section" in p:
            p["mrope_section"] = [2, 3, 3]
        return p
    if all(isinstance(v, dict) for v in rp.values()):
        return {k: fix(v) for k, v in rp.items()}
    return fix(rp)


def tiny_arch_config(model_type: str, **extra):
    """The tiny config of `model_type`, from its own config class."""
    cls = transformers.CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kwargs = _shrink_dict(defaults, defaults)
    if model_type in _SPECIAL:
        for k, v in _SPECIAL[model_type](defaults).items():  # a sub-config's fixes merged into its shrunk dict
            kwargs[k] = {**kwargs[k], **v} if isinstance(v, dict) and isinstance(kwargs.get(k), dict) else v
    kwargs.update(extra)
    # MoE experts: the eager loop (torch's grouped_mm has no float64 kernel, and the card runs in float64)
    kwargs.setdefault("experts_implementation", "eager")
    if "is_decoder" in defaults and model_type not in _BIDIRECTIONAL:
        kwargs["is_decoder"] = True  # encoder families as causal LMs need it (a decoder); RoBERTa kept without it
    return cls(**kwargs)


# Per-type fixes where the generic shrink does not give a consistent config.
_SPECIAL = {
    "gemma3_text": lambda d: {"query_pre_attn_scalar": HEAD_DIM},
    "gemma2": lambda d: {"query_pre_attn_scalar": HEAD_DIM},
    "rwkv": lambda d: {"attention_hidden_size": HIDDEN, "intermediate_size": FFN},
    "reformer": lambda d: {"attn_layers": ["local", "lsh"], "axial_pos_shape": [16, 16],
                           "axial_pos_embds_dim": [32, 32], "max_position_embeddings": 256,
                           "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 4},
    "xlnet": lambda d: {"d_inner": FFN, "n_head": HEADS, "d_head": HEAD_DIM},
    "ctrl": lambda d: {"dff": FFN},
    "transfo-xl": lambda d: {},
    "mpt": lambda d: {"expansion_ratio": 2, "attn_config": {**(d.get("attn_config") or {}), "alibi": True}},
    # hybrids: one linear-attention (Mamba / conv) layer and one attention layer, as the real ones interleave them
    "bamba": lambda d: {"attn_layer_indices": [1]},
    "jamba": lambda d: {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                        "expert_layer_offset": 1},
    "granitemoehybrid": lambda d: {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2": lambda d: {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": lambda d: {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # two hybrid layers sharing one attention block (transformers ties the second's to the first's)
    "zamba": lambda d: {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2, "attention_hidden_size": 2 * HIDDEN,
                        "attention_head_dim": 2 * HIDDEN // HEADS, "num_key_value_heads": HEADS},
    "cohere_compass_text": lambda d: {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}}},
    "qwen4_exp": lambda d: {"text_config": _QSA},
    "qwen4_exp_text": lambda d: _QSA,
    "gemma3n_text": lambda d: _GEMMA3N,
    "gemma3n": lambda d: {"text_config": _GEMMA3N},
    "dots3_note_text": lambda d: _DOTS3,
    "dots3_note": lambda d: {"text_config": _DOTS3},
    # Zamba's attention sees the hidden state concatenated with the embeddings: twice the width
    "zamba2": lambda d: {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS,
                         "num_key_value_heads": HEADS},
    # transformers' xLSTM cache holds a [v, v] matrix state: with qk_dim_factor 0.5 (the default) use_cache=True
    # fails in plain transformers ("matC_old has wrong shape"); equal q/k and v widths run
    "xlstm": lambda d: {"qk_dim_factor": 1.0},
    "gpt_neo": lambda d: {"attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    "mamba2": lambda d: {"num_heads": 8, "head_dim": 16, "expand": 2},
    "falcon_h1": lambda d: {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2},
    "zaya": lambda d: {"num_experts_per_tok": 1},
    # Kolibri 1.1 (transformers 5.25): a sliding layer and an indexed-attention layer whose indexer picks 8 of the
    # prompt's tokens in pools of 16 (compressed by 4), index heads within one key head's query group
    "kolibri1_1": lambda d: {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                             "kv_source_layers": [0, 1], "index_num_heads": HEADS // KV_HEADS, "index_topk": 8,
                             "index_pool_size": 16, "index_compression": 4, "index_num_local_tokens": 4,
                             "index_num_sink_tokens": 1, "mlp_only_layers": [0], "mlp_only_intermediate_size": FFN},
    "dbrx": lambda d: {"d_model": HIDDEN, "n_heads": HEADS, "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4,
                                                                         "moe_top_k": 2},
                       "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
}
# Qwen4-Exp's token indexer (QSA) on its indexed layers: one key head, a budget of 8 tokens in blocks of 4
_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
        "indexer_compress_ratio": 4}
# Gemma 3n: 4 layers (sliding, full) x 2 whose last two reuse the first two's keys and values (its cross-layer KV
# sharing kept), per-layer inputs and LAuReL shrunk
_GEMMA3N = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2, "intermediate_size": [FFN] * 4, "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
            "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8}
# dots3: MLA on indexed layers and sliding-window layers whose head_dim = qk_nope + qk_rope (a quarter of it rotary)
_DOTS3 = {"qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "head_dim": 32, "v_head_dim": 16, "index_head_dim": HEAD_DIM,
          "index_n_heads": 2, "index_topk": 8,
          "per_layer_config": {"01": {"num_attention_heads": HEADS, "num_key_value_heads": HEADS, "kv_lora_rank": 16,
                                      "qk_nope_head_dim": 24}}}
_BIDIRECTIONAL = ("roberta",)  # built without is_decoder (it attends both ways): the card must say unsafe
