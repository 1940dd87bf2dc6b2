"""The Triton path of ``TableBatchedEmbeddingBags``: the same flat buffers, looked up by the
one-launch Triton forward and updated by the Triton backward fused with the optimizer.

The module picks it by device (``kernel="auto"``): CUDA weights, triton installed, an optimizer
the kernels implement (SGD, AdaGrad, row-wise AdaGrad) and no dense-gradient tables. On CPU
tensors it runs only when asked (``kernel="triton"``) under ``TRITON_INTERPRET=1``, which is how
the tests check the wiring without a GPU:

    TRITON_INTERPRET=1 python -m pytest tests/gpu/test_triton_path.py -q
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Optional

import torch

from neorec.embedding.kernels import TableBatchedLayout, triton_interpreting, triton_unavailable_reason
from neorec.embedding.path_common import PathLookup, features_in_order
from neorec.sparse.jagged import KeyedJaggedTensor

if TYPE_CHECKING:  # pragma: no cover
    from neorec.embedding.tbe import TableBatchedEmbeddingBags

TRITON_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")


def triton_unsupported_reason(module: "TableBatchedEmbeddingBags") -> Optional[str]:
    """Why the Triton path cannot serve ``module`` (None when it can)."""
    unavailable = triton_unavailable_reason()
    if unavailable is not None:
        return unavailable
    if not module.weights.is_cuda and not triton_interpreting():
        return "the weights are on the CPU (set TRITON_INTERPRET=1 to run the kernels there)"
    if module.optimizer.kind not in TRITON_OPTIMIZERS:
        return f"optimizer {module.optimizer.kind!r} has no Triton kernel (have {TRITON_OPTIMIZERS})"
    if module.dense_gradient or module._replicas is not None:
        return "dense-gradient tables use the torch path"
    return None


class TritonPath:
    """Forward and fused backward of one ``TableBatchedEmbeddingBags`` on the Triton kernels."""

    def __init__(self, module: "TableBatchedEmbeddingBags") -> None:
        self.module = module
        self._layout: Optional[TableBatchedLayout] = None
        # StorageConfig(seed=None): rounding noise from a seed drawn once, not from seed 0
        self._drawn_seed = secrets.randbits(40)

    def layout(self) -> TableBatchedLayout:
        device = self.module.weights.device
        if self._layout is None or self._layout.table_dims.device != device:
            m = self.module
            self._layout = TableBatchedLayout.build(
                table_dims=m.table_dims, table_rows=m.table_rows,
                feature_table=m.layout.feature_tables,
                feature_pooling_mean=[m.tables[t].pooling == "mean" for t in m.layout.feature_tables],
                table_offsets=m.table_offsets, device=device,
            )
        return self._layout

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """[B, total_dim] fp32 pooled embeddings, features in ``module.feature_names`` order."""
        m = self.module
        features = features_in_order(features, m.feature_names, m.weights.device)
        self._check_ids(features)
        inputs = (features.values, features.offsets(), features.weights, features.batch_size)
        if torch.is_grad_enabled():
            anchor = torch.zeros((), device=m.weights.device, requires_grad=True)
            return PathLookup.apply(anchor, self, *inputs)
        return self.pool(*inputs)

    def pool(self, values, offsets, weights, batch_size) -> torch.Tensor:
        from neorec.embedding.kernels import triton_tbe

        return triton_tbe.tbe_forward(self.module.weights, self.layout(), values, offsets, batch_size, weights,
                                      check_ids=False)

    def _check_ids(self, features: KeyedJaggedTensor) -> None:
        """ValueError naming the feature and table of the first id outside its table."""
        values = features.values
        if values.numel() == 0:
            return
        layout = self.layout()
        per_feature = torch.tensor(features.length_per_key(), device=values.device)
        feature_of_value = torch.repeat_interleave(
            torch.arange(len(per_feature), device=values.device), per_feature, output_size=values.numel())
        limit = layout.table_rows[layout.feature_table[feature_of_value].long()]
        bad = values.lt(0) | values.ge(limit)
        if bool(bad.any()):
            position = int(bad.nonzero()[0, 0])
            feature = self.module.feature_names[int(feature_of_value[position])]
            table = self.module.tables[self.module.layout.feature_tables[int(feature_of_value[position])]]
            raise ValueError(f"feature {feature!r} (table {table.name!r}): id {int(values[position])} is "
                             f"outside the table's rows [0, {table.num_embeddings})")

    @torch.no_grad()
    def backward(self, values, offsets, weights, batch_size, grad_output) -> None:
        from neorec.embedding.kernels import triton_tbe

        m = self.module
        opt = m.checked_optimizer()
        m.step += 1
        step = int(m.step)
        base = self._drawn_seed if m.storage.seed is None else int(m.storage.seed)
        seed = ((base * 1_000_003) ^ step) & 0x7FFFFFFFFFFFFFFF
        triton_tbe.tbe_backward_update(
            opt.kind, m.weights, getattr(m, "momentum1", None), self.layout(), values, offsets,
            batch_size, grad_output, weights, learning_rate=opt.learning_rate, eps=opt.eps,
            weight_decay=opt.weight_decay, seed=seed,
            stochastic_rounding=m.storage.stochastic_rounding, check_ids=False,
        )
        if m.modified_rows is not None and values.numel():
            # offsets are key-major over batch_size bags per feature: feature f's values are
            # offsets[f * B] .. offsets[(f + 1) * B]
            per_feature = offsets[::batch_size].diff()
            first_row = torch.tensor([m.table_row_offsets[t] for t in m.layout.feature_tables], device=values.device)
            m.modified_rows[values + torch.repeat_interleave(first_row, per_feature, output_size=values.numel())] = True
