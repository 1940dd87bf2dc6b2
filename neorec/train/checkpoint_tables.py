"""Embedding tables in checkpoints as LOGICAL tables: each saved piece is a row range x column range
of a model table (a whole table, a row-wise or column-wise shard, a data-parallel replica written
once, by rank 0, or a chunk of rows of a cached table). Restoring reads, for every piece the
current model holds, the parts of the saved pieces that overlap it, so a checkpoint restores into
any world size, any plan and any table location (device, DRAM, cached in front of DRAM or SSD).

Where a rank's pieces live is a ``PieceHolder``: ``FusedPieces`` (a fused module, the pieces held
whole) or ``CachedPieces`` (the cached tables of a ``CachedEmbeddingBagCollection``: rows read as
training sees them, from the cache slot when resident, else from the store; saved ``CHUNK_BYTES``
at a time into files of their own and restored chunk by chunk, so a table larger than host
memory is never held whole).

Saved per piece (``key`` = a short name inside its rank's tensor file):
    ``<key>.w``      fp32 [K, cols] rows (row_bits 32), or
    ``<key>.q`` uint8 [K, packed cols], ``<key>.scale`` / ``<key>.min`` fp32 [K] (row_bits 8/4/2)
    ``<key>.ids``    int64 [K] rows (relative to the first row of the entry's ``rows`` range) of an
                     incremental entry; absent: every row of that range, in order
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
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from neorec.embedding.optimizers import STATE_LAYOUT
from neorec.embedding.tbe import TableBatchedEmbeddingBags
from neorec.train.checkpoint_files import UnquantizableRowError, dequantize_rows, quantize_rows

CHUNK_BYTES = 8 << 20  # a cached table's rows are saved and restored this many bytes at a time


@dataclass
class LocalPiece:
    """A piece of table ``table`` held by this rank under the name ``local``, through ``holder``
    (``FusedPieces`` or ``CachedPieces``)."""

    table: str
    local: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    writes: bool  # this rank writes it (False: a replica that rank 0 writes)
    holder: "PieceHolder" = None  # type: ignore[assignment]


class PieceHolder:
    """Where a rank's pieces live, as the checkpoint reads and writes them. ``ids`` are rows
    relative to the piece's first row; values are fp32 [K, cols] rows and the optimizer state
    ({name: [K] row-wise or [K, cols]})."""

    optimizer_kind: str

    def track(self) -> None:
        """Start marking modified rows (the marks are cleared)."""
        raise NotImplementedError

    @property
    def tracking(self) -> bool:
        raise NotImplementedError

    def take_modified(self, piece: LocalPiece) -> torch.Tensor:
        raise NotImplementedError

    def count_modified(self, piece: LocalPiece) -> int:
        raise NotImplementedError

    def prepare(self, piece: LocalPiece):
        """Whatever many reads / writes of ``piece`` between two steps can share (or None)."""
        return None

    def read(self, piece: LocalPiece, ids: Optional[torch.Tensor], context=None
             ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(rows, state) of ``ids`` (None: every row of the piece)."""
        raise NotImplementedError

    def write(self, piece: LocalPiece, weight: torch.Tensor, state: Dict[str, torch.Tensor], context=None) -> None:
        """Overwrite every row of the piece."""
        raise NotImplementedError

    def restore_target(self, piece: LocalPiece, context=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Host tensors a restore fills: the piece's current values (the full checkpoint must cover
        every one of them before anything is written back)."""
        return self.read(piece, None, context)


class FusedPieces(PieceHolder):
    """Pieces held whole in a fused module; ``module()`` is the current one (a cached collection
    rebuilds its fused module when a cache grows)."""

    def __init__(self, module: Callable[[], TableBatchedEmbeddingBags]) -> None:
        self.module = module

    @property
    def optimizer_kind(self) -> str:  # type: ignore[override]
        return self.module().optimizer.kind

    def track(self) -> None:
        self.module().track_modified_rows()

    @property
    def tracking(self) -> bool:
        return self.module().modified_rows is not None

    def take_modified(self, piece: LocalPiece) -> torch.Tensor:
        return self.module().take_modified_rows(piece.local)

    def count_modified(self, piece: LocalPiece) -> int:
        return self.module().count_modified_rows(piece.local)

    def read(self, piece, ids, context=None):
        tbe = self.module()
        if ids is None:
            # merged on host copies: the saved tensors are host tensors, and CUDA refuses indexed
            # writes of host values into device tensors (write copies back)
            return tbe.get_table_weight(piece.local, device="cpu"), tbe.get_optimizer_state(piece.local, device="cpu")
        weight, state = _table_views(tbe, piece.local)  # gather the rows from views: no copy of the table
        ids = ids.to(weight.device)
        return (weight.index_select(0, ids).to("cpu", torch.float32),
                {k: v.index_select(0, ids).cpu() for k, v in state.items()})

    def write(self, piece, weight, state, context=None):
        tbe = self.module()
        tbe.set_table_weight(piece.local, weight)
        tbe.set_optimizer_state(piece.local, state)


class CachedPieces(PieceHolder):
    """The cached tables of a ``CachedEmbeddingBagCollection`` (one per piece; ``local`` is the
    collection's table, whose row 0 is row ``first_rows[local]`` of the model's table) read as
    training sees them, resident rows from their cache slot and the others from the store, and
    written to both; ``chunk_rows_of`` rows at a time, so a table larger than host memory is never
    held whole."""

    def __init__(self, collection, first_rows: Optional[Dict[str, int]] = None) -> None:
        self.collection = collection
        self.first_rows = dict(first_rows or {})

    def _rows(self, piece: LocalPiece, ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Rows of the collection's table of ``piece`` (a chunk of it when restoring)."""
        start = piece.row_start - self.first_rows.get(piece.local, 0)
        return torch.arange(start, start + piece.row_end - piece.row_start) if ids is None else ids.cpu() + start

    @property
    def optimizer_kind(self) -> str:  # type: ignore[override]
        return self.collection.tbe.optimizer.kind

    def chunk_rows_of(self, piece: LocalPiece) -> int:
        cols = piece.col_end - piece.col_start
        state = sum(1 if layout == "row" else cols for _, layout in STATE_LAYOUT[self.optimizer_kind])
        return max(1, CHUNK_BYTES // (4 * (cols + state)))

    def track(self) -> None:
        self.collection.track_modified_rows()

    @property
    def tracking(self) -> bool:
        return self.collection._modified is not None

    def take_modified(self, piece):
        return self.collection.take_modified_rows(piece.local)

    def count_modified(self, piece):
        return self.collection.count_modified_rows(piece.local)

    def prepare(self, piece):
        return self.collection.resident(piece.local)

    def read(self, piece, ids, context=None):
        return self.collection.read_rows(piece.local, self._rows(piece, ids), context)

    def write(self, piece, weight, state, context=None):
        self.collection.write_rows(piece.local, self._rows(piece, None), weight, state, context)

    def restore_target(self, piece, context=None):
        """Empty tensors, not the rows in the store: the full checkpoint covers every row before
        anything is written back (a table on SSD would be read whole for nothing)."""
        rows, cols = piece.row_end - piece.row_start, piece.col_end - piece.col_start
        return torch.empty(rows, cols), {name: torch.empty(rows) if layout == "row" else torch.empty(rows, cols)
                                         for name, layout in STATE_LAYOUT[self.optimizer_kind]}


def model_pieces(sparse_arch, rank: int) -> List[LocalPiece]:
    """The pieces this rank holds, for an ``EmbeddingBagCollection``, a
    ``CachedEmbeddingBagCollection`` or a ``ShardedEmbeddingBagCollection``."""
    from neorec.embedding.cached import CachedEmbeddingBagCollection
    from neorec.embedding.tables import EmbeddingBagCollection
    from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    def whole(table, holder: PieceHolder) -> LocalPiece:
        return LocalPiece(table.name, table.name, 0, table.num_embeddings, 0, table.embedding_dim, True, holder)

    if isinstance(sparse_arch, CachedEmbeddingBagCollection):
        fused, cached = FusedPieces(lambda: sparse_arch.tbe), CachedPieces(sparse_arch)
        host = FusedPieces(lambda: sparse_arch.host_tbe)
        host_names = sparse_arch._host_names()
        return [whole(t, cached if t.name in sparse_arch.caches else host if t.name in host_names else fused)
                for t in sparse_arch.tables]
    if isinstance(sparse_arch, EmbeddingBagCollection):
        fused = FusedPieces(lambda: sparse_arch.tbe)
        return [whole(t, fused) for t in sparse_arch.tables]
    if isinstance(sparse_arch, ShardedEmbeddingBagCollection):
        if sparse_arch.tbe is None:
            return []
        routing, fused, local = sparse_arch.routing, FusedPieces(lambda: sparse_arch.tbe), sparse_arch.cached
        shards = routing.shards_on[rank]
        if local is not None:  # pieces off the device in a cached collection, the others in its modules
            cached = CachedPieces(local, {p.config.name: p.shard.row_start for p in shards})
            host = FusedPieces(lambda: local.host_tbe)
            host_names = local._host_names()

            def holder_of(name: str) -> PieceHolder:
                return cached if name in local.caches else host if name in host_names else fused
        else:
            def holder_of(name: str) -> PieceHolder:
                return fused
        pieces = [LocalPiece(p.table.name, p.config.name, p.shard.row_start, p.shard.row_end, p.shard.col_start,
                             p.shard.col_end, True, holder_of(p.config.name)) for p in shards]
        pieces += [LocalPiece(t.name, t.name, 0, t.num_embeddings, 0, t.embedding_dim, rank == 0, fused)
                   for t in routing.replicas]
        return pieces
    raise TypeError(f"checkpoint: unsupported embedding collection {type(sparse_arch).__name__}")


def fused_modules(sparse_arch) -> List[Tuple[str, TableBatchedEmbeddingBags]]:
    """(name, module) of every fused module of this rank, the main one first under the name "" (its
    optimizer step is the checkpoint's): a cached collection's host module is "host"."""
    host = getattr(getattr(sparse_arch, "cached", None) or sparse_arch, "host_tbe", None)
    modules = [("", getattr(sparse_arch, "tbe", None)), ("host", host)]
    return [(name, module) for name, module in modules if module is not None]


def holders(pieces: List[LocalPiece]) -> List[PieceHolder]:
    """The distinct holders of ``pieces``."""
    out: List[PieceHolder] = []
    for piece in pieces:
        if not any(piece.holder is h for h in out):
            out.append(piece.holder)
    return out


def piece_bytes(optimizer_kind: str, piece: LocalPiece, num_rows: int, row_bits: int, incremental: bool = False) -> int:
    """Bytes of the tensors that hold ``num_rows`` rows of ``piece`` (for the full/incremental
    policy): each row's values (with its scale and bias when quantized), its optimizer state and,
    in an increment, its id (8 bytes; with small rows a large part of an increment)."""
    cols = piece.col_end - piece.col_start
    row = (cols * 4) if row_bits == 32 else ((cols * row_bits + 7) // 8 + 8)
    state = sum(4 if layout == "row" else 4 * cols for _, layout in STATE_LAYOUT[optimizer_kind])
    return num_rows * (row + state + (8 if incremental else 0))


def save_pieces(pieces: List[LocalPiece], incremental: bool, row_bits: int, prefix: str
                ) -> Iterator[Tuple[Dict[str, torch.Tensor], List[dict]]]:
    """Tensors and manifest entries of this rank's pieces, in groups that are written one file
    each: the first group holds every piece held whole (it comes first even when empty), each
    chunk of a chunked piece (``CachedPieces``) is a group of its own, made only when the previous
    one was written. With modified-row tracking on, the marks of every piece are taken (cleared)
    before the first group (incremental: only the marked rows are written)."""
    taken = []
    for index, piece in enumerate(pieces):
        holder = piece.holder
        if incremental and not holder.tracking:
            raise ValueError("incremental checkpoint: the embedding tables do not track modified rows")
        ids = holder.take_modified(piece) if holder.tracking else None
        if piece.writes:
            taken.append((index, piece, ids if incremental else None))
    tensors: Dict[str, torch.Tensor] = {}
    entries: List[dict] = []
    for index, piece, ids in taken:
        if not isinstance(piece.holder, CachedPieces):
            _add_piece(tensors, entries, piece, f"{prefix}{index}", ids, row_bits, incremental)
    yield tensors, entries
    for index, piece, ids in taken:
        if not isinstance(piece.holder, CachedPieces):
            continue
        holder, rows = piece.holder, piece.row_end - piece.row_start
        context = holder.prepare(piece)
        chunk = holder.chunk_rows_of(piece)
        parts = (ids.split(chunk) if incremental else  # made one at a time: 8 bytes a row otherwise
                 (torch.arange(lo, min(lo + chunk, rows)) for lo in range(0, rows, chunk)))
        for k, part in enumerate(part for part in parts if part.numel()):  # no file for no rows
            tensors, entries = {}, []
            _add_piece(tensors, entries, piece, f"{prefix}{index}.{k}", part, row_bits, incremental, context)
            yield tensors, entries


def _add_piece(tensors: Dict[str, torch.Tensor], entries: List[dict], piece: LocalPiece, key: str,
               ids: Optional[torch.Tensor], row_bits: int, incremental: bool, context=None) -> None:
    """Add the rows ``ids`` of ``piece`` (ascending; None: all) under ``key``. The entry's row range
    is the span of its rows (so that a restore looks at the entries overlapping each of its chunks
    only); an incremental entry names its rows (``.ids``, relative to the range's first row), a
    full one holds every row of its range."""
    weight, state = piece.holder.read(piece, ids, context)
    if ids is None:
        rows = [piece.row_start, piece.row_end]
    elif ids.numel() == 0:
        rows = [piece.row_start, piece.row_start]
    else:
        first = int(ids[0])
        rows = [piece.row_start + first, piece.row_start + int(ids[-1]) + 1]
    if incremental:
        tensors[f"{key}.ids"] = (ids - rows[0] + piece.row_start).cpu()
    if row_bits == 32:
        tensors[f"{key}.w"] = weight
    else:
        try:
            tensors[f"{key}.q"], tensors[f"{key}.scale"], tensors[f"{key}.min"] = quantize_rows(weight, row_bits)
        except UnquantizableRowError as exc:
            row = piece.row_start + (exc.row if ids is None else int(ids[exc.row]))
            raise UnquantizableRowError(row, row_bits, piece.table) from None
    for name, value in state.items():
        tensors[f"{key}.s.{name}"] = value
    entries.append({"table": piece.table, "key": key, "rows": rows, "cols": [piece.col_start, piece.col_end],
                    "incremental": incremental, "row_bits": row_bits, "num_rows_written": int(weight.shape[0])})


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


def restore_pieces(pieces: List[LocalPiece],
                   chain: List[Tuple[List[dict], Callable[[dict], Dict[str, torch.Tensor]]]]) -> None:
    """Fill every piece from ``chain``: [(entries of a checkpoint, entry -> its file's tensors)],
    the full checkpoint first, then the increments in order; a chunked piece (``CachedPieces``)
    ``chunk_rows_of`` rows at a time."""
    for piece in pieces:
        holder = piece.holder
        if not isinstance(holder, CachedPieces):
            _restore_part(piece, chain, None)
            continue
        context, chunk = holder.prepare(piece), holder.chunk_rows_of(piece)
        for lo in range(piece.row_start, piece.row_end, chunk):
            part = LocalPiece(piece.table, piece.local, lo, min(lo + chunk, piece.row_end), piece.col_start,
                              piece.col_end, piece.writes, holder)
            _restore_part(part, chain, context)


def _restore_part(piece: LocalPiece, chain, context) -> None:
    rows, cols = piece.row_end - piece.row_start, piece.col_end - piece.col_start
    weight, state = piece.holder.restore_target(piece, context)  # host tensors
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
    piece.holder.write(piece, weight, state, context)
