"""Sparse input formats and pooled outputs."""

from neorec.sparse.jagged import JaggedTensor, KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
