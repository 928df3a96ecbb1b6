"""The trained tiny model's schedule and seed: part of its cache key, so the key needs no
training code."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SEED = 0
# Bump when the training math, data or schedule changes: it is part of the cached model's key.
TRAIN_VERSION = 2


@dataclass(frozen=True)
class TrainSettings:
    """The schedule of `tinymodel.train.train`."""

    steps: int = 400
    batch: int = 16
    seq_len: int = 128
    lr: float = 1e-2
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    threads: int = 2

    def key(self) -> dict:
        return self.__dict__.copy()


def default_settings() -> TrainSettings:
    return TrainSettings()
