"""DLRM model: dense (bottom) MLP, interaction (dot, DCN), over (top) MLP around a sparse arch."""

from neorec.model.dlrm import (
    DCNInteraction,
    DenseArch,
    DLRM,
    DotInteraction,
    InteractionArch,
    OverArch,
    dense_named_parameters,
    dense_parameters,
    dlrm_init_,
)

__all__ = [
    "DCNInteraction",
    "DenseArch",
    "DLRM",
    "DotInteraction",
    "InteractionArch",
    "OverArch",
    "dense_named_parameters",
    "dense_parameters",
    "dlrm_init_",
]
