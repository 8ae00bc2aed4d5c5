"""DeepSpeed's ``deepspeed.runtime.zero.tiling``: a ``Linear`` split into tiles of smaller ``Linear``s.

:class:`TiledLinear` computes ``y = x @ W.T + b`` for an ``out_features x in_features`` weight held as an
``out_splits x in_splits`` grid of sub-layers (``linears[o][i]``, rows ``out_parts[o]:out_parts[o+1]`` and
columns ``in_parts[i]:in_parts[i+1]`` of ``W``). Under ZeRO-3 each tile is a module of its own, so
only one tile's weight needs to be gathered at a time: a layer too large to gather whole can still
run. Only the last tile of each row has a bias, so the sum over a row adds it once.
:class:`TiledLinearReturnBias` wraps layers that return ``(output, bias)`` (Megatron-LM's style).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zeroshard.zero.gathered import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "partition_uniform", "split_tensor_along_last_dim"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` of ``num_parts`` contiguous parts as equal as can be, the first
    ones one larger when it does not divide (empty parts at the end when ``num_parts > num_items``)."""
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: Sequence[int] | int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch.split`` along the last dimension (sizes ``partitions``), chunks made contiguous on request."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)  # type: ignore[arg-type]
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else tuple(chunks)


class TiledLinear(torch.nn.Module):
    """A drop-in ``torch.nn.Linear`` computed tile by tile (DeepSpeed's signature).

    Args:
        in_features, out_features, bias: as ``torch.nn.Linear``.
        in_splits: tiles along the input dimension, ``1 <= in_splits <= in_features``.
        out_splits: tiles along the output dimension, ``1 <= out_splits <= out_features``.
        input_is_already_split: ``forward`` receives a sequence of ``in_splits`` input chunks.
        combine_out_splits: concatenate the ``out_splits`` outputs (else ``forward`` returns the list).
        linear_cls: the class of each tile (built as ``linear_cls(in, out, bias=..., **kwargs)``).
        init_linear: a ``Linear`` whose weight and bias are copied into the tiles.

    Raises:
        RuntimeError: a split count out of range (DeepSpeed's error type).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: Any = torch.nn.Linear, init_linear: torch.nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"in_splits must be in [1, in_features={in_features}], got {in_splits}")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"out_splits must be in [1, out_features={out_features}], got {out_splits}")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        #: tile boundaries: tile ``i`` covers ``[in_parts[i], in_parts[i + 1])`` (likewise ``out_parts``)
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            rows = self.out_parts[o + 1] - self.out_parts[o]
            self.linears.append(torch.nn.ModuleList(
                linear_cls(self.in_parts[i + 1] - self.in_parts[i], rows, bias=bias and i == in_splits - 1, **kwargs)
                for i in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"expected {self.in_splits} input chunks, got {len(inputs)}")
        else:
            parts = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = list(self._split_global_input(input_, [b - a for a, b in zip(parts, parts[1:])]))
        outputs: list[Any] = []
        for o in range(self.out_splits):
            out = None
            for i in range(self.in_splits):
                out = self._reduce_local_output(in_id=i, out_id=o, current_out=out,
                                                new_out=self._tile(o, i)(inputs[i]))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _tile(self, out_id: int, in_id: int) -> torch.nn.Module:
        row = self.linears[out_id]
        assert isinstance(row, torch.nn.ModuleList)
        return row[in_id]

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Sequence[Any]:
        """The input's chunks along the last dimension (override for other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Sum of a row's tile outputs so far (the first one copied, so autograd never sees an in-place add
        on a view)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The rows' outputs, concatenated along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy the weight and bias of the ``Linear`` ``other`` into the tiles (collective under ZeRO-3:
        rank 0's values end up everywhere, as ``GatheredParameters(modifier_rank=0)``)."""
        weight: torch.Tensor = other.weight  # type: ignore[assignment]
        other_bias: torch.Tensor | None = getattr(other, "bias", None)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)}, expected {(self.out_features, self.in_features)}")
        if self.use_bias != (other_bias is not None):
            raise ValueError(f"bias={self.use_bias} here, but the layer copied from has "
                             f"{'a' if other_bias is not None else 'no'} bias")
        for o in range(self.out_splits):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i in range(self.in_splits):
                tile: Any = self._tile(o, i)
                c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, c0:c1])
                if getattr(tile, "bias", None) is not None and other_bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other_bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """:class:`TiledLinear` over tiles that return ``(output, bias)``: outputs are summed over a row
    and concatenated, biases (where tiles return one) concatenated, ``None`` when no tile returns one."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TypeError(f"TiledLinearReturnBias: a tile returned {type(new_out).__name__}, expected "
                            "(output, bias)")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, old_bias if bias is None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([t for t, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
