"""Embedding tables in checkpoints as LOGICAL tables: each saved piece is a row range x column range
of a model table (a whole table, a row-wise or column-wise shard, or a data-parallel replica
written once, by rank 0). Restoring reads, for every piece the current model holds, the parts of
the saved pieces that overlap it, so a checkpoint restores into any world size and any plan.

Saved per piece (``key`` = a short name inside its rank's tensor file):
    ``<key>.w``      fp32 [K, cols] rows (row_bits 32), or
    ``<key>.q`` uint8 [K, packed cols], ``<key>.scale`` / ``<key>.min`` fp32 [K] (row_bits 8/4/2)
    ``<key>.ids``    int64 [K] rows (relative to the piece's first row) of an incremental piece;
                     absent: all rows of the piece, in order
    ``<key>.s.<n>``  optimizer state ``n`` (fp32 [K] row-wise, [K, cols] per element), full precision
Restore order: the full checkpoint, then each increment in order (later rows overwrite).

Row-wise optimizer state (row-wise AdaGrad) with column pieces: a piece keeps one statistic per
row for its own columns. Restoring a target piece takes, per row, the mean of the overlapping saved
pieces' statistics weighted by their overlapping column counts: exact when the column cuts are
the same, and exact when column pieces are merged into a whole row (the mean of g^2 over the row);
splitting a whole row gives every piece the whole row's statistic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from neorec.embedding.optimizers import STATE_LAYOUT
from neorec.embedding.tbe import TableBatchedEmbeddingBags
from neorec.train.checkpoint_files import UnquantizableRowError, dequantize_rows, quantize_rows

OFF_DEVICE_CHECKPOINTS = ("checkpoints of cached / off-device embedding tables (embedding.location) are not "
                          "supported yet; train with every table on the device to use [checkpoint] or --resume")


@dataclass
class LocalPiece:
    """A piece of table ``table`` held by this rank's fused module under the name ``local``."""

    table: str
    local: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    writes: bool  # this rank writes it (False: a replica that rank 0 writes)


def model_pieces(sparse_arch, rank: int) -> Tuple[Optional[TableBatchedEmbeddingBags], List[LocalPiece]]:
    """This rank's fused module and the pieces it holds, for an ``EmbeddingBagCollection`` or a
    ``ShardedEmbeddingBagCollection``."""
    from neorec.embedding.cached import CachedEmbeddingBagCollection
    from neorec.embedding.tables import EmbeddingBagCollection
    from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    if isinstance(sparse_arch, CachedEmbeddingBagCollection):
        raise ValueError(OFF_DEVICE_CHECKPOINTS)
    if isinstance(sparse_arch, EmbeddingBagCollection):
        return sparse_arch.tbe, [LocalPiece(t.name, t.name, 0, t.num_embeddings, 0, t.embedding_dim, True)
                                 for t in sparse_arch.tables]
    if isinstance(sparse_arch, ShardedEmbeddingBagCollection):
        routing = sparse_arch.routing
        pieces = [LocalPiece(p.table.name, p.config.name, p.shard.row_start, p.shard.row_end, p.shard.col_start,
                             p.shard.col_end, True) for p in routing.shards_on[rank]]
        pieces += [LocalPiece(t.name, t.name, 0, t.num_embeddings, 0, t.embedding_dim, rank == 0)
                   for t in routing.replicas]
        return sparse_arch.tbe, pieces
    raise TypeError(f"checkpoint: unsupported embedding collection {type(sparse_arch).__name__}")


def piece_bytes(tbe: TableBatchedEmbeddingBags, piece: LocalPiece, num_rows: int, row_bits: int) -> int:
    """Bytes the payload of ``num_rows`` rows of ``piece`` takes (estimate for the full/incremental policy)."""
    cols = piece.col_end - piece.col_start
    row = (cols * 4) if row_bits == 32 else ((cols * row_bits + 7) // 8 + 8)
    state = sum(4 if layout == "row" else 4 * cols for _, layout in STATE_LAYOUT[tbe.optimizer.kind])
    return num_rows * (row + state)


def count_modified(tbe: TableBatchedEmbeddingBags, piece: LocalPiece) -> int:
    t = tbe._table(piece.local)
    lo = tbe.table_row_offsets[t]
    return int(tbe.modified_rows[lo : lo + tbe.table_rows[t]].sum())


def save_pieces(tbe: Optional[TableBatchedEmbeddingBags], pieces: List[LocalPiece], incremental: bool,
                row_bits: int, prefix: str) -> Tuple[Dict[str, torch.Tensor], List[dict]]:
    """Tensors and manifest entries of this rank's pieces; with modified-row tracking on, clears
    the marks of every piece (incremental: only the marked rows are written)."""
    tensors: Dict[str, torch.Tensor] = {}
    entries: List[dict] = []
    if tbe is None:
        return tensors, entries
    if incremental and tbe.modified_rows is None:
        raise ValueError("incremental checkpoint: the fused module does not track modified rows")
    for index, piece in enumerate(pieces):
        ids = tbe.take_modified_rows(piece.local) if tbe.modified_rows is not None else None
        if not piece.writes:
            continue
        key = f"{prefix}{index}"
        if incremental:  # gather the rows from views: no copy of the whole table
            weight, state = _table_views(tbe, piece.local)
            weight = weight.index_select(0, ids).to(torch.float32)
            state = {k: v.index_select(0, ids) for k, v in state.items()}
            tensors[f"{key}.ids"] = ids.cpu()
        else:
            weight, state = tbe.get_table_weight(piece.local), tbe.get_optimizer_state(piece.local)
        if row_bits == 32:
            tensors[f"{key}.w"] = weight
        else:
            try:
                tensors[f"{key}.q"], tensors[f"{key}.scale"], tensors[f"{key}.min"] = quantize_rows(weight, row_bits)
            except UnquantizableRowError as exc:
                row = piece.row_start + (int(ids[exc.row]) if incremental else exc.row)
                raise UnquantizableRowError(row, row_bits, piece.table) from None
        for name, value in state.items():
            tensors[f"{key}.s.{name}"] = value
        entries.append({"table": piece.table, "key": key, "rows": [piece.row_start, piece.row_end],
                        "cols": [piece.col_start, piece.col_end], "incremental": incremental,
                        "row_bits": row_bits, "num_rows_written": int(weight.shape[0])})
    return tensors, entries


def _table_views(tbe: TableBatchedEmbeddingBags, name: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Views (no copies) of table ``name``'s rows [rows, dim] and optimizer state."""
    t = tbe._table(name)
    group = tbe.layout.groups[tbe.layout.table_group[t]]
    lo, rows = tbe.table_row_offset_in_group[t], tbe.table_rows[t]
    return tbe.group_weights(group)[lo : lo + rows], {k: v[lo : lo + rows] for k, v in tbe._group_states(group).items()}


def _source_rows(entry: dict, tensors: Dict[str, torch.Tensor], lo: int, hi: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions in the saved payload, absolute rows) of the saved rows inside [lo, hi)."""
    start = entry["rows"][0]
    ids = tensors.get(f"{entry['key']}.ids")
    if ids is None:
        rows = torch.arange(max(lo, start), min(hi, entry["rows"][1]))
        return rows - start, rows
    absolute = ids + start
    keep = ((absolute >= lo) & (absolute < hi)).nonzero().squeeze(1)
    return keep, absolute.index_select(0, keep)


def _source_weight(entry: dict, tensors: Dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    key = entry["key"]
    if entry["row_bits"] == 32:
        return tensors[f"{key}.w"].index_select(0, positions)
    cols = entry["cols"][1] - entry["cols"][0]
    return dequantize_rows(tensors[f"{key}.q"].index_select(0, positions), tensors[f"{key}.scale"][positions],
                           tensors[f"{key}.min"][positions], entry["row_bits"], cols)


def restore_pieces(tbe: Optional[TableBatchedEmbeddingBags], pieces: List[LocalPiece],
                   chain: List[Tuple[List[dict], Callable[[dict], Dict[str, torch.Tensor]]]]) -> None:
    """Fill every piece of ``tbe`` from ``chain``: [(entries of a checkpoint, entry -> its file's
    tensors)], the full checkpoint first, then the increments in order."""
    if tbe is None:
        return
    for piece in pieces:
        rows, cols = piece.row_end - piece.row_start, piece.col_end - piece.col_start
        # merged on host copies: the saved tensors are host tensors, and CUDA refuses indexed writes
        # of host values into device tensors (set_table_weight / set_optimizer_state copy back)
        weight = tbe.get_table_weight(piece.local, device="cpu")
        state = tbe.get_optimizer_state(piece.local, device="cpu")
        covered = 0
        for depth, (entries, tensors_of) in enumerate(chain):
            row_state_sum = {k: torch.zeros(rows) for k, v in state.items() if v.dim() == 1}
            row_state_weight = torch.zeros(rows)
            for entry in entries:
                if entry["table"] != piece.table:
                    continue
                c0, c1 = max(piece.col_start, entry["cols"][0]), min(piece.col_end, entry["cols"][1])
                if c1 <= c0 or max(piece.row_start, entry["rows"][0]) >= min(piece.row_end, entry["rows"][1]):
                    continue
                tensors = tensors_of(entry)
                positions, absolute = _source_rows(entry, tensors, piece.row_start, piece.row_end)
                if positions.numel() == 0:
                    continue
                target = absolute - piece.row_start
                src_cols = slice(c0 - entry["cols"][0], c1 - entry["cols"][0])
                dst_cols = slice(c0 - piece.col_start, c1 - piece.col_start)
                weight[target, dst_cols] = _source_weight(entry, tensors, positions)[:, src_cols]
                if depth == 0:
                    covered += target.numel() * (c1 - c0)
                share = (c1 - c0) / cols
                for name, value in state.items():
                    saved = tensors[f"{entry['key']}.s.{name}"].index_select(0, positions)
                    if value.dim() == 1:
                        row_state_sum[name].index_add_(0, target, saved * share)
                    else:
                        value[target, dst_cols] = saved[:, src_cols]
                row_state_weight.index_add_(0, target, torch.full((target.numel(),), share))
            touched = row_state_weight > 0
            for name, total in row_state_sum.items():
                state[name][touched] = total[touched] / row_state_weight[touched]
        if covered != rows * cols:
            raise ValueError(f"checkpoint: the full checkpoint covers {covered} of the {rows * cols} elements of "
                             f"table {piece.table!r} rows [{piece.row_start}, {piece.row_end}) columns "
                             f"[{piece.col_start}, {piece.col_end}); it does not hold the whole table")
        tbe.set_table_weight(piece.local, weight)
        tbe.set_optimizer_state(piece.local, state)
