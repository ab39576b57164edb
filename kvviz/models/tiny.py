"""Synthetic models for tests and demos: tiny configs, seeded random weights, a byte-level tokenizer.

A tiny model is written to a folder (config.json, model.safetensors, tokenizer files) and then loaded
through exactly the same code as a real model folder, so tests exercise the real loading path.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
import transformers
from transformers import PreTrainedTokenizerFast

from .archconfig import tiny_arch_config
from .compat import quiet_transformers

# Bump when configs or the tokenizer change, so stale folders in the cache are rebuilt.
TINY_VERSION = 2
TINY_SEED = 1234

_COMMON = dict(vocab_size=260, tie_word_embeddings=False)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=512, **_COMMON)
_GQA = dict(_DECODER, num_key_value_heads=2)

# Each entry: transformers model_type -> config kwargs. Small enough to run in milliseconds on a CPU,
# large enough to have grouped KV heads, several layers and the architecture's own quirks.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_GQA),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_positions=512, **_COMMON),
    "gpt_neox": dict(_DECODER, rotary_pct=0.25, use_parallel_residual=True),
    "qwen2": dict(_GQA),
    "mistral": dict(_GQA, sliding_window=8),
    "gemma2": dict(_GQA, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    # Gemma 3 (model type gemma3_text): the real 5:1 sliding/global layer pattern (5 sliding layers, then a global
    # one), QK-norm, two rotary bases (local 10k, global 1M), embeddings scaled by sqrt(hidden), a window of 8.
    "gemma3": dict(_GQA, num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"],
                   rope_parameters={"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}),
    # RoBERTa as a causal LM *without* is_decoder: bidirectional, returns no cache.
    "roberta": dict(_DECODER, max_position_embeddings=520, type_vocab_size=1, pad_token_id=0, is_decoder=False),
}

TINY_ARCHS = tuple(TINY_CONFIGS)
# A tiny name that is not the transformers model_type it builds.
TINY_MODEL_TYPES: dict[str, str] = {"gemma3": "gemma3_text"}

# Constructed models: a tiny architecture whose weights are then set by hand to show one effect on any machine.
#   tie: a llama whose two top tokens ("a", "b") differ by 2^-12 of a weight: float32/float64 choose "b" by a margin
#        of ~2e-3, while in float16/bfloat16 both weights round to the same number, the logits tie exactly and argmax
#        takes the first, "a". A 16-bit greedy flip that happens on every CPU and GPU, whatever the kernels.
#   split: a llama whose token "b" has the logit v + T·v − T·v (three products of one value v > 0, T = 2^26) and "a"
#        the logit v/2: summed in index order "b" wins (v); summed in two halves, as a split-K GEMM does when it
#        sees several rows (kvviz/core/simkernel.py), float32 loses v under T·v and "a" wins. Used by the Serving view's
#        test: alone (the head sees one row) vs in a batch (several rows) must part; in invariant mode never.
#   flip: a Mamba whose cached and no-cache greedy paths part at step 1 in bfloat16 on every machine, with transformers'
#        own code and real kernels: the cached step (mamba_selective_state_update) rounds its skip term x·D to
#        bfloat16 before multiplying by the gate, where the full scan keeps x·D·gate in float32 and rounds once. All
#        other arithmetic is exact, so that one double rounding (580 vs 584) decides between "a" and "b" (_construct_flip).
TINY_CONSTRUCTED: dict[str, str] = {"tie": "llama", "split": "llama", "flip": "mamba"}
TINY_MODELS = TINY_ARCHS + tuple(TINY_CONSTRUCTED)

# Sweep regressions: architectures where the architecture sweep (kvviz.io.archsweep) found a problem in kvviz, each
# built by the sweep's own config builder (kvviz.models.archconfig) and loadable as tiny:<name>; tests/test_architecture_families.py
# fails if the problem comes back. Not in TINY_ARCHS (the per-architecture test matrix) nor the app's model list.
TINY_SWEEP: dict[str, str] = {
    "mamba": "mamba",  # a state-space cache (cache_params, linear-attention layers only): no past_key_values
    "bamba": "bamba",  # a hybrid (Mamba + attention layers): get_seq_length raised on a linear-attention cache
    "bloom": "bloom",  # alibi built from the mask: the card's padding check ran new-only-mask cells and crashed
    "opt": "opt",  # positions from the mask: the same crash
    "deepseek_v2": "deepseek_v2",  # MLA (the config) and a router in float32 via Tensor.type: float64 gaps ~1e-8
    "rwkv": "rwkv",  # its cache is `state`, made in float32 inside a float64 run
    "openai-gpt": "openai-gpt",  # causal with no cache at all: the card called it bidirectional
    "gemma3-vlm": "gemma3",  # a multimodal config: no num_hidden_layers of its own (its text config has them)
    "xglm": "xglm",  # torch.full((), finfo(float64).min) made in float32 overflowed
    "gemma3n": "gemma3n_text",  # AltUp: 4 residual streams per layer, hidden states [S, B, T, H]; KV shared by layers
    "hy_v4": "hy_v4",  # hyper-connections: residual streams per layer, hidden states [B, T, S, H]
    "qwen4_exp": "qwen4_exp_text",  # hyper-connections flattened into the width: hidden states [B, T, S × H]
    "qwen3_next": "qwen3_next",  # gated DeltaNet layers: a causal conv1d over cached states + new tokens, a chunked
    # scan anchored at each call's first token, a silu on a sliced conv output - invariant mode left 6.7e-16
    "kimi_linear": "kimi_linear",  # Kimi delta attention: its chunked scan, decorated by transformers 5.25's kernel
    # hub wrapper (an nn.Module taking *args, **kwargs), raised a TypeError when invariant mode called its recurrence
}
TIE_TOKENS = ("a", "b")
TIE_DELTA = 2.0 ** -12  # exact in float32, below half an ulp of 1.0 in float16 (2^-11) and bfloat16 (2^-8)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def byte_tokenizer():
    """A byte-level tokenizer built in code (no download): 256 byte tokens plus pad/bos/eos."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)


def tiny_config(arch: str):
    if arch not in TINY_CONFIGS:
        raise KeyError(arch)
    kwargs = dict(TINY_CONFIGS[arch])
    kwargs.setdefault("pad_token_id", 0)
    kwargs.update(bos_token_id=1, eos_token_id=2)
    return transformers.AutoConfig.for_model(TINY_MODEL_TYPES.get(arch, arch), **kwargs)


def _carry(model, dims, value: float) -> None:
    """Residual dimensions `dims` carry the constant `value` through every layer (their embedding columns hold it,
    every layer's output rows for them are 0), and lm_head reads them for no token."""
    for d in dims:
        model.model.embed_tokens.weight[:, d] = value
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[d, :] = 0.0
            layer.mlp.down_proj.weight[d, :] = 0.0
        model.lm_head.weight[:, d] = 0.0


def _construct_tie(model, tokenizer) -> None:
    """Residual dimension 0 carries a constant C through every layer, so after the final norm h[0] ≈ C / rms > 0 at
    every position. lm_head reads only that dimension for "a" (weight 1) and "b" (weight 1 + 2^-12); every other
    token does not read it."""
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in TIE_TOKENS)
    with torch.no_grad():
        _carry(model, (0,), 16.0)
        head = model.lm_head.weight
        head[a] = 0.0
        head[b] = 0.0
        head[a, 0] = 1.0
        head[b, 0] = 1.0 + TIE_DELTA


SPLIT_TOKENS = ("a", "b")
SPLIT_DIMS = (0, 32, 33)  # hidden 64: dim 0 in the first half, 32 and 33 in the second
SPLIT_T = 2.0 ** 26


def _construct_split(model, tokenizer) -> None:
    """Dims 0, 32 and 33 carry the same constant through every layer, so after the final norm they hold one value
    v > 0. lm_head: "a" reads v/2 from dim 33; "b" reads +T·v (dim 0), −T·v (dim 32) and v (dim 33)."""
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in SPLIT_TOKENS)
    with torch.no_grad():
        _carry(model, SPLIT_DIMS, 64.0)
        head = model.lm_head.weight
        head[a] = 0.0
        head[b] = 0.0
        head[a, 33] = 0.5
        head[b, 0], head[b, 32], head[b, 33] = SPLIT_T, -SPLIT_T, 1.0


FLIP_TOKENS = ("a", "b")
# how tiny:flip was built, in one sentence (the Greedy paths page and the lesson show it)
FLIP_BUILT = ("tiny:flip is a 2-layer Mamba set by hand so that every number is exact but one: its cached step rounds "
              "the skip term x·D to bfloat16 before the gate where the full forward keeps it in float32 "
              "(transformers' own code), which makes 584 of 580 and tips “a” to “b”.")


def _construct_flip(model, tokenizer) -> None:
    """Every token embeds to 16 in residual dim 0 (0 elsewhere), so every position normalises to u = 8 there (bfloat16
    snaps the norm's eps away). Layer 0's mixer, all else zero (x_proj 0: the SSM state and its output y stay 0):
      channel 1: x = 3u = 24, gate z = 24, D = 129/128: full scan bf16(x·D·silu z) = bf16(580.5) = 580, cached step
                 bf16(bf16(x·D)·silu z) = bf16(24.25·24) = bf16(582) = 584, both halfway cases rounded to even
                 (silu(z) = z exactly for z >= 24);
      channels 2, 3: x = z = 32, D = 580/1024 and 584/1024: exactly 580 and 584 on both paths.
    out_proj writes 2^-8·(2·c1 - c2 - c3) into residual dim 1: -2^-6 from a full forward, +2^-6 from a cached step
    (exact sums). lm_head: "a" reads nothing (logit 0), "b" reads dim 1 (logit ∓2^-7), every other token −dim 0 (≈ −8).
    So the full forward picks "a" by 2^-7 and a cached step "b" by 2^-7. Layer 1 writes nothing."""
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in FLIP_TOKENS)
    layers = model.backbone.layers
    with torch.no_grad():
        model.backbone.embeddings.weight.zero_()
        model.backbone.embeddings.weight[:, 0] = 16.0
        for layer in layers:
            layer.norm.weight.fill_(1.0)
            layer.mixer.out_proj.weight.zero_()
        model.backbone.norm_f.weight.fill_(1.0)
        m = layers[0].mixer
        n = m.intermediate_size
        m.in_proj.weight.zero_()
        m.conv1d.weight.zero_()
        if m.conv1d.bias is not None:
            m.conv1d.bias.zero_()
        m.x_proj.weight.zero_()
        for c, (x, z, d) in {1: (3.0, 3.0, 129 / 128), 2: (4.0, 4.0, 580 / 1024), 3: (4.0, 4.0, 584 / 1024)}.items():
            m.in_proj.weight[c, 0] = x  # u = 8: x = 24 or 32
            m.in_proj.weight[n + c, 0] = z  # the gate, the same
            m.conv1d.weight[c, 0, -1] = 1.0  # the conv passes the current token's x through
            m.D[c] = d
        m.out_proj.weight[1, 1], m.out_proj.weight[1, 2], m.out_proj.weight[1, 3] = 2.0 ** -7, -2.0 ** -8, -2.0 ** -8
        head = model.lm_head.weight
        head.zero_()
        head[:, 0] = -1.0
        head[a] = 0.0
        head[b] = 0.0
        head[b, 1] = 1.0


def random_model(config, seed: int = TINY_SEED):
    """A causal LM of `config` with seeded random weights, larger than the default init so that logits have clear
    preferences (the tiny models and the architecture sweep build theirs this way)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, 0.08 if "embed" not in name and "wte" not in name else 1.0)
    return model


def build_tiny(arch: str, folder: Path) -> Path:
    """Write a tiny model with seeded random weights to `folder` (atomically) and return it."""
    folder = Path(folder)
    if (folder / "kvviz-tiny.json").exists():
        return folder

    quiet_transformers(verbosity=False)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=folder.parent))
    try:
        if arch in TINY_SWEEP or TINY_CONSTRUCTED.get(arch) == "mamba":
            config = tiny_arch_config(TINY_SWEEP.get(arch) or TINY_CONSTRUCTED[arch])
            if arch == "flip":
                config.tie_word_embeddings = False  # its lm_head is set by hand
        else:
            config = tiny_config(TINY_CONSTRUCTED.get(arch, arch))
        model = random_model(config, TINY_SEED)
        tokenizer = byte_tokenizer()
        if arch == "tie":
            _construct_tie(model, tokenizer)
        if arch == "split":
            _construct_split(model, tokenizer)
        if arch == "flip":
            _construct_flip(model, tokenizer)
        model.save_pretrained(tmp)
        if getattr(model.config, "model_type", None) != config.model_type:
            config.save_pretrained(tmp)  # a class that keeps only its text sub-config saves that: write the type's own
        tokenizer.save_pretrained(tmp)
        (tmp / "kvviz-tiny.json").write_text(json.dumps({"arch": arch, "seed": TINY_SEED, "version": TINY_VERSION}))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race
            if not (folder / "kvviz-tiny.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
