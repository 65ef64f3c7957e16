"""aiayn.train.config: reading [model], [data] and [train] from TOML, --set and Python, and what a mistake
there is told."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from aiayn import cli
from aiayn.config import ConfigError
from aiayn.data.dataset import refuse_other_tokenizer_settings, tokenizer_setting_changes
from aiayn.demo import DemoConfig
from aiayn.errors import UserError
from aiayn.train import resume
from aiayn.train.config import DataConfig, RunConfig, TrainConfig, load_config, run_config, toml_value
from aiayn.train.distributed import Dist


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


def test_run_config_takes_a_pathlib_path_for_a_path_setting_and_names_its_place_once():
    """run_config refused what DataConfig and TrainConfig take ("config: [data] train_src = PosixPath('a.de')
    is a PosixPath, expected str; config: [data] train_tgt = ..."), saying "config:" before every item."""
    config = run_config({"data": {"train_src": Path("a.de"), "train_tgt": Path("a.en")},
                         "train": {"run_dir": Path("runs/x"), "init_from": Path("ck")}})
    assert (config.data.train_src, config.data.train_tgt) == ("a.de", "a.en")
    assert (config.train.run_dir, config.train.init_from) == ("runs/x", "ck")
    json.dumps(config.to_dict())  # no PosixPath in what meta.json records
    with pytest.raises(ConfigError) as e:  # a Path is no seed, and "config:" is said once
        run_config({"data": {"vocab_size": "x"}, "train": {"seed": Path("x")}})
    assert str(e.value) == ("config: [data] vocab_size = 'x' is a str, expected int; "
                            f"[train] seed = {Path('x')!r} is a {type(Path('x')).__name__}, expected int")


def test_problems_written_in_one_place_name_it_once(tmp_path):
    """`--set model.d_model=33` named its item before each of its two problems; those of other places
    keep theirs."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.preset=micro", "model.d_model=33"])
    assert str(e.value) == ("--set 'model.d_model=33': model.d_model=33 is not divisible by model.n_heads=2; "
                            "model.d_model=33 must be even for sinusoidal positions")
    toml = tmp_path / "run.toml"
    toml.write_text("[data]\nmax_len = 1\n[train]\nwarmup = 0\nmax_tokens = 0\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(toml, ["data.vocab_size=2"])
    assert str(e.value) == (f"--set 'data.vocab_size=2': data.vocab_size=2 must be >= 8; {toml}:2: "
                            f"data.max_len=1 must be >= 2; {toml}:5: train.max_tokens=0 must be >= 1; "
                            f"{toml}:4: train.warmup=0 must be >= 1")


@pytest.mark.parametrize("line, said", [
    ('warmup = "4000"', ("[train] warmup = '4000' is a str, expected int; TOML numbers take no quotes: "
                         "warmup = 4000")),
    ("compile = 'true'", ("[train] compile = 'true' is a str, expected bool; TOML booleans take no quotes: "
                          "compile = true")),
    ("device = 0", "[train] device = 0 is an int, expected str; device is one of 'auto', 'cpu', 'cuda'"),
    ("run_dir = 5", "[train] run_dir = 5 is an int, expected str; TOML strings need quotes: run_dir = \"5\""),
    ("warmup = 'abc'", "[train] warmup = 'abc' is a str, expected int"),  # no number in quotes: no hint
])
def test_a_value_of_the_wrong_type_gets_the_hint_that_fits(tmp_path, line, said):
    """A number in quotes was refused with no hint, where a name without them got one; a number where a
    setting takes one of a few names was told to put it in quotes, which made it no name either."""
    toml = tmp_path / "run.toml"
    toml.write_text(f"[train]\n{line}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(toml)
    assert str(e.value) == f"{toml}:2: {said}"


def test_a_preset_written_as_a_number_is_told_the_presets(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\npreset = 5\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(toml)
    assert str(e.value) == (f"{toml}:2: [model] preset = 5 is an int, expected str; preset is one of 'base', "
                            "'big', 'small', 'tiny', 'micro'")


def test_a_set_number_in_quotes_is_told_to_drop_them():
    with pytest.raises(ConfigError) as e:
        load_config(None, ['train.warmup="4000"'])
    assert str(e.value) == ("--set 'train.warmup=\"4000\"': '4000' is a str, expected int (TOML numbers take "
                            "no quotes: train.warmup=4000)")


def test_training_files_left_empty_are_named_where_they_were_emptied(tmp_path, capsys, monkeypatch):
    """`--set data.train_src=` was refused as "data.train_src and data.train_tgt must name the training
    files", naming neither the item nor the line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text("[data]\ntrain_src = 'a.de'\ntrain_tgt = ''\n", encoding="utf-8")
    files = "data.train_src and data.train_tgt must name the training files"
    for args, place in ((["--config", "run.toml"], "run.toml:3: "),
                        (["--config", "run.toml", "--set", "data.train_src=", "--set", "data.train_tgt=b.en"],
                         "--set 'data.train_src=': ")):
        assert cli.main(["train", *args]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {place}{files}\n"
    assert cli.main(["train", "--set", "data.train_src="]) == 2  # no config: with how to give them
    said = capsys.readouterr().err
    assert said.startswith(f"aiayn: error: --set 'data.train_src=': {files} (give --config ")
    assert not (tmp_path / "runs").exists()


def test_a_json_file_given_as_config_says_what_to_do_instead(tmp_path, monkeypatch):
    """A run records its configuration only in its checkpoints' meta.json, and `--config` of one was "not
    valid TOML (Invalid statement at column 1)", no more."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000020"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text('{"config": {"train": {"warmup": 10}}}\n', encoding="utf-8")
    json_said = "not valid TOML (Invalid statement at column 1); --config takes a TOML file, and this is JSON"
    with pytest.raises(UserError) as e:
        load_config(checkpoint / "meta.json")
    assert str(e.value) == (f"{checkpoint / 'meta.json'}:1: {json_said} (a checkpoint's meta.json: to "
                            "continue its run, give the run's TOML file with --resume and "
                            f"train.run_dir={tmp_path / 'run'}; to fine-tune from it, "
                            f"train.init_from={checkpoint})")
    (tmp_path / "run.cfg").write_text('{"train": {}}\n', encoding="utf-8")
    with pytest.raises(UserError, match=rf"run\.cfg:1: {re.escape(json_said)}$"):
        load_config(tmp_path / "run.cfg")
    (tmp_path / "run.json").write_text("[train]\nwarmup = = 4\n", encoding="utf-8")  # TOML, named .json
    with pytest.raises(UserError, match=r"run\.json:2: not valid TOML \(Invalid value at column 10\)$"):
        load_config(tmp_path / "run.json")  # was told "this is JSON"


def test_values_are_said_as_toml_writes_them(tmp_path, caplog):
    """Refusals and notes said Python's True, False and None where the user writes TOML's true and false
    ("data.shared_vocab was True, now False; set data.shared_vocab=true")."""
    saved, now = {"shared_vocab": True, "spm_type": "bpe"}, {"shared_vocab": False, "spm_type": "unigram"}
    assert tokenizer_setting_changes(saved, now) == ["data.shared_vocab was true, now false",
                                                     "data.spm_type was 'bpe', now 'unigram'"]
    with pytest.raises(UserError, match=r"; set data\.shared_vocab=true and data\.spm_type='bpe', or use"):
        refuse_other_tokenizer_settings(tmp_path, saved, now)
    toml = tmp_path / "run.toml"
    toml.write_text("model = true\n[data]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r":1: model = true is not a table; write a \[model\] section$"):
        load_config(toml)
    config = load_config(None, ["train.compile=true"])
    with caplog.at_level(logging.INFO):
        resume._say_changed_settings(tmp_path, {"compile": False}, config, Dist(0, 1, 0, torch.device("cpu")))
    assert caplog.messages == [f"{tmp_path}: trained with train.compile=false, resumed with true"]
    # strings were Python's repr: 'C:\\runs' is two backslashes in TOML's '...', 'a\'b' is no TOML
    values = ["C:\\runs\\a", "it's", 'a\'b"c', "tab\there", "ünï", ["x", "y's"], 1e-05]
    said = [toml_value(v) for v in values]
    assert said[:2] == ["'C:\\runs\\a'", '"it\'s"'] and said[4:6] == ["'ünï'", "['x', \"y's\"]"]
    assert [tomllib.loads(f"x = {t}")["x"] for t in said] == values


def test_places_are_named_in_line_order(tmp_path):
    """A refusal's places followed the settings' order: "ed.toml:10 and ed.toml:16 and ed.toml:9"."""
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nseed = 2\nwarmup = 4\n[data]\nmax_len = 100\n", encoding="utf-8")
    config = load_config(toml, ["train.max_tokens=128"])
    said = config.written_where("train.max_tokens", "data.max_len", "train.seed", "train.warmup")
    assert said == f"{toml}:2 and {toml}:3 and {toml}:5 and --set 'train.max_tokens=128': "
