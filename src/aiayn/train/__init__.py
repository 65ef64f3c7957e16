"""Training: the loss, the schedule, batching by tokens, checkpoints, many processes, `loop.train(config)`.

    from aiayn.train import load_config, train
    train(load_config("configs/tiny.toml", ["train.max_updates=100"]))

`train`, `load_config`, `run_config` and the configuration's classes (`RunConfig` of a `DataConfig` and a
`TrainConfig`) are imported on first use: `aiayn.train.config`, which every `aiayn` command reads, would
otherwise import the training loop, and torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiayn.train.config import DataConfig, RunConfig, TrainConfig, load_config, run_config
    from aiayn.train.loop import train

__all__ = ["DataConfig", "RunConfig", "TrainConfig", "load_config", "run_config", "train"]
# where each of __all__ is defined
_HOMES = {"train": "aiayn.train.loop"} | {name: "aiayn.train.config" for name in __all__ if name != "train"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'aiayn.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
