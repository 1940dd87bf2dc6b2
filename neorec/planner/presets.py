"""Model presets for the planner: DLRM on Criteo (Kaggle, Terabyte) and Neo's Model-A/F/I.

    preset = get_model_preset("neo-model-f")
    preset.tables            # List[TableSpec]
    preset.settings          # PlanSettings defaults (precisions, tiers, optimizer, batch size)
    preset.dense             # DenseModel (MFLOPS per sample, dense parameters)

Criteo: the 26 categorical cardinalities of the Kaggle and Terabyte (MLPerf, 40M-row cap) data
sets, one id per sample per table, the DLRM reference MLPs. Neo: built from the paper's Table 3
(ISCA'22): parameters, number of tables (the order of magnitude, read as 1000 / 10 / 100), average
dim, average pooling, MFLOPS per sample, MLP layers x width, local batch. Table sizes and pooling
factors follow a power law (seeded, deterministic), scaled so that the totals match the table.
The paper's QPS are kept here only to be compared with, never used by the planner.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from neorec.planner.cost_model import PlanSettings, TableSpec
from neorec.planner.names import MODEL_PRESET_NAMES


def finite_non_negative(value) -> bool:
    """A real number (not a bool), finite and >= 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class DenseModel:
    """The dense part: MLP math per sample (forward) and parameters (all-reduced each step)."""

    mflops_per_sample: float = 0.0
    num_parameters: int = 0

    def __post_init__(self) -> None:
        for key in ("mflops_per_sample", "num_parameters"):
            value = getattr(self, key)
            if not finite_non_negative(value):
                raise ValueError(f"dense model: {key} must be a finite number >= 0, got {value!r}")


@dataclass
class ModelPreset:
    name: str
    tables: List[TableSpec]
    settings: PlanSettings
    dense: DenseModel
    paper_qps: Optional[float] = None                 # 16 ZionEX nodes, Neo Table 3
    paper_scaling_efficiency: Optional[float] = None  # 1 -> 16 nodes, Neo section 6
    notes: str = ""
    extra: Dict[str, float] = field(default_factory=dict)


CRITEO_KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                      5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
CRITEO_TERABYTE_ROWS = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                        11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]


def _mlp(sizes: Sequence[int]) -> tuple:
    """(forward MFLOPS per sample, parameters) of an MLP with layer widths ``sizes``."""
    params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    flops = sum(2 * a * b for a, b in zip(sizes[:-1], sizes[1:]))
    return flops / 1e6, params


def _dlrm(name: str, rows: List[int], dim: int, bottom: List[int], top: List[int]) -> ModelPreset:
    num_features = len(rows) + 1
    interactions = num_features * (num_features - 1) // 2
    bot_flops, bot_params = _mlp([13] + bottom)
    top_flops, top_params = _mlp([interactions + dim] + top)
    inter_flops = 2 * num_features * num_features * dim / 1e6
    tables = [TableSpec(f"t_cat_{i}", r, dim, 1.0) for i, r in enumerate(rows)]
    return ModelPreset(name, tables, PlanSettings(batch_size=2048),
                       DenseModel(bot_flops + top_flops + inter_flops, bot_params + top_params),
                       notes=f"26 tables, dim {dim}, one id per sample per table")


def _power_law_split(total: float, count: int, rng: random.Random, alpha: float = 1.0) -> List[float]:
    """``count`` positive numbers summing to ``total``, Zipf-like (rank^-alpha, shuffled)."""
    weights = [(i + 1) ** -alpha for i in range(count)]
    rng.shuffle(weights)
    scale = total / sum(weights)
    return [w * scale for w in weights]


def _dims(count: int, low: int, high: int, mean: float, rng: random.Random) -> List[int]:
    """Log-uniform dims in [low, high], multiples of 4, rescaled toward ``mean``."""
    raw = [math.exp(rng.uniform(math.log(low), math.log(high))) for _ in range(count)]
    factor = mean / (sum(raw) / count)
    return [int(min(high, max(low, round(d * factor / 4) * 4))) for d in raw]


def _neo(name: str, params: float, num_tables: int, dims: List[int], pooling: float, mflops: float,
         layers: int, width: int, batch: int, qps: float, scaling: Optional[float], seed: int) -> ModelPreset:
    rng = random.Random(seed)
    share = _power_law_split(params, num_tables, rng)   # parameters per table
    pools = _power_law_split(pooling * num_tables, num_tables, rng, alpha=0.5)
    tables = [TableSpec(f"t{i}", max(1, int(share[i] / dims[i])), dims[i], round(pools[i], 3))
              for i in range(num_tables)]
    # Neo trains with row-wise AdaGrad, fp16 rows where they must fit, the DRAM tier behind a
    # device cache, and quantized (fp16 forward / bf16 backward) all-to-alls: 2 bytes per value.
    settings = PlanSettings(batch_size=batch, optimizer="rowwise_adagrad", precisions=("fp32", "fp16"),
                            tiers=("device", "cached_dram", "dram"), comm_bytes=2)
    return ModelPreset(name, tables, settings, DenseModel(mflops, layers * width * width), qps, scaling,
                       notes=f"Neo Table 3: {params / 1e9:,.0f}B parameters, {num_tables} tables, "
                             f"{layers} MLP layers x {width}")


def neo_model_a() -> ModelPreset:
    rng = random.Random(1)
    return _neo("neo-model-a", 793e9, 1000, _dims(1000, 4, 384, 93, rng), 15, 638, 20, 3375, 512, 1.2e6, 0.5, 11)


def neo_model_f() -> ModelPreset:
    return _neo("neo-model-f", 12e12, 10, [256] * 10, 20, 5, 7, 490, 512, 1.7e6, None, 12)


def neo_model_i() -> ModelPreset:
    rng = random.Random(3)
    return _neo("neo-model-i", 332e9, 100, _dims(100, 8, 256, 92, rng), 70, 60, 43, 682, 2048, 3.4e6, 0.75, 13)


MODEL_PRESETS = {
    "dlrm-criteo-kaggle": lambda: _dlrm("dlrm-criteo-kaggle", CRITEO_KAGGLE_ROWS, 16, [512, 256, 64, 16],
                                        [512, 256, 1]),
    "dlrm-criteo-terabyte": lambda: _dlrm("dlrm-criteo-terabyte", CRITEO_TERABYTE_ROWS, 128, [512, 256, 128],
                                          [1024, 1024, 512, 256, 1]),
    "neo-model-a": neo_model_a,
    "neo-model-f": neo_model_f,
    "neo-model-i": neo_model_i,
}


assert tuple(MODEL_PRESETS) == MODEL_PRESET_NAMES


def get_model_preset(name: str) -> ModelPreset:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]()
