"""DLRM: bottom (dense) MLP, sparse embeddings, feature interaction, top (over) MLP.

    model = DLRM(sparse_arch, num_dense=13, embedding_dims={"user": 16, "item": 16},
                 dense_layers=[64, 16], over_layers=[64, 32])
    logits = model(batch.dense, batch.sparse)          # [B], no sigmoid

``sparse_arch`` is any module mapping a ``KeyedJaggedTensor`` to a ``KeyedTensor`` (keys = the
features, values [B, sum(dims)]). It is kept as ``model.sparse_arch`` so that sharding can swap it
for a distributed one; this module never imports ``neorec.sharding``.

Initialisation follows the DLRM reference: every ``nn.Linear`` built here draws weights from
N(0, 2 / (fan_in + fan_out)) and biases from N(0, 1 / fan_out), from the global torch RNG (seed it
before building the model). The sparse arch is never re-initialised.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from neorec.model.aligned_linear import AlignedLinear
from neorec.model.native_interaction import dot_interaction, dot_interaction_blocks, native_interaction_supported
from neorec.native import MAX_NATIVE_DIM, native_available
from neorec.sparse.column_blocks import ColumnBlocks
from neorec.sparse.jagged import KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor

EmbeddingDims = Union[Sequence[int], Mapping[str, int], Sequence[Tuple[str, int]], KeyedTensor]
INTERACTIONS = ("dot", "dcn")
INTERACTION_KERNELS = ("auto", "torch", "native")


def dlrm_init_(linear: nn.Linear) -> None:
    """DLRM reference init in place: W ~ N(0, 2/(fan_in+fan_out)), b ~ N(0, 1/fan_out)."""
    fan_out, fan_in = linear.weight.shape
    with torch.no_grad():
        linear.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)))
        if linear.bias is not None:
            linear.bias.normal_(0.0, math.sqrt(1.0 / fan_out))


def _linear(in_dim: int, out_dim: int, bias: bool = True) -> nn.Linear:
    """An ``nn.Linear`` (``AlignedLinear``: faster backward on CPU for widths not a multiple of 8)
    with the DLRM reference init."""
    with warnings.catch_warnings():  # num_dense = 0 gives a [out, 0] weight; nothing to init
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        layer = nn.utils.skip_init(AlignedLinear, in_dim, out_dim, bias=bias)  # no throw-away init
    dlrm_init_(layer)
    return layer


def _check_layer_sizes(where: str, layer_sizes: Sequence[int], allow_empty: bool) -> List[int]:
    sizes = list(layer_sizes)
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in sizes):  # (8.7 built a width of 8)
        raise TypeError(f"{where}: layer widths must be integers, got {sizes}")
    sizes = [int(s) for s in sizes]
    if not sizes and not allow_empty:
        raise ValueError(f"{where}: layer_sizes is empty; give at least one positive layer width")
    bad = [s for s in sizes if s <= 0]
    if bad:
        raise ValueError(f"{where}: layer widths must be positive, got {sizes}")
    return sizes


class DenseArch(nn.Module):
    """Bottom MLP: Linear + ReLU for every layer. [B, num_dense] -> [B, layer_sizes[-1]].

    The ReLUs run in place on their Linear's output (which no backward needs): one pass over each
    activation instead of a read and a fresh write (~1-2% of a pool1 step, bench_e2e's shapes).

    ``num_dense`` may be 0 (no dense features): the output is then a learned constant vector.
    """

    def __init__(self, num_dense: int, layer_sizes: Sequence[int]) -> None:
        super().__init__()
        if num_dense < 0:
            raise ValueError(f"DenseArch: num_dense must be >= 0, got {num_dense}")
        sizes = _check_layer_sizes("DenseArch", layer_sizes, allow_empty=False)
        layers: List[nn.Module] = []
        prev = num_dense
        for size in sizes:
            layers += [_linear(prev, size), nn.ReLU(inplace=True)]  # on the Linear's own output
            prev = size
        self.num_dense = int(num_dense)
        self.output_dim = prev
        self.mlp = nn.Sequential(*layers)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, which the dense features must have."""
        return self.mlp[0].weight.dtype

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense)


class OverArch(nn.Module):
    """Top MLP: Linear + ReLU per layer, then a final Linear to one logit. [B, in_dim] -> [B, 1]."""

    def __init__(self, in_dim: int, layer_sizes: Sequence[int]) -> None:
        super().__init__()
        if in_dim <= 0:
            raise ValueError(f"OverArch: in_dim must be positive, got {in_dim}")
        sizes = _check_layer_sizes("OverArch", layer_sizes, allow_empty=True)
        layers: List[nn.Module] = []
        prev = in_dim
        for size in sizes:
            layers += [_linear(prev, size), nn.ReLU(inplace=True)]  # on the Linear's own output
            prev = size
        layers.append(_linear(prev, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features)


class InteractionArch(nn.Module):
    """Interface of the interaction layers: ``forward(dense [B, D], sparse) -> [B, output_dim]``."""

    @property
    def output_dim(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class DotInteraction(InteractionArch):
    """Pairwise dot products of the dense vector and the F sparse embeddings (all of width D).

    forward(dense [B, D], sparse [B, F, D]) -> [B, D + P]: the dense vector, then the dot products
    <v_i, v_j> of the F + 1 vectors (v_0 = dense, v_k = feature k) for i < j (i <= j with
    ``self_interaction``), in row-major order of (i, j). P = (F+1)F/2, or (F+1)(F+2)/2 with
    self-interaction. ``embedding_dim`` (D) is only needed for ``output_dim``.
    """

    def __init__(
        self, num_sparse_features: int, self_interaction: bool = False, embedding_dim: Optional[int] = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        if num_sparse_features < 0:
            raise ValueError(f"DotInteraction: num_sparse_features must be >= 0, got {num_sparse_features}")
        if kernel not in INTERACTION_KERNELS:
            raise ValueError(f"DotInteraction: kernel must be one of {INTERACTION_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.num_sparse_features = int(num_sparse_features)
        self.self_interaction = bool(self_interaction)
        self.embedding_dim = None if embedding_dim is None else int(embedding_dim)
        n = self.num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=0 if self_interaction else 1)
        # Index into the flattened [n, n] Gram matrix; not saved in checkpoints.
        self.register_buffer("flat_pair_index", rows * n + cols, persistent=False)

    @property
    def num_interactions(self) -> int:
        return int(self.flat_pair_index.numel())

    @property
    def output_dim(self) -> int:
        if self.embedding_dim is None:
            raise ValueError("DotInteraction.output_dim: build it with embedding_dim=D to know it")
        return self.embedding_dim + self.num_interactions

    def forward(self, dense: torch.Tensor, sparse: Union[torch.Tensor, ColumnBlocks]) -> torch.Tensor:
        """``sparse``: [B, F, D], or [B, F * D] as ``ColumnBlocks`` (a sharded collection's received
        parts), which the native kernel reads in place (any other path copies them together)."""
        batch, dim = dense.shape
        if isinstance(sparse, ColumnBlocks):
            if sparse.rows != batch or sparse.width != self.num_sparse_features * dim:
                raise ValueError(
                    f"DotInteraction: sparse must be [B, F * D] = [{batch}, {self.num_sparse_features * dim}] "
                    f"to match dense {tuple(dense.shape)}, got column blocks of {sparse.rows} x {sparse.width}"
                )
            if self._use_native(dense, sparse):
                return dot_interaction_blocks(dense, sparse, self.self_interaction)
            sparse = sparse.materialize().view(batch, self.num_sparse_features, dim)
        if sparse.shape != (batch, self.num_sparse_features, dim):
            raise ValueError(
                f"DotInteraction: sparse must be [B, F, D] = [{batch}, {self.num_sparse_features}, "
                f"{dim}] to match dense {tuple(dense.shape)}, got {tuple(sparse.shape)}"
            )
        if self._use_native(dense, sparse):
            return dot_interaction(dense, sparse, self.self_interaction)
        vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F+1, D]
        pairs = _PairwiseDots.apply(vectors, self.flat_pair_index)  # [B, P]
        return torch.cat([dense, pairs], dim=1)

    def _use_native(self, dense: torch.Tensor, sparse: Union[torch.Tensor, ColumnBlocks]) -> bool:
        if self.kernel == "torch":
            return False
        if native_interaction_supported(dense, sparse):
            reason = native_available()
        else:
            reason = f"the native interaction takes fp32 CPU tensors of dims 1 to {MAX_NATIVE_DIM}"
        if self.kernel == "native" and reason is not None:
            raise ValueError(f"DotInteraction: kernel='native' was asked for but {reason}")
        return reason is None


class _PairwiseDots(torch.autograd.Function):
    """pairs[b, k] = <v[b, i_k], v[b, j_k]> for the pairs named by ``flat_index`` (= i * n + j) of
    the Gram matrix v v^T. Autograd's own backward of ``bmm(v, v^T)`` runs two batched matmuls on
    transposed (strided) operands; since the Gram matrix is symmetric, the gradient is one:
    dv = (S + S^T) v with S the pair gradients scattered into [n, n]. Operands are contiguous
    (the strided bmm is ~1.5x slower on CPU). In the form torch.func's transforms and forward-mode
    AD take (a vmap rule generated, a jvp)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(vectors: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(vectors, vectors.transpose(1, 2).contiguous())
        return gram.flatten(1).index_select(1, flat_index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        vectors, flat_index = inputs
        ctx.save_for_backward(vectors, flat_index)
        ctx.save_for_forward(vectors, flat_index)

    @staticmethod
    def jvp(ctx, vectors_tangent: torch.Tensor, _index_tangent):
        vectors, flat_index = ctx.saved_tensors
        half = torch.bmm(vectors_tangent, vectors.transpose(1, 2))  # d(v v^T) = dv v^T + (dv v^T)^T
        return (half + half.transpose(1, 2)).flatten(1).index_select(1, flat_index)

    @staticmethod
    def backward(ctx, grad_pairs: torch.Tensor):
        vectors, flat_index = ctx.saved_tensors
        batch, n, _ = vectors.shape
        scattered = torch.zeros(batch, n * n, dtype=grad_pairs.dtype, device=grad_pairs.device)
        scattered = scattered.index_copy(1, flat_index, grad_pairs).view(batch, n, n)  # (out of place: vmap)
        return torch.bmm(scattered + scattered.transpose(1, 2), vectors), None


class DCNInteraction(InteractionArch):
    """DCN-v2 cross network over x0 = concat(dense, all sparse embeddings).

    x_{l+1} = x0 * (W_l x_l + b_l) + x_l for l < num_layers, with W_l = U_l V_l^T (rank
    ``low_rank``) when low_rank > 0. forward(dense [B, Dd], sparse [B, S] or [B, F, D])
    -> [B, input_dim] where input_dim = Dd + S.
    """

    def __init__(self, input_dim: int, num_layers: int, low_rank: int = 0) -> None:
        super().__init__()
        if input_dim <= 0 or num_layers < 0 or low_rank < 0:
            raise ValueError(
                f"DCNInteraction: need input_dim > 0, num_layers >= 0, low_rank >= 0; got "
                f"input_dim={input_dim}, num_layers={num_layers}, low_rank={low_rank}"
            )
        self.input_dim = int(input_dim)
        self.num_layers = int(num_layers)
        self.low_rank = int(low_rank)
        if low_rank == 0:
            self.cross = nn.ModuleList(_linear(input_dim, input_dim) for _ in range(num_layers))
        else:  # Each layer: V^T (no bias) down to low_rank, then U with the bias b_l.
            self.cross = nn.ModuleList(
                nn.Sequential(_linear(input_dim, low_rank, bias=False), _linear(low_rank, input_dim))
                for _ in range(num_layers)
            )

    @property
    def output_dim(self) -> int:
        return self.input_dim

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, sparse.flatten(1)], dim=1)
        if x0.shape[1] != self.input_dim:
            raise ValueError(
                f"DCNInteraction: dense {tuple(dense.shape)} + sparse {tuple(sparse.shape)} give "
                f"{x0.shape[1]} features, expected input_dim={self.input_dim}"
            )
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return x


def _normalize_embedding_dims(embedding_dims: EmbeddingDims) -> Tuple[Optional[List[str]], List[int]]:
    """-> (feature keys or None when only dims were given, per-feature dims)."""
    if isinstance(embedding_dims, KeyedTensor):
        return list(embedding_dims.keys), list(embedding_dims.length_per_key)
    if isinstance(embedding_dims, Mapping):
        return [str(k) for k in embedding_dims], [int(d) for d in embedding_dims.values()]
    items = list(embedding_dims)
    if items and all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
        return [str(k) for k, _ in items], [int(d) for _, d in items]
    if all(isinstance(x, numbers.Integral) for x in items):
        return None, [int(x) for x in items]
    raise TypeError(
        "DLRM: embedding_dims must be a list of ints, a {feature: dim} mapping, a list of "
        f"(feature, dim) pairs or a KeyedTensor; got {embedding_dims!r}"
    )


class DLRM(nn.Module):
    """DLRM: logits = over_arch(interaction(dense_arch(dense), sparse_arch(sparse))).

    Args:
        sparse_arch: module, KeyedJaggedTensor -> KeyedTensor (values [B, sum(dims)]).
        num_dense: number of dense features (>= 0).
        embedding_dims: per-feature embedding widths in the order the sparse arch emits them, as
            a list of ints, a {feature: dim} mapping, (feature, dim) pairs or a KeyedTensor. With
            feature names, a KeyedTensor in another key order is reordered to this one.
        dense_layers: bottom MLP widths; for "dot" the last must equal every feature dim.
        over_layers: top MLP hidden widths (a final Linear to 1 logit is added).
        interaction: "dot" or "dcn".
        dcn_num_layers, dcn_low_rank: cross layers and rank of W (0 = full) for "dcn".
        self_interaction: include <v_i, v_i> in "dot".
    """

    def __init__(
        self,
        sparse_arch: nn.Module,
        num_dense: int,
        embedding_dims: EmbeddingDims,
        dense_layers: Sequence[int],
        over_layers: Sequence[int],
        interaction: str = "dot",
        dcn_num_layers: int = 2,
        dcn_low_rank: int = 0,
        self_interaction: bool = False,
    ) -> None:
        super().__init__()
        keys, dims = _normalize_embedding_dims(embedding_dims)
        bad = [d for d in dims if d <= 0]
        if bad:
            raise ValueError(f"DLRM: embedding dims must be positive, got {dims}")
        if interaction not in INTERACTIONS:
            raise ValueError(f"DLRM: unknown interaction {interaction!r}; allowed: {list(INTERACTIONS)}")
        self.feature_keys: Optional[List[str]] = keys
        self.embedding_dims: List[int] = dims
        self.sparse_arch = sparse_arch
        self.dense_arch = DenseArch(num_dense, dense_layers)
        dense_dim = self.dense_arch.output_dim
        self.interaction_type = interaction
        if interaction == "dot":
            names = keys if keys is not None else [f"#{i}" for i in range(len(dims))]
            mismatched = {n: d for n, d in zip(names, dims) if d != dense_dim}
            if mismatched:
                raise ValueError(
                    f"DLRM: interaction='dot' needs every embedding dim equal to dense_layers[-1]="
                    f"{dense_dim}; features {mismatched} (feature: dim) differ. Change those dims "
                    f"or dense_layers, or use interaction='dcn'"
                )
            self.interaction: InteractionArch = DotInteraction(len(dims), self_interaction, dense_dim)
        else:
            if self_interaction:
                raise ValueError("DLRM: self_interaction applies only to interaction='dot'")
            self.interaction = DCNInteraction(dense_dim + sum(dims), dcn_num_layers, dcn_low_rank)
        self.over_arch = OverArch(self.interaction.output_dim, over_layers)

    def _sparse_values(self, pooled: KeyedTensor, batch: int) -> Union[torch.Tensor, ColumnBlocks]:
        """[B, sum(dims)] pooled embeddings in this model's feature order, checked; the dot
        interaction takes them as the column blocks a sharded sparse arch received, when in order."""
        in_order = self.feature_keys is None or pooled.keys == self.feature_keys
        if in_order:
            dims = pooled.length_per_key
        else:
            if sorted(pooled.keys) != sorted(self.feature_keys):
                raise ValueError(
                    f"DLRM: sparse_arch returned features {pooled.keys}, model expects "
                    f"{self.feature_keys}"
                )
            dims = [pooled.length_per_key[pooled.keys.index(k)] for k in self.feature_keys]
        if list(dims) != self.embedding_dims or pooled.batch_size != batch:
            raise ValueError(
                f"DLRM: sparse_arch returned [B={pooled.batch_size}] with dims {list(dims)}, expected "
                f"B={batch} and dims {self.embedding_dims} (keys {self.feature_keys})"
            )
        if not in_order:
            return torch.cat([pooled[k] for k in self.feature_keys], dim=1)
        if pooled.blocks is not None and self.interaction_type == "dot":
            return pooled.blocks
        return pooled.values

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """dense [B, num_dense] in the parameters' dtype (float32 unless the model was converted),
        sparse KeyedJaggedTensor with batch B -> logits [B]."""
        if dense.dim() != 2 or dense.shape[1] != self.dense_arch.num_dense:
            raise ValueError(
                f"DLRM: dense must be [B, {self.dense_arch.num_dense}], got {tuple(dense.shape)}"
            )
        if dense.dtype != self.dense_arch.dtype:
            raise ValueError(
                f"DLRM: dense must be {self.dense_arch.dtype} (the dtype of the model's parameters), got "
                f"{dense.dtype}; convert it with dense.to({self.dense_arch.dtype})"
            )
        batch = dense.shape[0]
        if isinstance(sparse, KeyedJaggedTensor) and sparse.batch_size != batch:
            raise ValueError(
                f"DLRM: dense has {batch} rows but the sparse KeyedJaggedTensor has batch_size="
                f"{sparse.batch_size}; both must hold the same samples (B rows each)"
            )
        # a sharded sparse arch returns its pooled rows through a collective: launch it first and
        # run the bottom MLP while the rows travel
        launch = getattr(self.sparse_arch, "forward_awaitable", None)
        pending = launch(sparse) if launch is not None else None
        dense_out = self.dense_arch(dense)  # [B, D]
        embedded = pending.wait() if pending is not None else self.sparse_arch(sparse)
        sparse_values = self._sparse_values(embedded, batch)  # [B, sum(dims)]
        if dense_out.dtype != torch.float32:  # pooled rows are fp32: a converted (bf16, fp64) model takes
            if isinstance(sparse_values, ColumnBlocks):  # them in its own dtype (the over-arch refused mixed ones)
                sparse_values = sparse_values.materialize()
            sparse_values = sparse_values.to(dense_out.dtype)
        if self.interaction_type == "dot" and isinstance(sparse_values, torch.Tensor):
            sparse_values = sparse_values.reshape(batch, len(self.embedding_dims), dense_out.shape[1])
        return self.over_arch(self.interaction(dense_out, sparse_values)).squeeze(-1)


def _sparse_arch_modules(model: nn.Module) -> List[nn.Module]:
    found = [m for name, m in model.named_modules() if name.split(".")[-1] == "sparse_arch"]
    if not found:
        raise ValueError(
            f"dense_parameters: {type(model).__name__} has no submodule named 'sparse_arch'"
        )
    return found


def dense_named_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter outside ``sparse_arch`` (works through wrappers such
    as DistributedDataParallel, whose submodule is ``module.sparse_arch``)."""
    sparse_ids = {id(p) for m in _sparse_arch_modules(model) for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in sparse_ids]


def dense_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Parameters outside ``sparse_arch``: the ones a dense torch optimizer should update."""
    return [p for _, p in dense_named_parameters(model)]
