"""The tiny random GLM-5.3-Flash checkpoint used by tests, CI and ``glm5 make-tiny``.

The checkpoint has the real model's *architecture and file layout* at toy width: hybrid KDA /
NoPE-MLA layers (with consecutive MLA layers), a k-pool DSA indexer whose ``index_topk`` is small
enough that ~100-token prompts are in the sparse regime, mHC residuals, dense then MoE MLPs, one
MTP layer stored as ``layers.{num_hidden_layers}``, a two-block vision tower, a byte-level BPE
tokenizer with the GLM special tokens, a GLM chat template and the processor configs.

Why every parameter is drawn by us instead of taken from transformers' init: HF's
``_init_weights`` sets the kpool compress gate to 1, the ape to 0, ``A_log`` to 0 and the mHC
base/scale to 0/1, which makes the pool softmax, the KDA decay and the hyper-connection mixing
degenerate, so an engine bug there would not change the logits. The recipe (model-spec §11.1) is:
norm weights ``1 + 0.1·N``, other 1-D parameters ``0.3·N``, everything with ≥2 dims ``0.05·N``.
Each tensor is drawn from its own generator seeded by ``(seed, tensor name)``, so values do not
depend on construction order and the same seed always gives the same bytes.

Key names come from transformers' ``save_pretrained`` (the *original* checkpoint layout:
per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``hc_attn_fn``, ``q_conv1d``,
``self_attn.f_a_proj`` ...), so the loader is exercised on exactly the names the real checkpoint
uses. HF does not model the MTP layer; its tensors are added here from an extra MLA layer.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SEED",
    "SPECIAL_TOKENS",
    "ADDED_TEXT_TOKENS",
    "DEFAULT_LAYER_PATTERN",
    "CHAT_TEMPLATE_PATH",
    "CORPUS",
    "build_tokenizer",
    "default_text_config",
    "default_vision_config",
    "build_config",
    "random_tensor",
    "make_tiny_checkpoint",
    "add_arguments",
    "run",
]

DEFAULT_SEED = 0

#: GLM special tokens in the relative order of the real vocabulary (appended after the BPE vocab).
#: On the real model: <|endoftext|>=154820, <|user|>=154827, <|observation|>=154829 (the three eos
#: ids), <|begin_of_image|>=154830 ... <|end_of_video|>=154833, <|image|>=154854, <|video|>=154855.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)

#: Added tokens that are *not* special (they stay in decoded text, like in GLM's tokenizer): the
#: reasoning and tool-call markers a chat frontend parses.
ADDED_TEXT_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)

KDA = "linear_attention"
MLA = "deepseek_sparse_attention"  # the real config.json's name; HF 5.23 maps it to its MLA layer
#: Attention kinds of the default 8 layers (cycled for other depths): two consecutive MLA layers
#: (2, 3) catch cache bookkeeping that assumes MLA layers are isolated.
DEFAULT_LAYER_PATTERN: tuple[str, ...] = (KDA, KDA, MLA, MLA, KDA, KDA, KDA, MLA)
DEFAULT_DENSE_LAYERS = 2

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

#: BPE merges learned on top of the 256 byte symbols (a few hundred, as the task asks).
_BPE_VOCAB_TARGET = 256 + 320

#: The tiny checkpoint's built-in text (written for this project, fixed, so everything built from
#: it is offline and deterministic): English plus multi-byte UTF-8 so the tokenizer learns merges
#: inside 2-, 3- and 4-byte characters (accents, CJK, emoji). The tokenizer is trained on it, and
#: ``glm5.trained_tiny_checkpoint`` trains the tiny model on it as one cyclic token stream.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the server streams tokens to every client.
A tiny model is enough to test the engine: the numbers are random, but the shapes are real.
Requests arrive, the scheduler batches them, and the sampler picks the next token for each one.
Please describe the image in one sentence. What happens in this video? Answer briefly.
The cache keeps one latent vector per token and one pooled index key per group of four tokens.
Linear attention layers carry a recurrent state; sparse attention layers read selected tokens.
Hello world! How are you today? I am fine, thank you. Let us write some code together.
def main(): print("hello") ; return 0  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096
Le café est très bon, et la crème brûlée aussi. Où est la bibliothèque ? Voilà, à bientôt !
Der Straßenbahnfahrer grüßt freundlich. Schöne Grüße aus München und Köln, bis später.
El niño come jamón y la señora bebe café. ¿Dónde está la estación? ¡Muy bien, gracias!
Ålesund ligger ved havet. Smørrebrød og blåbær er godt. Ça va? Naïve façade, coöperate.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо!
Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Καλημέρα και ευχαριστώ.
你好，世界！今天天气很好，我们一起去公园散步吧。这个模型很小，但是结构和真的一样。
日本語のテキストも少し入れます。東京は大きな都市です。ありがとうございます。
한국어 문장도 있습니다. 안녕하세요, 반갑습니다. 오늘 날씨가 좋네요.
مرحبا بالعالم. كيف حالك اليوم؟ शुभ प्रभात, आप कैसे हैं? สวัสดีครับ ขอบคุณมาก
Emoji make the byte-level paths honest: 🙂 😀 🚀 👍🏽 🎉 ❤️ 🐍 🦊 🌍 — four bytes each, sometimes more.
Mixed: naïve café 你好 🙂 résumé 東京 🚀 Straße — the detokenizer must never split a character.
"""


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------
def build_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821 - imported lazily
    """Train the tiny byte-level BPE tokenizer (deterministic: fixed corpus, single pass).

    Byte-level BPE like GLM's: every string is representable, and merges inside multi-byte
    characters make token boundaries fall mid-character, which is what streaming
    detokenization must survive. Special tokens are appended after the learned vocabulary in
    GLM's relative order, then the non-special added tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_TARGET,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # Repeat the corpus line by line so pair counts (and therefore merges) are stable.
    tok.train_from_iterator(CORPUS.splitlines() * 3, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TEXT_TOKENS])
    return tok


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def default_text_config(vocab_size: int, token_ids: dict[str, int]) -> dict[str, Any]:
    """The default tiny ``text_config`` (real config.json style: ``linear_attn_config`` dict, 0-based
    ``kda_layers``, ``deepseek_sparse_attention`` layer names, token ids of the tiny tokenizer)."""
    n_layers = len(DEFAULT_LAYER_PATTERN)
    return {
        "model_type": "glm5_next_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 0,
        "v_head_dim": 32,
        "mla_use_nope": True,
        "index_n_heads": 16,  # with few heads, ReLU-zero index scores tie often (the real model has 32)
        "index_head_dim": 32,
        "index_topk": 16,
        "index_kpool": 4,
        "index_kpool_compress": True,
        "index_kpool_always_select_tail": True,
        "index_share_for_mtp_iteration": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_router_dtype": "float32",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "layer_types": list(DEFAULT_LAYER_PATTERN),
        "mlp_layer_types": ["dense"] * DEFAULT_DENSE_LAYERS + ["sparse"] * (n_layers - DEFAULT_DENSE_LAYERS),
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
        },
        "mhc": True,
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 65536,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": [token_ids["<|endoftext|>"], token_ids["<|user|>"], token_ids["<|observation|>"]],
        "pad_token_id": token_ids["<|endoftext|>"],
        "bos_token_id": None,
    }


def default_vision_config(out_hidden_size: int) -> dict[str, Any]:
    """The default tiny ``vision_config``: two blocks, width 32, real patch geometry (14/2/2)."""
    return {
        "model_type": "glm5_next_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "image_size": 56,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": out_hidden_size,
        "projection_intermediate_size": 48,
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-5,
    }


_FLAT_LINEAR_KEYS = {
    "linear_num_heads": "num_heads",
    "linear_head_dim": "head_dim",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
    "linear_lower_bound": "gate_lower_bound",
}


def build_config(
    token_ids: dict[str, int],
    vocab_size: int,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    num_mtp_layers: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Compose the full ``config.json`` dict: defaults, then overrides, then derived lists.

    When an override changes ``num_hidden_layers`` without giving ``layer_types`` /
    ``mlp_layer_types``, those lists are regenerated for the new depth (the default attention
    pattern cycled, two dense layers first). ``linear_attn_config.kda_layers`` /
    ``full_attn_layers`` are derived from ``layer_types`` unless the override sets them itself
    (tests use that to build inconsistent configs). Flat ``linear_*`` overrides are moved into
    ``linear_attn_config`` because HF lets that dict win over the flat fields.
    """
    text = default_text_config(vocab_size, token_ids)
    over = copy.deepcopy(text_overrides or {})
    lac_over = over.pop("linear_attn_config", None) or {}
    for flat, nested in _FLAT_LINEAR_KEYS.items():
        if flat in over:
            lac_over.setdefault(nested, over.pop(flat))
    text.update(over)
    n = int(text["num_hidden_layers"])
    if "layer_types" not in over:
        text["layer_types"] = [DEFAULT_LAYER_PATTERN[i % len(DEFAULT_LAYER_PATTERN)] for i in range(n)]
    if "mlp_layer_types" not in over:
        dense = min(DEFAULT_DENSE_LAYERS, n)
        text["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (n - dense)
    mlp = text["mlp_layer_types"]
    text["first_k_dense_replace"] = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    lac = dict(text["linear_attn_config"])
    lac.update(lac_over)
    lac.setdefault("kda_layers", [i for i, t in enumerate(text["layer_types"]) if t == KDA])
    lac.setdefault("full_attn_layers", [i for i, t in enumerate(text["layer_types"]) if t != KDA])
    text["linear_attn_config"] = lac
    text["num_nextn_predict_layers"] = int(num_mtp_layers)
    text["dtype"] = _dtype_name(dtype)

    vision = default_vision_config(int(text["hidden_size"]))
    vision.update(copy.deepcopy(vision_overrides or {}))

    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": token_ids["<|image|>"],
        "video_token_id": token_ids["<|video|>"],
        "image_start_token_id": token_ids["<|begin_of_image|>"],
        "image_end_token_id": token_ids["<|end_of_image|>"],
        "video_start_token_id": token_ids["<|begin_of_video|>"],
        "video_end_token_id": token_ids["<|end_of_video|>"],
        "tie_word_embeddings": False,
        "dtype": _dtype_name(dtype),
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
_NORM_WEIGHT = re.compile(r"norm\d?\.weight$")
# Tensors the real checkpoint stores in fp32 whatever the model dtype (model-spec §7, §10).
_FP32_TENSORS = re.compile(
    r"(hc_(attn|ffn)_(fn|base|scale)|A_log|dt_bias|e_score_correction_bias|index_kpool_compress_ape)$"
)


def random_tensor(name: str, shape: tuple[int, ...] | torch.Size, seed: int) -> torch.Tensor:
    """The fp32 value of tensor ``name`` for ``seed`` (model-spec §11.1 scales, own generator).

    Norm weights ``1 + 0.1·N`` (stay near one, so normalised paths keep their scale), other 1-D
    tensors (biases, ``A_log``, ``dt_bias``, mHC base/scale, router bias) ``0.3·N`` (far enough
    from HF's 0/1 init to exercise decay, routing bias and mixing), anything with ≥2 dims
    (projections, experts, mHC ``fn``, kpool ``ape`` and gate, convs, embeddings) ``0.05·N``.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    noise = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    if len(shape) == 1 and _NORM_WEIGHT.search(name):
        return 1.0 + 0.1 * noise
    if len(shape) <= 1:
        return 0.3 * noise
    return 0.05 * noise


def _reference_key_shapes(config: dict[str, Any], num_mtp_layers: int) -> dict[str, tuple[int, ...]]:
    """Original-layout tensor names and shapes, as transformers' ``save_pretrained`` writes them.

    HF is asked for ``L + num_mtp_layers`` decoder layers whose extra layers are MLA + the last
    MLP kind; those extra layers' attention/MLP/norm tensors (without ``hc_*``) are the MTP
    layers' body, to which the MTP-only tensors (enorm, hnorm, eh_proj, shared_head.norm) are added.
    """
    from safetensors import safe_open
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging

    cfg = copy.deepcopy(config)
    text = cfg["text_config"]
    n = int(text["num_hidden_layers"])
    hidden = int(text["hidden_size"])
    text["num_hidden_layers"] = n + num_mtp_layers
    text["layer_types"] = list(text["layer_types"]) + [MLA] * num_mtp_layers
    text["mlp_layer_types"] = list(text["mlp_layer_types"]) + [text["mlp_layer_types"][-1]] * num_mtp_layers
    text.pop("linear_attn_config", None)  # its kda_layers would not cover the extra layers
    lac = config["text_config"]["linear_attn_config"]
    text["linear_num_heads"] = lac["num_heads"]
    text["linear_head_dim"] = lac["head_dim"]
    text["linear_conv_kernel_dim"] = lac["short_conv_kernel_size"]
    text["linear_lower_bound"] = lac.get("gate_lower_bound")
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    with tempfile.TemporaryDirectory() as tmp:
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a tqdm bar for a 4 MB temp file is noise in CLI/test output
        try:
            model.save_pretrained(tmp)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        shapes: dict[str, tuple[int, ...]] = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
    del model

    out: dict[str, tuple[int, ...]] = {}
    mtp_prefixes = tuple(f"model.language_model.layers.{i}." for i in range(n, n + num_mtp_layers))
    for k, shape in shapes.items():
        if k.startswith(mtp_prefixes) and re.search(r"\.hc_(attn|ffn)_", k):
            continue  # the MTP layer is a plain pre-norm block: no hyper-connections
        out[k] = shape
    for i in range(n, n + num_mtp_layers):
        p = f"model.language_model.layers.{i}."
        out[p + "enorm.weight"] = (hidden,)
        out[p + "hnorm.weight"] = (hidden,)
        out[p + "eh_proj.weight"] = (hidden, 2 * hidden)
        out[p + "shared_head.norm.weight"] = (hidden,)
    return out


# ---------------------------------------------------------------------------------------------
# processor files
# ---------------------------------------------------------------------------------------------
def _processor_files(vision: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Image/video processor configs with small token budgets (tests stay fast) and the real
    patch geometry taken from the vision config."""
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "resample": 3,
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "patch_expand_factor": 1,
        "processor_class": "Glm5NextProcessor",
    }
    image = {**common, "image_processor_type": "Glm5NextImageProcessor", "size": {"longest_edge": 1},
             "min_image_tokens": 4, "max_image_tokens": 64}
    video = {**common, "video_processor_type": "Glm5NextVideoProcessor", "size": {"longest_edge": 1},
             "min_image_tokens": 4, "max_image_tokens": 256, "fps": 2.0, "max_frames": 16,
             "do_sample_frames": True, "return_metadata": True}
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
            "processor_config.json": {"processor_class": "Glm5NextProcessor"}}


def _tokenizer_config(token_ids: dict[str, int]) -> dict[str, Any]:
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(token_ids[t])] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": True}
    for t in ADDED_TEXT_TOKENS:
        added[str(token_ids[t])] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": False}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "model_max_length": 65536,
        "padding_side": "left",
        "model_input_names": ["input_ids", "attention_mask"],
        "processor_class": "Glm5NextProcessor",
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def make_tiny_checkpoint(
    out_dir: str | Path,
    seed: int = DEFAULT_SEED,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    num_mtp_layers: int = 1,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny random GLM-5.3-Flash checkpoint to ``out_dir`` and return its path.

    Files: ``config.json`` (nested text/vision config, real-style keys), ``generation_config.json``,
    ``model.safetensors`` (original key layout incl. ``layers.{L}.*`` MTP tensors), ``tokenizer.json``,
    ``tokenizer_config.json``, ``chat_template.jinja``, ``special_tokens_map.json``, and the
    processor configs. The same arguments always produce byte-identical files.

    ``text_overrides`` / ``vision_overrides`` are merged into the default text / vision config
    (see :func:`build_config` for how dependent lists are regenerated). ``dtype`` is the storage
    dtype of the weights; mHC, ``A_log``, ``dt_bias``, router bias and kpool ape stay fp32 as in
    the real checkpoint.
    """
    from safetensors.torch import save_file

    if num_mtp_layers < 0:
        raise ValueError(f"num_mtp_layers = {num_mtp_layers}: must be >= 0 (the real model has 1)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    token_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TEXT_TOKENS}
    vocab_size = _round_up(tok.get_vocab_size(with_added_tokens=True), 64)
    config = build_config(token_ids, vocab_size, text_overrides, vision_overrides, num_mtp_layers, dtype)
    if int(config["text_config"]["vocab_size"]) < tok.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"text_overrides vocab_size = {config['text_config']['vocab_size']} is smaller than the "
                         f"tokenizer ({tok.get_vocab_size(with_added_tokens=True)} tokens); use at least {vocab_size}")

    shapes = _reference_key_shapes(config, num_mtp_layers)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        value = random_tensor(name, shapes[name], seed)
        tensors[name] = value if _FP32_TENSORS.search(name) else value.to(dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    _write_json(out / "config.json", config)
    text = config["text_config"]
    _write_json(out / "generation_config.json", {
        "_from_model_config": False,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "do_sample": False,
    })
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(token_ids))
    _write_json(out / "special_tokens_map.json", {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                                   "additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"), encoding="utf-8")
    for fname, obj in _processor_files(config["vision_config"]).items():
        _write_json(out / fname, obj)
    logger.info("tiny checkpoint written to %s (seed %d, %d tensors, vocab %d)", out, seed, len(tensors), vocab_size)
    return out


# Bump when the default checkpoint's contents change, so cached copies are rebuilt.
TINY_FORMAT_VERSION = 2
_VERSION_FILE = ".glm5_tiny_version"


def default_checkpoint_dir() -> Path:
    """Where ``glm5 serve`` / ``glm5 generate`` keep the default tiny checkpoint."""
    import os

    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "glm5" / "tiny-checkpoint"


def ensure_default_checkpoint(path: str | Path | None = None) -> Path:
    """The default tiny checkpoint at ``path`` (default :func:`default_checkpoint_dir`), written when
    missing or made by an older version of this module."""
    path = Path(path) if path is not None else default_checkpoint_dir()
    marker = path / _VERSION_FILE
    if (path / "config.json").is_file() and marker.is_file() and marker.read_text().strip() == str(TINY_FORMAT_VERSION):
        return path
    logger.info("writing the tiny random GLM-5.3-Flash checkpoint to %s", path)
    make_tiny_checkpoint(path)
    marker.write_text(f"{TINY_FORMAT_VERSION}\n")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write the checkpoint into (created if missing)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed (same seed = same bytes)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="storage dtype of the weights (fp32-only tensors stay fp32)")


def run(args: argparse.Namespace) -> int:
    path = make_tiny_checkpoint(args.out_dir, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(path)
    return 0
