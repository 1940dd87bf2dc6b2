"""Plain-tensor description of a table-batched embedding op, shared by the Triton kernels and the
torch reference in this package.

The storage layout is the one ``TableBatchedEmbeddingBags`` owns:

* one flat 1-D weight buffer (fp32, fp16 or bf16); table ``t`` occupies
  ``table_rows[t] * table_dims[t]`` contiguous elements, row-major, starting at element
  ``table_offsets[t]``;
* optimizer state in flat fp32 buffers: row-wise AdaGrad keeps one value per row, tables in the
  same order (table ``t``'s rows start at ``table_row_offsets[t]``); element-wise AdaGrad keeps one
  value per weight element (same offsets as the weights);
* input: a KeyedJaggedTensor's ``values`` (ids, key-major), ``bag_offsets`` [F * B + 1] over bags
  (bag ``f * B + b`` is feature ``f`` of sample ``b``), optional per-value weights;
* output: [B, total_cols] fp32, feature ``f`` in columns
  ``output_col_offsets[f] : output_col_offsets[f] + dim of its table``.

``TableBatchedLayout.build`` is called once (when the module is built); everything the kernels
need per call is then on the device, and the Python ints (``max_dim``, ``total_cols``...) need no
device-to-host copy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def launch_device(tensor: torch.Tensor):
    """A context in which a Triton kernel launches on ``tensor``'s GPU: Triton launches on the
    current CUDA device, which is not the tensors' when a module lives on cuda:1 and nobody called
    ``torch.cuda.set_device``. On the CPU (the interpreter) nothing to do."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


OPTIMIZER_KINDS = ("sgd", "rowwise_adagrad", "adagrad")


@dataclass(frozen=True)
class TableBatchedLayout:
    """Metadata of one table-batched op (T tables, F features); integer tensors on one device.

    table_dims: [T] int32 columns of each table (storage order).
    table_rows: [T] int64 rows of each table.
    table_offsets: [T] int64 first element of each table in the flat weight buffer.
    table_row_offsets: [T] int64 first row of each table in row-indexed state (rows numbered in
        storage order, i.e. by ascending ``table_offsets``).
    feature_table: [F] int32 table looked up by each feature.
    feature_pooling_mean: [F] int32, 1 where the feature's pooling is "mean", 0 for "sum".
    output_col_offsets: [F] int64 first output column of each feature.
    """

    table_dims: torch.Tensor
    table_rows: torch.Tensor
    table_offsets: torch.Tensor
    table_row_offsets: torch.Tensor
    feature_table: torch.Tensor
    feature_pooling_mean: torch.Tensor
    output_col_offsets: torch.Tensor
    num_tables: int
    num_features: int
    max_dim: int
    total_cols: int
    total_rows: int
    total_elements: int

    @staticmethod
    def build(
        table_dims: Sequence[int],
        table_rows: Sequence[int],
        feature_table: Sequence[int],
        feature_pooling_mean: Sequence[bool],
        output_col_offsets: Optional[Sequence[int]] = None,
        table_offsets: Optional[Sequence[int]] = None,
        device: Optional[torch.device] = None,
    ) -> "TableBatchedLayout":
        """Checks and packs the metadata (Python sequences, host side).

        Tables may be listed in any order; ``table_offsets`` (element offsets, e.g.
        ``TableBatchedEmbeddingBags.table_offsets``) say where each one is stored and default to
        the packed layout in list order (cumulative ``rows * dim``). Row-wise state numbers rows in
        storage order. ``output_col_offsets`` defaults to features side by side in feature order.
        Given offsets must keep tables disjoint and make the features' column ranges tile
        ``[0, total_cols)``.
        """
        dims, rows = [int(d) for d in table_dims], [int(r) for r in table_rows]
        features, means = [int(t) for t in feature_table], [bool(m) for m in feature_pooling_mean]
        if len(dims) != len(rows):
            raise ValueError(f"table_dims has {len(dims)} entries but table_rows has {len(rows)}")
        for t, (d, r) in enumerate(zip(dims, rows)):
            if d <= 0 or r <= 0:
                raise ValueError(f"table {t}: dim and rows must be > 0, got dim={d}, rows={r}")
        if len(means) != len(features):
            raise ValueError(
                f"feature_pooling_mean has {len(means)} entries but feature_table has {len(features)}"
            )
        for f, t in enumerate(features):
            if not 0 <= t < len(dims):
                raise ValueError(f"feature {f}: table {t} is not one of the {len(dims)} tables")
        sizes = [d * r for d, r in zip(dims, rows)]
        if table_offsets is None:
            starts = [sum(sizes[:t]) for t in range(len(sizes))]
        else:
            starts = [int(o) for o in table_offsets]
            if len(starts) != len(dims):
                raise ValueError(f"table_offsets has {len(starts)} entries, expected {len(dims)}")
            spans = sorted((s, s + n, t) for t, (s, n) in enumerate(zip(starts, sizes)))
            for (s0, e0, t0), (s1, _, t1) in zip(spans, spans[1:]):
                if s1 < e0:
                    raise ValueError(f"tables {t0} and {t1} overlap in the weight buffer")
            if spans and spans[0][0] < 0:
                raise ValueError(f"table {spans[0][2]}: negative offset {spans[0][0]}")
        total_elements = max([s + n for s, n in zip(starts, sizes)], default=0)
        feature_dims = [dims[t] for t in features]
        if output_col_offsets is None:
            cols = [sum(feature_dims[:f]) for f in range(len(features))]
        else:
            cols = [int(c) for c in output_col_offsets]
            if len(cols) != len(features):
                raise ValueError(f"output_col_offsets has {len(cols)} entries, expected {len(features)}")
        total_cols = sum(feature_dims)
        covered = sorted(zip(cols, feature_dims, range(len(cols))))
        position = 0
        for start, width, f in covered:
            if start != position:
                raise ValueError(
                    f"feature {f}: output columns start at {start}, expected {position}; the "
                    f"features' column ranges must tile [0, {total_cols}) without gaps or overlap"
                )
            position += width
        row_offsets, next_row = [0] * len(rows), 0
        for t in sorted(range(len(rows)), key=lambda t: starts[t]):
            row_offsets[t], next_row = next_row, next_row + rows[t]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return TableBatchedLayout(
            table_dims=tensor(dims, torch.int32),
            table_rows=tensor(rows, torch.int64),
            table_offsets=tensor(starts, torch.int64),
            table_row_offsets=tensor(row_offsets, torch.int64),
            feature_table=tensor(features, torch.int32),
            feature_pooling_mean=tensor([int(m) for m in means], torch.int32),
            output_col_offsets=tensor(cols, torch.int64),
            num_tables=len(dims),
            num_features=len(features),
            max_dim=max(dims, default=0),
            total_cols=total_cols,
            total_rows=next_row,
            total_elements=total_elements,
        )

    def to(self, device: torch.device) -> "TableBatchedLayout":
        """The same layout with its tensors on ``device``."""
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "table_dims", "table_rows", "table_offsets", "table_row_offsets",
                "feature_table", "feature_pooling_mean", "output_col_offsets",
            )
        }
        return TableBatchedLayout(
            **moved,
            num_tables=self.num_tables,
            num_features=self.num_features,
            max_dim=self.max_dim,
            total_cols=self.total_cols,
            total_rows=self.total_rows,
            total_elements=self.total_elements,
        )

    def state_size(self, kind: str) -> int:
        """Elements of the flat fp32 optimizer state for ``kind`` (0 for SGD)."""
        check_optimizer_kind(kind)
        return {"sgd": 0, "rowwise_adagrad": self.total_rows, "adagrad": self.total_elements}[kind]


def check_optimizer_kind(kind: str) -> None:
    if kind not in OPTIMIZER_KINDS:
        raise ValueError(f"optimizer kind must be one of {OPTIMIZER_KINDS}, got {kind!r}")


def check_batch(
    layout: TableBatchedLayout,
    weights: torch.Tensor,
    indices: torch.Tensor,
    bag_offsets: torch.Tensor,
    batch_size: int,
    per_value_weights: Optional[torch.Tensor],
    check_ids: bool = True,
) -> None:
    """Raises ValueError/TypeError on inputs that do not fit ``layout``.

    Shapes and dtypes are always checked (no device sync). With ``check_ids`` the bag offsets must
    be non-decreasing and inside ``indices`` and every id must lie in its feature's table; this
    reads device values back once (a sync on CUDA).
    """
    if weights.dim() != 1 or weights.dtype not in WEIGHT_DTYPES:
        raise TypeError(
            f"weights must be a 1-D tensor of {WEIGHT_DTYPES}, got {tuple(weights.shape)} {weights.dtype}"
        )
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous")
    if weights.numel() < layout.total_elements:
        raise ValueError(
            f"weights has {weights.numel()} elements, the tables need {layout.total_elements}"
        )
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be a 1-D int32/int64 tensor, got {tuple(indices.shape)} {indices.dtype}")
    num_bags = layout.num_features * batch_size
    if bag_offsets.dim() != 1 or bag_offsets.numel() != num_bags + 1:
        raise ValueError(
            f"bag_offsets must have num_features * batch_size + 1 = {num_bags + 1} entries, "
            f"got shape {tuple(bag_offsets.shape)}"
        )
    if bag_offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"bag_offsets must be int32/int64, got {bag_offsets.dtype}")
    if per_value_weights is not None:
        if per_value_weights.shape != indices.shape or not per_value_weights.is_floating_point():
            raise ValueError(
                f"per_value_weights must be a float tensor shaped like indices {tuple(indices.shape)}, "
                f"got {tuple(per_value_weights.shape)} {per_value_weights.dtype}"
            )
    for name, tensor in (("indices", indices), ("bag_offsets", bag_offsets), ("per_value_weights", per_value_weights)):
        if tensor is not None and tensor.device != weights.device:
            raise ValueError(f"{name} is on {tensor.device} but weights are on {weights.device}")
    if layout.table_dims.device != weights.device:
        raise ValueError(f"layout is on {layout.table_dims.device} but weights are on {weights.device}; use layout.to()")
    if not check_ids:
        return
    lengths = bag_offsets[1:] - bag_offsets[:-1]
    if num_bags and (bool((lengths < 0).any()) or int(bag_offsets[0]) < 0 or int(bag_offsets[-1]) > indices.numel()):
        raise ValueError(
            f"bag_offsets must be non-decreasing within [0, {indices.numel()}] (the number of ids)"
        )
    used = indices[int(bag_offsets[0]) : int(bag_offsets[-1])] if num_bags else indices[:0]
    if used.numel() == 0:
        return
    value_feature = torch.repeat_interleave(
        torch.arange(num_bags, device=indices.device) // batch_size, lengths.long(), output_size=used.numel()
    )
    value_rows = layout.table_rows[layout.feature_table[value_feature].long()]
    bad = (used < 0) | (used >= value_rows)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        feature = int(value_feature[position])
        raise ValueError(
            f"id {int(used[position])} (value {position + int(bag_offsets[0])}, feature {feature}) is "
            f"outside table {int(layout.feature_table[feature])} with {int(value_rows[position])} rows"
        )
