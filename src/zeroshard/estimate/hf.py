"""Models from Hugging Face configs (``config.json``), built on the meta device.

With ``transformers`` installed, any architecture it knows is built by
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``. Without it, a built-in table
builds the common decoder-only families with the same module tree and parameter shapes as
``transformers`` (so the same counts, largest layer and ZeRO-3 units): ``gpt2``, ``gpt_neox``,
``llama``, ``mistral``, ``qwen2``, ``qwen3`` and ``gemma``. Either way the transformer's
dimensions are read from the config for the activation estimate.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.estimate.model_spec import ModelSpec, TransformerShape, spec_from_module

__all__ = ["BUILTIN_FAMILIES", "load_hf_config", "spec_from_hf_config", "transformer_shape"]

_KEY = "MODEL"


def load_hf_config(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a dict, and where it came from.

    Args:
        source: a dict, JSON text (starting with ``{``), a ``config.json`` path, or a directory
            holding one.
    """
    if isinstance(source, dict):
        return dict(source), "a config dict"
    text = str(source)
    if text.lstrip().startswith("{"):
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"invalid JSON: {e}", key=_KEY) from e
        where = "JSON"
    else:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} does not exist (give a config.json, a directory with one, JSON text, "
                              "or pkg.module:function)", key=_KEY)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path} as JSON: {e}", key=_KEY) from e
        where = str(path)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: a Hugging Face config is a JSON object, got {type(cfg).__name__}", key=_KEY)
    return cfg, where


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _positive(cfg: dict[str, Any], where: str, *names: str, default: Any = None) -> int:
    value = _first(cfg, *names, default=default)
    if value is None:
        raise ConfigError(f"{where}: missing {names[0]!r} (a {cfg.get('model_type', 'transformer')} config needs it)",
                          key=_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: {names[0]!r} must be a positive integer, got {value!r}", key=_KEY)
    return value


#: activation functions Hugging Face writes in Python, and the tensors of the MLP's width they keep
_PYTHON_ACTIVATIONS = {"gelu_new": 4, "gelu_fast": 4, "quick_gelu": 2}


def _activation_saves(cfg: dict[str, Any], default: str) -> int:
    return _PYTHON_ACTIVATIONS.get(str(_first(cfg, "activation_function", "hidden_act", default=default)), 1)


def _dropout(cfg: dict[str, Any], *names: str) -> bool:
    return any(float(cfg.get(n) or 0.0) > 0 for n in names)


_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma")


def transformer_shape(cfg: dict[str, Any], where: str = "config") -> TransformerShape:
    """The dimensions of the transformer ``cfg`` describes (known families, or generic key names)."""
    family = str(cfg.get("model_type", ""))
    if family == "gpt2":
        h = _positive(cfg, where, "n_embd")
        heads = _positive(cfg, where, "n_head")
        return TransformerShape(
            hidden_size=h, num_layers=_positive(cfg, where, "n_layer"), num_heads=heads, num_kv_heads=heads,
            head_dim=h // heads, intermediate_size=_positive(cfg, where, "n_inner", default=4 * h),
            vocab_size=_positive(cfg, where, "vocab_size"), max_positions=_first(cfg, "n_positions"),
            dropout=_dropout(cfg, "resid_pdrop", "embd_pdrop"), activation_saves=_activation_saves(cfg, "gelu_new"),
            family=family)
    h = _positive(cfg, where, "hidden_size", "n_embd", "d_model")
    heads = _positive(cfg, where, "num_attention_heads", "n_head", "num_heads")
    gated = family in _LLAMA_LIKE or (family != "gpt_neox" and str(cfg.get("hidden_act", "")) in ("silu", "swiglu"))
    experts = _positive(cfg, where, "num_experts_per_tok", "moe_topk", default=1)
    return TransformerShape(
        exact=family in BUILTIN_FAMILIES, experts_per_token=experts, activation_saves=_activation_saves(cfg, "gelu"),
        hidden_size=h, num_layers=_positive(cfg, where, "num_hidden_layers", "n_layer", "num_layers"),
        num_heads=heads, num_kv_heads=_positive(cfg, where, "num_key_value_heads", default=heads),
        head_dim=_positive(cfg, where, "head_dim", default=h // heads),
        intermediate_size=_positive(cfg, where, "moe_intermediate_size" if experts > 1 else "intermediate_size",
                                    "intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * h),
        vocab_size=_positive(cfg, where, "vocab_size"),
        max_positions=_first(cfg, "max_position_embeddings", "n_positions"),
        gated_mlp=gated, norm="layernorm" if family == "gpt_neox" or not gated else "rmsnorm",
        dropout=_dropout(cfg, "hidden_dropout", "resid_pdrop", "hidden_dropout_prob"), family=family or "transformer")


# ---------------------------------------------------------------- built-in families (no transformers)


class _Norm(nn.Module):
    def __init__(self, n: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None


class _Conv1D(nn.Module):
    """GPT-2's transposed linear layer: weight ``(in, out)``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))


def _module(**children: nn.Module | None) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        if child is not None:
            m.add_module(name, child)
    return m


def _with_head(cfg: dict[str, Any], s: TransformerShape, body: str, children: dict[str, nn.Module], head: str,
               embedding: str, tie_default: bool) -> nn.Module:
    """``body`` (embeddings, layers, final norm) then the LM head, tied to ``body.embedding`` when
    ``tie_word_embeddings`` (default ``tie_default``) says so."""
    model = _module(**{body: _module(**children), head: nn.Linear(s.hidden_size, s.vocab_size, bias=False)})
    if cfg.get("tie_word_embeddings", tie_default):
        model.get_submodule(head).weight = model.get_submodule(f"{body}.{embedding}").weight
    return model


def _gpt2(cfg: dict[str, Any], s: TransformerShape) -> nn.Module:
    h, inner = s.hidden_size, s.intermediate_size

    def block() -> nn.Module:
        return _module(ln_1=_Norm(h, True), attn=_module(c_attn=_Conv1D(h, 3 * h), c_proj=_Conv1D(h, h)),
                       ln_2=_Norm(h, True), mlp=_module(c_fc=_Conv1D(h, inner), c_proj=_Conv1D(inner, h)))

    return _with_head(cfg, s, "transformer", {
        "wte": nn.Embedding(s.vocab_size, h), "wpe": nn.Embedding(int(cfg.get("n_positions", 1024)), h),
        "h": nn.ModuleList(block() for _ in range(s.num_layers)), "ln_f": _Norm(h, True),
    }, "lm_head", "wte", tie_default=True)


def _gpt_neox(cfg: dict[str, Any], s: TransformerShape) -> nn.Module:
    h, inner = s.hidden_size, s.intermediate_size
    bias = bool(cfg.get("attention_bias", True))

    def layer() -> nn.Module:
        return _module(input_layernorm=_Norm(h, True), post_attention_layernorm=_Norm(h, True),
                       attention=_module(query_key_value=nn.Linear(h, 3 * h, bias=bias),
                                         dense=nn.Linear(h, h, bias=bias)),
                       mlp=_module(dense_h_to_4h=nn.Linear(h, inner), dense_4h_to_h=nn.Linear(inner, h)))

    return _with_head(cfg, s, "gpt_neox", {
        "embed_in": nn.Embedding(s.vocab_size, h), "layers": nn.ModuleList(layer() for _ in range(s.num_layers)),
        "final_layer_norm": _Norm(h, True),
    }, "embed_out", "embed_in", tie_default=False)


def _llama_like(cfg: dict[str, Any], s: TransformerShape) -> nn.Module:
    h, inner, family = s.hidden_size, s.intermediate_size, s.family
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    qkv_bias = family == "qwen2" or bool(cfg.get("attention_bias", False))
    o_bias = family != "qwen2" and bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    qk_norm = family == "qwen3"

    def layer() -> nn.Module:
        attn = _module(q_proj=nn.Linear(h, q_out, bias=qkv_bias), k_proj=nn.Linear(h, kv_out, bias=qkv_bias),
                       v_proj=nn.Linear(h, kv_out, bias=qkv_bias), o_proj=nn.Linear(q_out, h, bias=o_bias),
                       q_norm=_Norm(s.head_dim, False) if qk_norm else None,
                       k_norm=_Norm(s.head_dim, False) if qk_norm else None)
        mlp = _module(gate_proj=nn.Linear(h, inner, bias=mlp_bias), up_proj=nn.Linear(h, inner, bias=mlp_bias),
                      down_proj=nn.Linear(inner, h, bias=mlp_bias))
        return _module(self_attn=attn, mlp=mlp, input_layernorm=_Norm(h, False),
                       post_attention_layernorm=_Norm(h, False))

    return _with_head(cfg, s, "model", {
        "embed_tokens": nn.Embedding(s.vocab_size, h), "layers": nn.ModuleList(layer() for _ in range(s.num_layers)),
        "norm": _Norm(h, False),
    }, "lm_head", "embed_tokens", tie_default=family == "gemma")


#: transformers' defaults of the keys the built-in families read, for configs that leave them out
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
             "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
    "gpt_neox": {"max_position_embeddings": 2048},
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
    "gemma": {"max_position_embeddings": 8192},
}

#: model_type -> builder of the meta-device module tree (used when transformers is not installed)
BUILTIN_FAMILIES: dict[str, Callable[[dict[str, Any], TransformerShape], nn.Module]] = {
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, **{name: _llama_like for name in _LLAMA_LIKE},
}


def _short(e: Exception, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _build_with_transformers(cfg: dict[str, Any], where: str) -> tuple[nn.Module, bool, dict[str, Any]]:
    """The model, whether it is a decoder-only causal LM (whose activations we can estimate), and
    the config with transformers' defaults filled in."""
    import transformers

    model_type = cfg.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(**cfg)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{where}: unknown model_type {model_type!r}: transformers {transformers.__version__} "
                          "does not know it", key=_KEY) from e
    errors: list[str] = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(config)
        except Exception as e:  # transformers raises ValueError, KeyError, TypeError... per architecture
            errors.append(f"{auto.__name__}: {_short(e)}")
            continue
        decoder = auto is transformers.AutoModelForCausalLM and not getattr(config, "is_encoder_decoder", False)
        return model, decoder, config.to_dict()
    raise ConfigError(f"{where}: cannot build model_type {model_type!r}: {'; '.join(errors)}", key=_KEY)


def _transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def spec_from_hf_config(source: str | Path | dict[str, Any], use_transformers: bool | None = None) -> ModelSpec:
    """Build the model a Hugging Face config describes on the meta device and describe it.

    Args:
        source: see :func:`load_hf_config`.
        use_transformers: build with ``transformers`` (default: when it is installed) or with the
            built-in table of families.

    Raises:
        ConfigError: unreadable config, no ``model_type``, or a ``model_type`` that neither
            ``transformers`` (when installed) nor the built-in table knows.
    """
    cfg, where = load_hf_config(source)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{where}: no 'model_type' (is this a Hugging Face config.json?)", key=_KEY)
    if use_transformers is None:
        use_transformers = _transformers_available()
    if use_transformers:
        model, decoder, full = _build_with_transformers(cfg, where)
        shape: TransformerShape | None = None
        if decoder:
            try:
                shape = transformer_shape(full, where)
            except ConfigError:
                pass  # built fine, but its dimensions are not under the usual key names
    else:
        if model_type not in BUILTIN_FAMILIES:
            known = ", ".join(sorted(BUILTIN_FAMILIES))
            raise ConfigError(f"{where}: unknown model_type {model_type!r}: without transformers installed, "
                              f"zeroshard builds {known}; install transformers for any other architecture, or "
                              "pass --params", key=_KEY)
        cfg = {**FAMILY_DEFAULTS.get(model_type, {}), **cfg}
        shape = transformer_shape(cfg, where)
        try:
            with torch.device("meta"):
                model = BUILTIN_FAMILIES[model_type](cfg, shape)
        except (TypeError, ValueError, RuntimeError) as e:  # a value of the wrong type or sign in the config
            raise ConfigError(f"{where}: cannot build model_type {model_type!r}: {_short(e)}", key=_KEY) from e
    return spec_from_module(model, f"{model_type} from {where}", shape)
