"""neorec's native CPU kernels: C sources compiled on first use (``build.py``) and run on a few
threads (``threads.py``). Users: the table-batched embedding op
(``neorec/embedding/kernels/native_tbe.py``), the DLRM dot interaction
(``neorec/model/native_interaction.py``) and the column-block copies of the sharded output
(``blocks.py``)."""

from neorec.native.build import NativeUnavailable, load, native_available

MAX_NATIVE_DIM = 1 << 16  # the kernels keep a [dim] fp32 row on the stack (256 KiB at this dim)

__all__ = ["MAX_NATIVE_DIM", "NativeUnavailable", "load", "native_available"]
