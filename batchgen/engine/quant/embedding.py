"""int8 embedding and LM head, sharing one int8 matrix when the two are tied.

In a small model the vocabulary matrix is a large share of the weights (SmolLM2-135M: 49152 x 576,
21% of its bf16 bytes), so an int4 decoder with a bf16 embedding stays at ~0.43x bf16. Neither
backend quantizes it the way a tied pair needs: quanto quantizes no `nn.Embedding`, and torchao's
untie-and-quantize path keeps two copies (one per module), which for an int8 head is as many bytes
as the one bf16 matrix it replaces. So this is our own small swap, the same for both backends:

    qweight [vocab, hidden] int8     symmetric, one scale per row (a vocabulary entry)
    scale   [vocab]         model dtype

Per row is what both uses want: the embedding looks rows up (`qweight[ids] * scale[ids]`), and
for the LM head a row is an output channel, the layout of aten's int8-weight GEMM
(`torch._weight_int8pack_mm(x, qweight, scale)`, the CPU kernel quanto's int8 weights also run on;
used for a few rows only, see INT8_GEMV_MAX_ROWS).
The head is applied by HF's forward after it has cut the hidden states to `logits_to_keep`, so the
engine's packed forward is unchanged. A tied pair keeps one `qweight`/`scale` for both modules; an
untied model quantizes each matrix on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EMBEDDING_SCHEMES = ("auto", "none", "int8")
# rows quantized (or, in the LM head, dequantized) at a time: bounds the float working copy
# (4096 x 576 x 4 B = 9 MB for SmolLM2)
_ROWS_PER_CHUNK = 4096
# aten's `_weight_int8pack_mm` on CPU runs row by row (a GEMV per input row): it beats the bf16
# matmul on a row or a few, and loses to it once the rows are a batch's; above this many rows the
# head multiplies by int8 slices
# converted to the model dtype, 4096 vocabulary rows at a time, and scales the outputs instead
INT8_GEMV_MAX_ROWS = 16


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (qweight [rows, cols] int8, scale [rows] in `dtype`).

    The scale is rounded to `dtype` first and the rows are divided by the rounded value, so
    `qweight * scale` in `dtype` is the nearest the stored pair can come to each weight."""
    rows = weight.shape[0]
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, dtype=dtype, device=weight.device)
    with torch.no_grad():
        for start in range(0, rows, _ROWS_PER_CHUNK):
            w = weight[start:start + _ROWS_PER_CHUNK].float()
            s = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
            scale[start:start + len(w)] = s
            qweight[start:start + len(w)] = (w / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return qweight, scale


class Int8Embedding(torch.nn.Module):
    """`nn.Embedding` on int8 rows: looks up, then scales into the model dtype."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, padding_idx: int | None = None):
        super().__init__()
        self.register_buffer("qweight", qweight)  # [vocab, hidden] int8
        self.register_buffer("scale", scale)  # [vocab]
        self.padding_idx = padding_idx

    @property
    def weight(self) -> torch.Tensor:
        """The int8 matrix, for callers that read the vocabulary size off `weight.shape[0]`."""
        return self.qweight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.qweight).to(self.scale.dtype)  # [..., hidden]
        return rows * self.scale[input_ids].unsqueeze(-1)


class Int8LMHead(torch.nn.Module):
    """A bias-free `nn.Linear(hidden, vocab)` whose weight is int8 per output row."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight)  # [vocab, hidden] int8
        self.register_buffer("scale", scale)  # [vocab]
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        flat = hidden.reshape(-1, self.in_features).to(self.scale.dtype)
        if flat.device.type == "cpu" and flat.shape[0] <= INT8_GEMV_MAX_ROWS:
            out = torch._weight_int8pack_mm(flat.contiguous(), self.qweight, self.scale)
        else:
            out = torch.empty(flat.shape[0], self.out_features, dtype=flat.dtype, device=flat.device)
            for start in range(0, self.out_features, _ROWS_PER_CHUNK):  # a bounded float slice at a time
                rows = slice(start, start + _ROWS_PER_CHUNK)
                # int8 -> float is exact; the row scale applies to the outputs (x . q) * s
                torch.mm(flat, self.qweight[rows].to(flat.dtype).t(), out=out[:, rows])
                out[:, rows] *= self.scale[rows]
        return out.reshape(*hidden.shape[:-1], self.out_features)


def quantize_embeddings(model: torch.nn.Module) -> int:
    """Swap `model`'s input embedding and LM head for int8 ones in place (one shared int8 matrix
    when tied); returns the bytes of full-precision weights replaced."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embedding, torch.nn.Embedding), type(embedding)
    dtype = embedding.weight.dtype
    tied = head is not None and head.weight is embedding.weight
    replaced = embedding.weight.numel() * embedding.weight.element_size()
    qweight, scale = quantize_rows(embedding.weight, dtype)
    model.set_input_embeddings(Int8Embedding(qweight, scale, embedding.padding_idx))
    if head is not None:
        assert isinstance(head, torch.nn.Linear) and head.bias is None, "an LM head with a bias is not quantized"
        if not tied:
            replaced += head.weight.numel() * head.weight.element_size()
            qweight, scale = quantize_rows(head.weight, dtype)
        model.set_output_embeddings(Int8LMHead(qweight, scale))
    return replaced
