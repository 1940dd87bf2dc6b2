"""neorec's native CPU kernels: C sources compiled on first use (``build.py``) and run on a few
threads (``threads.py``). Users: the table-batched embedding op
(``neorec/embedding/kernels/native_tbe.py``), the DLRM dot interaction
(``neorec/model/native_interaction.py``) and the column-block copies of the sharded output
(``blocks.py``)."""

from neorec.native.build import NativeUnavailable, load, native_available

__all__ = ["NativeUnavailable", "load", "native_available"]
