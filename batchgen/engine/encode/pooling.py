"""A packed batch's token states to one vector per row: pooling, the Matryoshka cut, normalization.

Pooling reads the packed hidden states directly (segment sums and index gathers over [T, hidden]),
in float32 whatever the model's dtype. The order is sentence-transformers' with `truncate_dim` and
`normalize_embeddings=True`: pool, cut to the first `dimensions` components, then scale to unit
length, so a cut vector of a normalizing model is itself unit length (as OpenAI's `dimensions` are).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from batchgen.config.choices import Pooling
from batchgen.engine.encode.packing import PackedBatch

# sentence-transformers' and torch's normalize floor: a zero vector stays zero instead of NaN
_NORM_EPS = 1e-12


def pool(hidden: torch.Tensor, batch: PackedBatch, pooling: Pooling) -> torch.Tensor:
    """float32 [rows, hidden] from the packed hidden states [T, hidden]."""
    if pooling is Pooling.CLS:
        return hidden[batch.first_token_index()].float()
    if pooling is Pooling.LAST:
        return hidden[batch.last_token_index()].float()
    assert pooling is Pooling.MEAN, pooling
    sums = torch.zeros(batch.num_rows, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, batch.row_of_token(), hidden.float())
    lengths = torch.tensor(batch.lengths, dtype=torch.float32, device=hidden.device)
    return sums / lengths[:, None]


def finish(pooled: torch.Tensor, *, normalize: bool, dimensions: Sequence[int | None]) -> list[np.ndarray]:
    """Each row's float32 vector: cut to its `dimensions` (None: whole), then normalized if asked."""
    vectors = pooled.float().cpu()
    width = vectors.shape[1]
    cuts = [width if d is None else d for d in dimensions]
    assert len(cuts) == vectors.shape[0] and all(1 <= c <= width for c in cuts), (cuts, width)
    if all(c == cuts[0] for c in cuts):  # one cut for the whole batch: one vectorized pass
        return list(_finish_block(vectors[:, :cuts[0]], normalize).numpy())
    return [_finish_block(vectors[i:i + 1, :c], normalize).numpy()[0] for i, c in enumerate(cuts)]


def _finish_block(vectors: torch.Tensor, normalize: bool) -> torch.Tensor:
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=1, eps=_NORM_EPS)
    return vectors.contiguous()
