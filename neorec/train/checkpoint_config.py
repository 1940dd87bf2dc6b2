"""``[checkpoint]`` config section (see ``neorec/train/checkpoint.py``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from neorec.train.checkpoint_files import check_row_bits


@dataclass
class CheckpointConfig:
    """Checkpoints (sharded, crash-safe, incremental and quantized as in Check-N-Run).

    dir: where checkpoints go, one sub-directory ``step-<N>`` each ("" = no checkpoints).
    every_steps: save every N training steps (0 = only at the end of training).
    save_final: also save when training ends.
    incremental: after a full checkpoint, write only the embedding rows modified since the
        previous checkpoint (dense weights and optimizer state are always written whole).
    full_when_fraction_exceeds: take a full checkpoint instead when the increments since the last
        full one (this one included) would exceed this fraction of a full checkpoint's bytes.
    row_bits: embedding rows stored with 32 (fp32, exact), 8, 4 or 2 bits (per-row min/max
        quantization); optimizer state and dense weights stay fp32.
    keep_last: keep the newest N complete checkpoints (and the full ones their increments need).
    auto_resume: a worker restarted by ``torchrun --max-restarts`` resumes from the newest
        complete checkpoint in ``dir`` when its own torchrun job saved it.
    """

    dir: str = ""
    every_steps: int = 0
    save_final: bool = True
    incremental: bool = False
    full_when_fraction_exceeds: float = 0.5
    row_bits: int = 32
    keep_last: int = 3
    auto_resume: bool = True

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps must be >= 0, got {self.every_steps}")
        if not 0.0 < self.full_when_fraction_exceeds:
            raise ValueError(f"checkpoint.full_when_fraction_exceeds must be > 0, got {self.full_when_fraction_exceeds}")
        check_row_bits(self.row_bits)
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        defaults = {f.name: f.default for f in fields(self)}
        asked = [f"checkpoint.{key} = {str(getattr(self, key)).lower()}" for key in ("every_steps", "incremental",
                                                                                      "row_bits")
                 if getattr(self, key) != defaults[key]]
        if not self.dir and asked:  # (a run would save nothing, without a word)
            raise ValueError(f"{', '.join(asked)} but checkpoint.dir is empty, which turns checkpoints off: set "
                             f"checkpoint.dir to where they go, or leave those keys at their defaults")
        if self.dir and not self.every_steps and not self.save_final:  # (the same, the other way round)
            raise ValueError(f"checkpoint.dir = {self.dir!r} with checkpoint.every_steps = 0 and checkpoint.save_final "
                             f"= false: nothing would be saved there; set checkpoint.every_steps = N or "
                             f"checkpoint.save_final = true, or leave checkpoint.dir empty")
