"""Activation memory of a decoder-only transformer, per micro batch, from its dimensions.

What is counted is what autograd keeps for backward (the tensors ops save), per token, plus the
logits and the fp32 log-probabilities of the loss, which are alive together at the end of the
forward. Per layer, in bytes, with ``c`` the compute dtype's size, ``h`` the hidden size, ``I``
the MLP width, ``q = heads·head_dim`` and ``kv = kv_heads·head_dim``:

- two norms, each keeping its input (``c·h``; LayerNorm also its mean and rstd, Hugging Face's
  Python RMSNorm also an fp32 copy, ``4·h``) and its output (``c·h``, the next matmul's input);
- attention: q, k, v (``c·(q + 2·kv)``), the attention output (``c·q``, which is also the output
  projection's input: flash/SDPA kernels return it in token-major layout) and the log-sum-exp
  (``4·heads``); ``eager`` attention also keeps the softmax (``heads·s`` per token, fp32 plus a
  16-bit copy);
- MLP: ``2·c·I`` (fc output, activation output) or ``4·c·I`` for a gated MLP (gate, activation,
  up, product), plus ``3·c·I`` for an activation function written in Python (GPT-2's ``gelu_new``);
- dropout in training: a one-byte mask of ``h`` per residual branch.

Checked on CPU against ``examples/gpt.py`` (``tests/unit/test_estimate.py``): within 1.3% of the
peak RSS growth of a forward in fp32 and bf16 (0.1% for the forward part of the checkpointed
estimate, with a checkpoint per block), and within 0.1% of the bytes autograd saves plus
the logits in fp32 (in bf16 the saved bytes miss the transient fp32 copy of the logits that
``cross_entropy`` makes, which this estimate counts as it is alive at the peak).

With activation checkpointing (one checkpoint per layer, as Hugging Face's
``gradient_checkpointing_enable()``), only each layer's input is kept, and one layer's activations
are recomputed at a time in backward: ``L·c·h + one layer``. Temporaries inside an op (attention
workspaces, activation gradients in backward) are not counted; the planner's headroom covers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.estimate.model_spec import TransformerShape

__all__ = ["ActivationEstimate", "estimate_activations"]

_INT64 = 8


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one micro batch on one rank.

    Attributes:
        tokens: micro batch × sequence length.
        per_layer: one transformer layer's saved tensors.
        num_layers: layers.
        layer_input: one layer's input (what a checkpointed layer keeps).
        head: token ids, final norm, logits and the loss's log-probabilities.
    """

    tokens: int
    per_layer: int
    num_layers: int
    layer_input: int
    head: int

    @property
    def total(self) -> int:
        """Without activation checkpointing: every layer's saved tensors plus the head."""
        return self.num_layers * self.per_layer + self.head

    @property
    def checkpointed(self) -> int:
        """With one checkpoint per layer: every layer's input, one layer recomputed, the head."""
        return self.num_layers * self.layer_input + self.per_layer + self.head


def _norm_bytes(shape: TransformerShape, c: int) -> int:
    """Per token: what one norm keeps of its input (its output is counted where it is used)."""
    h = shape.hidden_size
    return c * h + (4 * h + 4 if shape.norm == "rmsnorm" else 8)


def per_token_layer_bytes(shape: TransformerShape, dtype_bytes: int, seq_len: int, attention: str = "sdpa") -> int:
    """Bytes one layer keeps per token (see the module docstring)."""
    c, h = dtype_bytes, shape.hidden_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    norms = 2 * (_norm_bytes(shape, c) + c * h)
    attn = c * (q + 2 * kv) + c * q + 4 * shape.num_heads
    if attention == "eager":
        attn += shape.num_heads * seq_len * (4 + (c if c != 4 else 0))
    mlp = (shape.activation_saves + (3 if shape.gated_mlp else 1)) * c * shape.intermediate_size
    mlp *= shape.experts_per_token
    dropout = 2 * h if shape.dropout else 0
    return norms + attn + mlp + dropout


def estimate_activations(shape: TransformerShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                         attention: str = "sdpa") -> ActivationEstimate:
    """Activation memory of one forward of ``micro_batch`` sequences of ``seq_len`` tokens.

    Args:
        shape: the transformer's dimensions.
        micro_batch: sequences per micro batch on one rank.
        seq_len: tokens per sequence.
        dtype_bytes: bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).
        attention: ``"sdpa"`` (flash / memory-efficient kernels: no ``s²`` term) or ``"eager"``.
    """
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    tokens = micro_batch * seq_len
    c, h, v = dtype_bytes, shape.hidden_size, shape.vocab_size
    # ids and targets; final norm (input and output); logits, plus the loss's fp32 log-probs
    # (and, in 16 bits, the fp32 copy of the logits they are computed from).
    head_per_token = 2 * _INT64 + _norm_bytes(shape, c) + c * h + c * v + 4 * v + (4 * v if c < 4 else 0)
    if shape.dropout:
        head_per_token += h
    return ActivationEstimate(tokens=tokens, per_layer=tokens * per_token_layer_bytes(shape, c, seq_len, attention),
                              num_layers=shape.num_layers, layer_input=tokens * c * h, head=tokens * head_per_token)
