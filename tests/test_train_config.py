"""aiayn.train.config: reading [model], [data] and [train] from TOML, --set and Python, and what a mistake
there is told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.config import ConfigError
from aiayn.demo import DemoConfig
from aiayn.train.config import DataConfig, RunConfig, TrainConfig


def test_path_settings_take_a_pathlib_path_and_keep_it_as_a_string():
    """`TrainConfig(run_dir=Path('x'))` was refused ("has type PosixPath, expected <class 'str'>"); a path
    is kept as its str, so that the config is written to meta.json and compares as one read from TOML."""
    train = TrainConfig(run_dir=Path("runs/x"), init_from=Path("ck"))
    assert (train.run_dir, train.init_from) == ("runs/x", "ck")
    assert train == TrainConfig("runs/x", init_from="ck")
    files = ["a.de", "a.en", "v.de", "v.en"]
    data = DataConfig(*map(Path, files))
    assert [data.train_src, data.train_tgt, data.valid_src, data.valid_tgt] == files
    json.dumps(RunConfig(data=data, train=train).to_dict())  # no PosixPath in what meta.json records
    assert DemoConfig(out=Path("out")).out == "out"
    with pytest.raises(ConfigError, match=r"^TrainConfig\.run_dir=3 has type int, expected str$"):
        TrainConfig(run_dir=3)
    with pytest.raises(ConfigError, match=r"^TrainConfig\.seed=2\.0 has type float, expected int$"):
        TrainConfig(seed=2.0)
