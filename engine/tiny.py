"""Tiny random-weight Hugging Face checkpoints for tests and demos (``tollgate model create-tiny``).

A tiny checkpoint is a real checkpoint in every respect but its weights: ``config.json`` of a
``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``, ``model.safetensors`` with HF
parameter names, ``generation_config.json``, and a real byte-level BPE ``tokenizer.json`` trained with
the ``tokenizers`` library on a fixed list of Python standard-library sources plus a small built-in
chat corpus, with a ChatML chat template that supports system/user/assistant/tool messages and tool
definitions. ``transformers`` loads it with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Invariants:

- Deterministic: the same ``seed`` and the same Python standard library give byte-identical files.
  The tokenizer does not depend on the seed; the weights do.
- ``config.json``'s ``vocab_size`` equals the tokenizer's size (ordinary tokens, then special tokens).
- All archs share one tokenizer and one set of special tokens; only ``llama`` uses a BOS token
  (``<|begin_of_text|>``, added by the post-processor and by the chat template's ``bos_token``).
- The dense archs cover the decoder family's variants: ``llama`` has llama3-style ``rope_scaling`` and an
  untied ``lm_head``; ``qwen2`` has q/k/v biases and tied embeddings; ``qwen3`` has per-head q/k RMSNorm,
  an explicit ``head_dim`` (``heads * head_dim != hidden_size``) and tied embeddings.
- The mixtures of experts are written as their published checkpoints are (per-expert tensors, the hub's
  config keys): ``qwen3_moe`` (8 experts, top-2 renormalised, q/k RMSNorm), ``mixtral`` (4 experts, top-2,
  ``block_sparse_moe.experts.N.w1/w2/w3``), ``glm4_moe`` (a dense first layer, then 8 routed experts in 2
  groups with a sigmoid router, a correction bias and a scaling factor, a shared expert, q/k/v biases and
  partial RoPE), ``gpt_oss`` (layers alternating a 16-token sliding window and full attention, attention
  sinks, YaRN RoPE, biased attention, 4 experts with biases and the clamped SwiGLU, all experts of a layer
  in one tensor; with ``mxfp4=True`` the experts are stored in MXFP4, as the released checkpoints are).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")
# The mixtures of experts among them (``tollgate model create-tiny --family``).
MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Appended after the BPE vocabulary, in this order (so their ids are the last ones).
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN, BOS_TOKEN)
# Added but not special: they survive ``skip_special_tokens`` so tool calls stay visible in the text.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
BPE_VOCAB_SIZE = 3000
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Standard-library modules the tokenizer is trained on: stable, plain-text-heavy sources.
_CORPUS_MODULES = (
    "argparse.py", "textwrap.py", "string.py", "dataclasses.py", "functools.py", "contextlib.py",
    "enum.py", "typing.py", "random.py", "statistics.py", "fractions.py", "heapq.py", "bisect.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "pathlib.py", "shutil.py",
    "calendar.py", "difflib.py", "doctest.py", "email/message.py", "http/client.py",
)
_CHAT_CORPUS = """\
Hello! How can I help you today? I am a helpful assistant.
What is the weather like in Paris? It is sunny and warm, about 24 degrees Celsius.
Please write a short poem about the sea. The sea is wide, the sea is deep,
its waves will sing me off to sleep.
Call the function get_weather with the city name. The answer is 42. Thank you very much!
Bonjour, ça va ? Très bien, merci. Grüße aus München. ¿Dónde está la biblioteca?
Ünïcödé façade naïve café.
你好，世界。今天天气很好。日本語のテキストです。Привет, мир! Γειά σου κόσμε. 🙂 👍 🚀 ✓ → ∑ €100
"""

_CHAT_TEMPLATE = """\
{%- if bos_token is defined and bos_token %}{{- bos_token }}{%- endif %}
{%- set loop_messages = messages %}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = none %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if system_message %}{{- system_message + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions. '
        'Their signatures are inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object with its name and arguments inside '
        '<tool_call></tool_call> tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}'
        '\\n</tool_call><|im_end|>\\n' }}
{%- elif system_message %}
    {{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' or message['role'] == 'system' %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message['content'] %}{{- message['content'] }}{%- endif %}
        {%- if message['tool_calls'] is defined and message['tool_calls'] %}
            {%- for tool_call in message['tool_calls'] %}
                {%- if tool_call['function'] is defined %}
                    {%- set tool_call = tool_call['function'] %}
                {%- endif %}
                {%- if loop.first and not message['content'] %}{{- '<tool_call>\\n' }}
                {%- else %}{{- '\\n<tool_call>\\n' }}{%- endif %}
                {{- '{"name": "' + tool_call['name'] + '", "arguments": ' }}
                {%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}
                {%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Dimensions per arch: small enough that a forward takes milliseconds on a CPU.
_ARCH_DIMS: dict[str, dict] = {
    "llama": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, num_hidden_layers=2),
    "qwen2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, num_hidden_layers=2),
    # heads * head_dim = 128 != hidden_size = 64: exercises the explicit head_dim path.
    "qwen3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=192, num_hidden_layers=2),
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=192, num_hidden_layers=2),
    "mixtral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=64, num_hidden_layers=2),
    "glm4_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=128, num_hidden_layers=3),
    "gpt_oss": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=32, num_hidden_layers=2),
}
# gpt-oss's sliding window, scaled down (128 in the released models) so that test prompts exceed it.
GPT_OSS_WINDOW = 16
INITIALIZER_RANGE = 0.08


def corpus_files() -> list[Path]:
    """The standard-library sources the tokenizer is trained on (those present, in a fixed order)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in _CORPUS_MODULES if (stdlib / name).is_file()]
    if len(files) < len(_CORPUS_MODULES) // 2:
        raise RuntimeError(f"Python standard library sources not found under {stdlib}")
    return files


def train_tokenizer(llama_bos: bool = False) -> Tokenizer:
    """Train the byte-level BPE tokenizer (deterministic; ~1 s) and add the special tokens."""
    texts = [_CHAT_CORPUS] * 20 + [p.read_text(encoding="utf-8") for p in corpus_files()]
    tok = Tokenizer(models.BPE())
    # The Qwen2 / Llama 3 pipeline (NFC, split regex, byte level): transformers 5 rebuilds Qwen2
    # tokenizers with exactly this one, so ours must match it to give the same ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(ADDED_TOKENS))
    if llama_bos:
        bos_id = tok.token_to_id(BOS_TOKEN)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _model_config(arch: str, vocab_size: int, bos_id: int | None, eos_ids: list[int], pad_id: int) -> dict:
    dims = _ARCH_DIMS[arch]
    common = dict(
        **dims,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=bos_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=pad_id,
        torch_dtype="float32",
        use_cache=True,
        attention_dropout=0.0,
    )
    if arch == "llama":
        return dict(
            architectures=["LlamaForCausalLM"], model_type="llama", **common,
            rope_theta=500000.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
            # Like Llama 3.1 (factor 8 over 8192), scaled down so that every band of the llama3 rule
            # (unscaled, interpolated, scaled) holds some of the 16 frequencies of head_dim 32.
            rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=512),
        )
    if arch == "qwen3_moe":
        return dict(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **common,
            rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False, use_sliding_window=False,
            sliding_window=None, max_window_layers=dims["num_hidden_layers"], num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], router_aux_loss_coef=0.001,
        )
    if arch == "mixtral":
        return dict(
            architectures=["MixtralForCausalLM"], model_type="mixtral", **common,
            rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None, num_local_experts=4,
            num_experts_per_tok=2, router_aux_loss_coef=0.001,
        )
    if arch == "gpt_oss":
        layers = dims["num_hidden_layers"]
        return dict(
            architectures=["GptOssForCausalLM"], model_type="gpt_oss", **common,
            attention_bias=True, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=GPT_OSS_WINDOW, swiglu_limit=7.0, router_aux_loss_coef=0.9,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            # The released YaRN (factor 32 over 4096) scaled down, so that every band of the ramp is used.
            rope_theta=150000.0,
            rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                              original_max_position_embeddings=256),
        )
    if arch == "glm4_moe":
        return dict(
            architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", **common,
            rope_theta=1000000.0, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
            tie_word_embeddings=False, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        )
    if arch == "qwen2":
        return dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2", **common,
            rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
            sliding_window=None, max_window_layers=dims["num_hidden_layers"],
        )
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", **common,
        rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=None, max_window_layers=dims["num_hidden_layers"],
    )


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 weights: linears ~ N(0, initializer_range), norm weights ~ 1 + N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    model_type = config["model_type"]
    qkv_bias = model_type in ("qwen2", "gpt_oss") or config.get("attention_bias", False)
    qk_norm = model_type in ("qwen3", "qwen3_moe")

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = normal(q_dim)
            w[p + "self_attn.k_proj.bias"] = normal(kv_dim)
            w[p + "self_attn.v_proj.bias"] = normal(kv_dim)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim)
        if model_type == "gpt_oss":
            w[p + "self_attn.o_proj.bias"] = normal(hidden)
            w[p + "self_attn.sinks"] = 1.0 + torch.randn(config["num_attention_heads"], generator=g)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if model_type in MOE_FAMILIES and i >= config.get("first_k_dense_replace", 0):
            w.update(_experts(config, p, normal))
            continue
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return {k: v.contiguous() for k, v in w.items()}


def _experts(config: dict, prefix: str, normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sparse layer's router and experts, named as the family's published checkpoints name them."""
    hidden = config["hidden_size"]
    if config["model_type"] == "gpt_oss":  # all experts of a layer in one tensor, gate and up interleaved
        experts, inter = config["num_local_experts"], config["intermediate_size"]
        q = prefix + "mlp."
        return {q + "router.weight": normal(experts, hidden), q + "router.bias": normal(experts),
                q + "experts.gate_up_proj": normal(experts, hidden, 2 * inter),
                q + "experts.gate_up_proj_bias": normal(experts, 2 * inter),
                q + "experts.down_proj": normal(experts, inter, hidden),
                q + "experts.down_proj_bias": normal(experts, hidden)}
    if config["model_type"] == "mixtral":
        experts, inter = config["num_local_experts"], config["intermediate_size"]
        w = {prefix + "block_sparse_moe.gate.weight": normal(experts, hidden)}
        for e in range(experts):
            q = f"{prefix}block_sparse_moe.experts.{e}."
            w |= {q + "w1.weight": normal(inter, hidden), q + "w3.weight": normal(inter, hidden),
                  q + "w2.weight": normal(hidden, inter)}
        return w
    experts = config.get("num_experts") or config["n_routed_experts"]
    inter = config["moe_intermediate_size"]
    w = {prefix + "mlp.gate.weight": normal(experts, hidden)}
    for e in range(experts):
        q = f"{prefix}mlp.experts.{e}."
        w |= {q + "gate_proj.weight": normal(inter, hidden), q + "up_proj.weight": normal(inter, hidden),
              q + "down_proj.weight": normal(hidden, inter)}
    if config["model_type"] == "glm4_moe":
        shared = inter * config["n_shared_experts"]
        w[prefix + "mlp.gate.e_score_correction_bias"] = normal(experts)
        q = prefix + "mlp.shared_experts."
        w |= {q + "gate_proj.weight": normal(shared, hidden), q + "up_proj.weight": normal(shared, hidden),
              q + "down_proj.weight": normal(hidden, shared)}
    return w


def mxfp4_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's expert tensors as the released checkpoints store them: MXFP4 ``_blocks`` and ``_scales``
    of each projection with its output features as rows (``[E, 2I, H / 32, 16]``, ``[E, H, I / 32,
    16]``), biases unchanged."""
    from engine.models.mxfp4 import quantize_mxfp4

    out = {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            out[name] = tensor
    return out


def create_tiny_checkpoint(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, mxfp4: bool = False
) -> Path:
    """Write a tiny random-weight checkpoint of ``arch`` into ``out_dir`` (created if needed); ``mxfp4``:
    gpt-oss's experts in MXFP4, with the ``quantization_config`` the released checkpoints carry."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if mxfp4 and arch != "gpt_oss":
        raise ValueError("mxfp4 experts exist for gpt_oss only")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    llama_bos = arch == "llama"
    tok = train_tokenizer(llama_bos=llama_bos)
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"the trained tokenizer lacks the special token {t!r}")
        ids[t] = token_id
    eos_ids = [ids[EOS_TOKEN], ids[PAD_TOKEN]]
    bos_id = ids[BOS_TOKEN] if llama_bos else None

    config = _model_config(arch, tok.get_vocab_size(with_added_tokens=True), bos_id, eos_ids, ids[PAD_TOKEN])
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": ids[PAD_TOKEN], "do_sample": False,
    })
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN if llama_bos else None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": llama_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _CHAT_TEMPLATE,
    })
    _write_json(out / "special_tokens_map.json", {
        **({"bos_token": BOS_TOKEN} if llama_bos else {}),
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": ["<|im_start|>", EOS_TOKEN],
    })
    weights = random_weights(config, seed)
    save_file(mxfp4_experts(weights) if mxfp4 else weights, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
