"""Sibling projections of one input (q/k/v, gate/up) as one oneDNN int8 matmul.

Why: in a decode step of a few dozen tokens each Int8DynamicLinear call is mostly fixed costs (the
activation quantizer, oneDNN's primitive dispatch, the per-token scale), not multiply-adds, so one
call of the stacked weight costs well under the sum of its siblings' calls. The HF attention and MLP
forwards call the siblings one by one on the same tensor, so each sibling module is swapped for an
Int8SiblingLinear sharing one SiblingGroup: the first call runs the stacked matmul and keeps its
output, the others (called on the same tensor object) take their columns from it. A call on another
tensor, or the same sibling twice, runs the stacked matmul again. (Identity is the whole check: the
engine's tensors are inference tensors, which carry no version counter; HF's forwards never write
into the hidden states between the siblings' calls.) The forward stays the HF model's; only the
modules change.

The stacked weight is what the siblings' weights were (rows concatenated), quantized per output
row as before, and the siblings' shared input gets one set of outlier channels
(engine/quant/outliers.py). Its activations are symmetric per token (the recipe's asymmetric
layers, engine/quant/recipe.py, are not siblings).

Each sibling's output is its columns of the stacked output. q/k/v get a contiguous copy (the
rotary kernel and attention read them token-major); gate/up get views with no copy (VIEW_SIBLINGS):
their only reader is the MLP's SiLU(gate) * up, whose fused kernel (engine/kernels/fused.py) reads
row-strided rows, and the eager ops take any view.
"""

from __future__ import annotations

import torch

from batchgen.engine.quant.int8 import Int8DynamicLinear

# child names that a Llama-style decoder layer calls on one input tensor, in its call order
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# sibling sets whose outputs are returned as views of the stacked output (see the module docstring)
VIEW_SIBLINGS: tuple[tuple[str, ...], ...] = (("gate_proj", "up_proj"),)


class SiblingGroup(torch.nn.Module):
    """One Int8DynamicLinear over the siblings' stacked weights, and the last output it gave."""

    def __init__(self, linears: list[torch.nn.Linear], outliers: torch.Tensor | None = None, views: bool = False):
        """`views`: each sibling's output is a view of the stacked output, else a contiguous copy."""
        super().__init__()
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("siblings with and without a bias are not stacked")
        stacked = torch.nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears),
                                  bias=biases[0] is not None, device="meta")
        stacked.weight = torch.nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
        if biases[0] is not None:
            stacked.bias = torch.nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
        self.linear = Int8DynamicLinear(stacked, outliers)
        self.views = views
        ends = torch.tensor([lin.out_features for lin in linears]).cumsum(0).tolist()
        self.columns = [slice(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]
        self._input: torch.Tensor | None = None  # the tensor the kept output was computed from
        self._output: torch.Tensor | None = None
        self._taken: set[int] = set()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Sibling `index`'s output for `x`: its columns of the stacked output (a view when self.views)."""
        if self._input is not x or index in self._taken:
            self._output = self.linear(x)
            self._input, self._taken = x, set()
        self._taken.add(index)
        out = self._output[..., self.columns[index]]
        if not self.views:
            out = out.contiguous()
        if len(self._taken) == len(self.columns):  # every sibling served: drop the references
            self._input = self._output = None
        return out


class Int8SiblingLinear(torch.nn.Module):
    """One sibling's `nn.Linear`: its columns of its group's stacked int8 matmul."""

    def __init__(self, group: SiblingGroup, index: int):
        super().__init__()
        self.group = group
        self.index = index
        self.in_features = group.linear.in_features
        self.out_features = group.columns[index].stop - group.columns[index].start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: this sibling's rows of the stacked weight (for tests and references)."""
        return self.group.linear.dequantized_weight()[self.group.columns[self.index]]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows {self.group.columns[self.index].start}.. of a stacked int8 x int8 (oneDNN) matmul")


def sibling_sets(names: set[str]) -> list[tuple[str, list[str]]]:
    """(parent name, [child names]) for every complete SIBLINGS set among the linear layers `names`."""
    out = []
    parents = sorted({name.rpartition(".")[0] for name in names})
    for parent in parents:
        for children in SIBLINGS:
            if all(f"{parent}.{c}" in names for c in children):
                out.append((parent, list(children)))
    return out


def stack(parent: torch.nn.Module, children: list[str], outliers: torch.Tensor | None = None) -> None:
    """Swap `parent`'s `children` (nn.Linear, one input) for Int8SiblingLinear modules of one group."""
    group = SiblingGroup([getattr(parent, c) for c in children], outliers, views=tuple(children) in VIEW_SIBLINGS)
    for i, child in enumerate(children):
        setattr(parent, child, Int8SiblingLinear(group, i))
