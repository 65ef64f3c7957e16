"""`aiayn train` on bad input: one line naming the file or setting, a non-zero exit, nothing lost.

Each test is a known failure: a diverging run, a resumed finished run, an unusable run_dir, a full disk,
a vocabulary SentencePiece cannot build, a malformed config or checkpoint, a stale tokenizer.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import logging
import math
import os
import re
import threading
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from train_helpers import in_job, set_args, tiny_config, write_corpus

from aiayn import cli
from aiayn.checkpoint import read_meta
from aiayn.config import ConfigError, model_config
from aiayn.data.dataset import (
    EncodedCorpus,
    check_tokenizer_inputs,
    read_lines,
    tokenizer_inputs,
    tokenizer_settings,
    write_tokenizer_inputs,
)
from aiayn.data.tokenizer import train_sentencepiece
from aiayn.errors import CorruptFile, Stopped, UserError
from aiayn.model import Transformer
from aiayn.train import distributed, loop
from aiayn.train.config import DataConfig, RunConfig, TrainConfig, load_config, run_config, with_train
from aiayn.train.loop import Data, _check_finite_weights, train, validate
from aiayn.train.resume import _kept_product, _other_batches, _resume_refusal, _say_other_validation
from aiayn.train.state import checkpoint_dirs, prune


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    """`train.threads=1` sets the process' thread count; give the other tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run that reached max_updates=4, with checkpoints at updates 2 and 4."""
    d = tmp_path_factory.mktemp("finished")
    config, sets = tiny_config(d, d / "run", "train.max_updates=4", "train.valid_every=2")
    train(config)
    return d, config, sets


def copy_run(finished_run, tmp_path: Path):
    """A copy of the finished run to damage or continue; its config pointed at the copy."""
    d, config, _ = finished_run
    shutil.copytree(d / "run", tmp_path / "run")
    return with_train(config, run_dir=str(tmp_path / "run"))


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_checkpoint_prune_was_deleting_when_killed_goes_at_the_next_start(finished_run, tmp_path):
    """prune hides an old checkpoint (.step_N.deleting) and then deletes it; a kill between the two left it
    for good when the run was resumed after its last save: with nothing to train, it never pruned again."""
    config = copy_run(finished_run, tmp_path)
    hidden = tmp_path / "run" / "checkpoints" / ".step_000001.deleting"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_000002", hidden)  # a full checkpoint's files
    assert train(config, resume=True)["step"] == 4  # nothing to train
    assert not hidden.exists()
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_000002", "step_000004"]


def test_a_resume_drops_the_log_of_an_abandoned_continuation(finished_run, tmp_path):
    """A continuation past update 4 killed before its next checkpoint logged updates 5 to 7; the resumed
    run ends at 6. Its curves held both runs' updates 5 and 6, and the dead run's 7 after its end."""
    from aiayn.train.metrics import read_metrics

    config = copy_run(finished_run, tmp_path)
    log_file = tmp_path / "run" / "metrics.jsonl"
    before = read_metrics(log_file)
    with open(log_file, "a", encoding="utf-8") as f:
        abandoned = ({"step": s, "epoch": 9, "loss": 99.0, "nll": 99.0, "lr": 1.0} for s in (5, 6, 7))
        f.writelines(json.dumps(record) + "\n" for record in abandoned)
    train(with_train(config, max_updates=6), resume=True)
    after = read_metrics(log_file)
    assert after[: len(before)] == before
    new = after[len(before):]
    assert new and all(4 < r["step"] <= 6 and r.get("loss") != 99.0 for r in new), new


# 1. Non-finite values: stop before saving, keep every good checkpoint.


@pytest.mark.parametrize(
    ("extra", "caught_by"),
    [
        (["train.log_every=1"], "training loss"),  # where the training loss is logged
        (["train.log_every=100"], "training loss"),  # no log line: the unlogged losses before the save
        (["train.log_every=100", "train.valid_every=1"], "validation loss"),  # huge but finite weights
    ],
)
def test_a_diverging_run_stops_before_saving_and_keeps_its_checkpoints(finished_run, tmp_path, extra, caught_by):
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    before = {p.name: load_file(str(p / "model.safetensors")) for p in checkpoint_dirs(run)}
    sets = finished_run[2] + ["train.max_updates=12", "train.keep_last=2", "train.lr_scale=1e30", *extra]
    diverging = with_train(load_config(None, sets), run_dir=str(run))
    with pytest.raises(UserError, match=rf"update \d+: {caught_by} is (nan|inf); training diverged and "
                                        r"stopped before saving \(no checkpoint holds its weights\)"):
        train(diverging, resume=True)
    assert sorted(before) == [p.name for p in checkpoint_dirs(run)] == ["step_000002", "step_000004"]
    latest = load_file(str(checkpoint_dirs(run)[-1] / "model.safetensors"))
    assert all(torch.equal(latest[k], before["step_000004"][k]) for k in latest)


def test_nan_weights_are_never_saved():
    model = Transformer(model_config("micro", vocab_size=50))
    _check_finite_weights(model, 1)  # finite: no error
    with torch.no_grad():
        dict(model.named_parameters())["encoder.0.feed_forward.w_1.weight"][0, 0] = math.nan
    with pytest.raises(UserError, match="update 7: a model weight is nan"):
        _check_finite_weights(model, 7)


@pytest.mark.parametrize(
    "changes",
    [
        {"lr_scale": -1.0},
        {"lr_scale": math.nan},
        {"lr_scale": math.inf},
        {"max_updates": -1},
        {"max_minutes": math.nan},
        {"max_minutes": math.inf},
        {"patience": -1},
        {"clip_norm": -0.5},
        {"run_dir": ""},
    ],
)
def test_train_config_rejects_numbers_that_cannot_train(changes):
    name = next(iter(changes))
    with pytest.raises(ConfigError, match=f"train.{name}"):
        TrainConfig(**changes)


def test_a_negative_count_is_told_what_its_own_zero_means():
    """One "(0 = no limit / off)" served all five: train.threads=-1 read that 0 turned threads off, where
    it is PyTorch's default."""
    for name, zero in [("threads", "PyTorch's default"), ("max_updates", "no limit"),
                       ("max_epochs", "no limit"), ("patience", "never stop early"),
                       ("bleu_every", "no validation BLEU")]:
        with pytest.raises(ConfigError, match=rf"^train.{name}=-1 must be >= 0 \(0 = {zero}\)$"):
            TrainConfig(**{name: -1})


def test_train_config_keeps_zero_as_off():
    config = TrainConfig(lr_scale=0.0, max_updates=0, max_minutes=0.0, patience=0, clip_norm=0.0)
    assert config.max_updates == 0


def test_a_leading_tilde_in_a_path_is_the_home_directory(tmp_path, monkeypatch):
    # neither TOML nor the shell expands it (`--set train.run_dir=~/x`): unexpanded, a directory named ~
    # appeared in the working directory
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    toml = tmp_path / "run.toml"
    toml.write_text('[data]\ntrain_src = "~/c/train.en"\n[train]\nrun_dir = "~/runs/a"\n', encoding="utf-8")
    config = load_config(toml, ["data.train_tgt=~/c/train.de", "train.init_from=~/ckpt", "data.valid_src=a~b",
                                "data.valid_tgt=~"])
    home = str(tmp_path / "home")
    assert config.data.train_src == f"{home}/c/train.en" and config.data.train_tgt == f"{home}/c/train.de"
    assert config.train.run_dir == f"{home}/runs/a" and config.train.init_from == f"{home}/ckpt"
    assert config.data.valid_src == "a~b" and config.data.valid_tgt == home  # a leading ~ only
    # the dataclasses themselves, as a notebook builds them: TrainConfig(run_dir="~/x") made ./~/x
    made = (TrainConfig(run_dir="~/runs/b", init_from="~/ck"),
            DataConfig(train_src="~/t.en", valid_src="~/v.en", valid_tgt="~x"))
    assert (made[0].run_dir, made[0].init_from) == (f"{home}/runs/b", f"{home}/ck")
    assert made[1].train_src == f"{home}/t.en" and made[1].valid_tgt == os.path.expanduser("~x")
    assert with_train(config, run_dir="~/runs/c").train.run_dir == f"{home}/runs/c"


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer.json", "meta.json", "spm.model"])
def test_a_damaged_latest_checkpoint_names_the_one_to_resume_from(finished_run, tmp_path, damaged):
    """A checkpoint a failing disk truncated stops --resume with the way out; taking it brings the run
    back to the checkpoint before, which then trains on."""
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    run = Path(config.train.run_dir)
    latest = checkpoint_dirs(run)[-1]
    path = latest / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # spm.model: "not a SentencePiece model", without the way out before
    said = rf"{damaged}: (corrupt|not a|damaged or cut short) .*; to resume from step_000002"
    with pytest.raises(UserError, match=said):
        train(config, resume=True)
    latest.rename(tmp_path / "damaged")
    assert train(config, resume=True)["step"] == 6


@pytest.mark.parametrize("damage, said", [("nan", r"1 tensor\(s\) hold NaN or infinite values .*"),
                                          ("missing", r"weights do not fit this model: missing \[.*\]"),
                                          ("shape", r"weights do not fit this model: wrong shape \[.*\]")])
def test_weights_of_the_latest_checkpoint_that_are_damaged_name_the_file_and_the_one_to_resume_from(
        finished_run, tmp_path, damage, said):
    """A NaN named the checkpoint directory ("step_000004: 1 tensor(s) hold NaN"), not its weights file; a
    tensor missing or of another shape (the model is meta.json's, which --resume compared with [model]) was
    said without the way out, resuming from the checkpoint before."""
    from safetensors.torch import save_file

    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    latest = checkpoint_dirs(Path(config.train.run_dir))[-1]
    weights = load_file(str(latest / "model.safetensors"))
    name = next(iter(weights))
    if damage == "nan":
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] = float("nan")
    elif damage == "missing":
        del weights[name]
    else:
        weights[name] = weights[name][:1].clone()
    save_file(weights, str(latest / "model.safetensors"))
    named = re.escape(str(latest / "model.safetensors"))
    with pytest.raises(CorruptFile, match=rf"^{named}: {said}; to resume from step_000002 instead"):
        train(config, resume=True)


def test_compile_without_a_cxx_compiler_is_refused_before_any_work(finished_run, tmp_path, monkeypatch):
    """inductor's CPU code is C++: without a compiler, a 180-line traceback at the first update, with the
    tokenizer and cache made for nothing."""
    from aiayn.decoding import compiled

    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: False)
    config = with_train(finished_run[1], run_dir=str(tmp_path / "fresh"), compile=True)
    with pytest.raises(ConfigError, match=r"^train.compile=true on a CPU needs the C\+\+ compiler"):
        train(config)
    assert not (tmp_path / "fresh").exists()


def test_a_compiler_that_cannot_build_is_refused_before_any_work(finished_run, tmp_path, monkeypatch):
    """A g++ without Python's headers, a broken or empty $CXX: on PATH (or read as g++), so the check
    passed, and the first update failed in a 190-line traceback after the tokenizer and the encoding."""
    from aiayn.decoding import compiled

    config = with_train(finished_run[1], run_dir=str(tmp_path / "fresh"), compile=True)
    monkeypatch.setenv("CXX", "")  # inductor runs "" (Permission denied); it passed as g++
    with pytest.raises(ConfigError, match=r"^train.compile=true on a CPU needs a C\+\+ compiler, and CXX is "
                                          r"set but empty: unset it"):
        train(config)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: True)

    def cannot_build(*args, **kwargs):
        raise RuntimeError("C++ compile error\n\nCommand:\ng++ x.cpp\n\nOutput:\nx.cpp:1:10: fatal error: "
                           "Python.h: No such file or directory\ncompilation terminated.")

    monkeypatch.setattr(torch, "compile", cannot_build)
    with pytest.raises(UserError, match=r"^train.compile=true: torch.compile failed here: C\+\+ compile "
                                        r"error \(x.cpp:1:10: fatal error: Python.h: No such file or "
                                        r"directory\); or set train.compile=false$"):
        train(config)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("key, value, message", [
    ("precision", "fp16", "train.precision='fp16' needs a GPU (use 'bf16' on a CPU)"),
    ("device", "cuda", "train.device='cuda', but PyTorch sees no CUDA GPU; use 'auto' or 'cpu'"),
    ("compile", True, "train.compile=true on a CPU needs the C++ compiler"),
])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_setting_this_machine_refuses_is_named_where_it_was_written(tmp_path, monkeypatch, capsys,
                                                                       key, value, message, rank):
    """README: refused settings are "each named where it was written"; fp16 on a CPU, device = "cuda"
    without a GPU and compile without a compiler named no file and no line. Under torchrun process 0
    alone says them, as it does load_config's refusals."""
    from aiayn.decoding import compiled

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: False)
    with monkeypatch.context() as job:
        in_job(job, rank)
        toml, written = tmp_path / "run.toml", json.dumps(value)  # "fp16", true: as TOML writes them
        toml.write_text(f'[train]\nrun_dir = "{tmp_path / "run"}"\n{key} = {written}\n', encoding="utf-8")
        assert cli.main(["train", "--config", str(toml)]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"aiayn: error: {toml}:3: {message}") if rank == "0" else said == ""
    item = f"train.{key}={written.strip(chr(34))}"
    with pytest.raises(ConfigError, match=rf"^--set {re.escape(repr(item))}: {re.escape(message)}"):
        train(load_config(None, [f"train.run_dir={tmp_path / 'run'}", item]))
    config = with_train(load_config(toml), max_updates=1)  # replaced since, but not this setting
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(toml))}:3: {re.escape(message)}"):
        train(config)
    with pytest.raises(ConfigError, match=rf"^{re.escape(message)}"):  # a value no file or --set wrote
        train(with_train(load_config(None, [f"train.run_dir={tmp_path / 'run'}"]), **{key: value}))
    assert not (tmp_path / "run").exists()


def test_a_compiler_that_cannot_build_is_named_with_where_compile_was_set(tmp_path, monkeypatch):
    from aiayn.decoding import compiled

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: True)

    def cannot_build(*args, **kwargs):
        raise RuntimeError("C++ compile error")

    monkeypatch.setattr(torch, "compile", cannot_build)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[train]\nrun_dir = "{tmp_path / "run"}"\ncompile = true\n', encoding="utf-8")
    message = "train.compile=true: torch.compile failed here: C++ compile error; or set train.compile=false"
    with pytest.raises(UserError, match=rf"^{re.escape(str(toml))}:3: {re.escape(message)}$"):
        train(load_config(toml))


def test_another_precision_on_resume_is_said(finished_run, tmp_path, caplog):
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6, precision="bf16")
    with caplog.at_level(logging.INFO):
        assert train(config, resume=True)["step"] == 6
    assert "step_000004: trained with train.precision='fp32', resumed with 'bf16'" in caplog.text


def test_another_number_of_cpu_threads_on_resume_is_said(finished_run, tmp_path, caplog):
    """Another count sums in another order, which changes the weights as another precision does, unsaid:
    train.threads, or its 0 (the machine's count) on a machine with other cores. Compared as counted where
    the checkpoint records the count, else as set."""
    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    before = torch.get_num_threads()

    def said(updates: int, threads: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            result = train(with_train(config, max_updates=updates, threads=threads), resume=True)
        assert result["step"] == updates
        return [m.partition(": ")[2] for m in caplog.messages if "threads" in m and "resumed" in m]

    try:
        torch.set_num_threads(2)  # the count train.threads=0 takes
        assert said(5, 2) == ["CPU threads trained with 1, resumed with 2 (train.threads=2)"]
        assert said(6, 0) == []  # 2 threads either way
        torch.set_num_threads(3)
        assert said(7, 0) == ["CPU threads trained with 2, resumed with 3 (train.threads=0)"]
        meta_path = checkpoints / "step_000007" / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["threads"]  # saved before aiayn recorded the count
        meta_path.write_text(json.dumps(meta))
        assert said(8, 1) == ["trained with train.threads=0, resumed with 1"]
        meta_path = checkpoints / "step_000008" / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["threads"] = None  # trained on a GPU: was said as "CPU threads trained with 16", not the device
        meta_path.write_text(json.dumps(meta))
        assert said(9, 2) == []
    finally:
        torch.set_num_threads(before)


def test_the_tokenizer_found_is_logged_with_its_pieces(finished_run, tmp_path, caplog):
    config = with_train(copy_run(finished_run, tmp_path), max_updates=5)
    with caplog.at_level(logging.INFO):
        assert train(config, resume=True)["step"] == 5
    # was "(40, shared pieces)"
    assert f"{config.train.run_dir}: using the tokenizer there (40 pieces, shared)" in caplog.messages


def test_other_optimisation_settings_on_resume_are_said_one_line_each(finished_run, tmp_path, caplog):
    """Another lr_scale, warmup, cooldown, label_smoothing or clip_norm took effect on --resume without a
    word in the log, where another precision or Adam's betas were said."""
    changes = {"lr_scale": 2.0, "warmup": 8, "cooldown": 0.5, "label_smoothing": 0.2, "clip_norm": 1.0}
    config = with_train(copy_run(finished_run, tmp_path), max_updates=5, **changes)
    with caplog.at_level(logging.INFO):
        assert train(config, resume=True)["step"] == 5
    trained, checkpoint = finished_run[1].train, tmp_path / "run" / "checkpoints" / "step_000004"
    said = [m for m in caplog.messages if m.startswith(f"{checkpoint}: trained with")]
    changes["max_updates"] = 5  # the cooldown's lr follows it (below)
    assert said == [f"{checkpoint}: trained with train.{key}={getattr(trained, key)!r}, resumed with "
                    f"{value!r}" for key, value in changes.items()]


def test_another_bleu_lang_on_resume_is_said_where_bleu_is_scored(finished_run, tmp_path, caplog):
    """Another train.bleu_lang on --resume (as the training note advises for Chinese) put char BLEU after
    13a BLEU in one series, unsaid."""
    config = copy_run(finished_run, tmp_path)
    changed = ["trained with train.bleu_lang='th', resumed with ''"]
    for step, bleu_lang, said in ((5, "th", []),  # BLEU scored after the resume only: no series to break
                                  (6, "th", []), (7, "", changed)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert train(with_train(config, max_updates=step, bleu_every=1, bleu_lang=bleu_lang),
                         resume=True)["step"] == step
        assert [m.split(": ", 1)[1] for m in caplog.messages if ": trained with" in m] == said


def test_another_budget_on_resume_is_said_where_a_cooldown_makes_the_lr_follow_it(finished_run, tmp_path,
                                                                                   caplog):
    """With train.cooldown, the lr is a fraction of the budget left: another max_updates on --resume moved
    it (12 times higher in the probe) with no line, where another lr_scale or warmup was said."""
    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"

    def said(resumed_from: int, **changes) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            train(with_train(config, **changes), resume=True)
        return [m.partition(": trained with ")[2] for m in caplog.messages
                if m.startswith(f"{checkpoints / f'step_{resumed_from:06d}'}: trained with")]

    assert said(4, max_updates=5) == []  # no cooldown: the budget moves no lr
    assert said(5, max_updates=6, max_epochs=50, cooldown=0.5) == [
        "train.cooldown=0.0, resumed with 0.5", "train.max_updates=5, resumed with 6",
        "train.max_epochs=0, resumed with 50"]
    assert said(6, max_updates=7, max_epochs=50, cooldown=0.5) == ["train.max_updates=6, resumed with 7"]
    # a cooldown trained with and dropped: the lr it had at update 7 is gone
    assert said(7, max_updates=8, max_minutes=60.0) == [
        "train.cooldown=0.5, resumed with 0.0", "train.max_updates=7, resumed with 8",
        "train.max_epochs=50, resumed with 0", "train.max_minutes=0.0, resumed with 60.0"]


def test_the_result_line_names_the_best_checkpoint_also_when_a_resume_trains_nothing(finished_run, tmp_path,
                                                                                      capsys, monkeypatch):
    """`aiayn train --resume` of a finished run printed nothing on stdout, where a run that trained printed
    its result line; neither named the best checkpoint, the one pruning keeps."""
    _, _, sets = finished_run
    run = copy_run(finished_run, tmp_path).train.run_dir
    checkpoints = Path(run) / "checkpoints"

    def expected(step: int) -> str:
        saved = checkpoints / f"step_{step:06d}"
        m = json.loads((saved / "meta.json").read_text())["metrics"]
        best = json.loads((saved / "trainer.json").read_text())["state"]["best_step"]
        return (f"step {step}: valid loss {m['valid_loss']:.4f}, valid NLL {m['valid_nll']:.4f}, valid ppl "
                f"{m['valid_ppl']:.2f} (max_updates={step}); best checkpoint "
                f"{checkpoints / f'step_{best:06d}'}\n")

    args = ["train", *set_args(sets), "--set", f"train.run_dir={run}", "--resume"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out == expected(4)  # nothing trained: the finished run's line
    assert cli.main([*args, "--set", "train.max_updates=6"]) == 0
    assert capsys.readouterr().out == expected(6)
    assert cli._train_summary({"step": 6, "stop": "max_updates=6"}) == "step 6 (max_updates=6)"  # unvalidated
    monkeypatch.setattr(sys, "stdout", None)  # started with stdout closed (pythonw, `>&-`): trains, no line
    assert cli.main([*args, "--set", "train.max_updates=8"]) == 0
    monkeypatch.undo()
    assert (checkpoints / "step_000008").is_dir() and capsys.readouterr().out == ""


def test_a_training_state_without_its_step_is_refused(finished_run, tmp_path):
    """trainer.json's "state" emptied by a hand: every field took its default, so --resume trained from
    update 0 on the trained weights and Adam moments, and saved over the checkpoints it had."""
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    latest = checkpoint_dirs(Path(config.train.run_dir))[-1]
    trainer = json.loads((latest / "trainer.json").read_text())
    (latest / "trainer.json").write_text(json.dumps({**trainer, "state": {}}))
    with pytest.raises(UserError, match=rf"^{latest / 'trainer.json'}: corrupt training state \(step=0, but "
                                        r"meta.json says 4\); to resume from step_000002"):
        train(config, resume=True)


def test_the_run_directorys_damaged_tokenizer_is_not_blamed_on_a_checkpoint(finished_run, tmp_path):
    """The run's own spm.model truncated, every checkpoint whole: --resume advised moving the newest
    checkpoint out, which mended nothing and gave up its training; empty, it was a ValueError traceback."""
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    spm_model = Path(config.train.run_dir) / "spm.model"
    whole = spm_model.read_bytes()
    for damaged in (whole[: len(whole) // 2], b""):
        spm_model.write_bytes(damaged)
        with pytest.raises(UserError) as e:
            train(config, resume=True)
        assert str(e.value).startswith(f"{spm_model}: ") and "to resume from" not in str(e.value)
        assert str(e.value).endswith("; delete it: --resume puts the checkpoint's copy back, a run without "
                                     "checkpoints trains a new one")  # the way out, said
    spm_model.unlink()  # the way out: resuming writes the checkpoint's copy back
    assert train(config, resume=True)["step"] == 6
    assert spm_model.read_bytes() == whole


@pytest.mark.parametrize("lost", ["meta.json", "spm.model", "trainer.safetensors"])
def test_a_latest_checkpoint_missing_a_file_names_the_one_to_resume_from(finished_run, tmp_path, lost):
    """A file gone from the newest checkpoint (a failing disk, a hand's rm) is damage too: the same way
    out as a truncated one, where it stopped with no hint ("not an aiayn checkpoint", "SentencePiece
    model not found")."""
    config = copy_run(finished_run, tmp_path)
    latest = checkpoint_dirs(Path(config.train.run_dir))[-1]
    (latest / lost).unlink()
    with pytest.raises(UserError, match=r"; to resume from step_000002 instead, move .*step_000004 out of "):
        train(with_train(config, max_updates=6), resume=True)


def test_resuming_removes_what_a_killed_run_was_writing(finished_run, tmp_path):
    """A run killed while encoding its corpus or writing its tokenizer leaves a hidden temporary named by
    its process; the next run removes it (a cache's is hundreds of MB), and keeps a live writer's however
    long it sits unchanged."""
    import subprocess
    import sys
    import time

    from aiayn.files import _writer

    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    dead, parent = _writer(exited.pid), _writer(os.getppid())
    killed = [run / "cache" / f".train.de-train.en.0123456789abcdef.safetensors.aiayn-{dead}.tmp",
              run / f".spm.model.aiayn-{dead}.tmp"]
    live = run / "cache" / f".valid.de-valid.en.0123456789abcdef.safetensors.aiayn-{parent}.tmp"
    for p in (*killed, live):
        p.write_bytes(b"half")
        os.utime(p, (time.time() - 7200, time.time() - 7200))  # the live one between two writes
    assert train(with_train(config, max_updates=6), resume=True)["step"] == 6
    assert not any(p.exists() for p in killed) and live.exists()  # the parent process: alive


def test_a_refused_resume_setting_gets_no_move_it_out_hint(finished_run, tmp_path):
    config = copy_run(finished_run, tmp_path)
    with pytest.raises(UserError) as e:
        train(with_train(config, seed=99, max_updates=6), resume=True)
    assert "train.seed" in str(e.value) and "move" not in str(e.value)


# 2. Resuming a finished run trains nothing.


def test_resuming_a_run_at_max_updates_trains_nothing(finished_run, tmp_path):
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    before = load_file(str(checkpoint_dirs(run)[-1] / "model.safetensors"))
    result = train(config, resume=True)
    assert result["step"] == 4 and result["stop"] == "max_updates=4"
    assert [p.name for p in checkpoint_dirs(run)] == ["step_000002", "step_000004"]
    after = load_file(str(checkpoint_dirs(run)[-1] / "model.safetensors"))
    assert all(torch.equal(after[k], before[k]) for k in after)


NO_SIGHUP = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this system")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT,
                                    pytest.param(getattr(signal, "SIGHUP", None), marks=NO_SIGHUP)])
def test_a_signal_saves_the_update_it_stopped_at_and_resume_ends_where_an_unbroken_run_does(
    finished_run, tmp_path, monkeypatch, capsys, signum, ctrl_c_handled, hangup_caught
):
    """SIGTERM (a scheduler's), SIGHUP (a closed terminal: it killed the run, nothing saved) or a first
    Ctrl-C at update 3 of 4, between the checkpoints at 2 and 4: update 3 is saved instead of lost, the
    exit status is the shell's for the signal, and --resume ends at update 4 with the weights of the run
    that was never stopped."""
    d, config, sets = finished_run
    before = signal.getsignal(signum)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("spm.model", "tokenizer_inputs.json"):  # the same tokenizer as the unbroken run
        shutil.copy(d / "run" / name, run / name)
    real_step, calls = loop.train_step, []

    def step_then_signal(*args, **kwargs):
        result = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signum)  # delivered now, in the main thread: mid-loop, as from outside
        return result

    monkeypatch.setattr(loop, "train_step", step_then_signal)
    args = set_args(sets[:-2] + [f"train.run_dir={run}", "train.max_updates=4", "train.valid_every=2"])
    code, err = run_cli(capsys, "train", *args)
    assert code == 128 + signum
    assert err[-1] == f"aiayn: stopped by {signal.Signals(signum).name} at update 3, saved in {run}/checkpoints/" \
                      "step_000003; --resume (resume=True in Python) continues from there"
    assert [p.name for p in checkpoint_dirs(run)] == ["step_000002", "step_000003"]
    assert signal.getsignal(signum) == before  # handlers given back
    monkeypatch.setattr(loop, "train_step", real_step)
    assert train(with_train(config, run_dir=str(run)), resume=True)["step"] == 4
    resumed = load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors"))
    unbroken = load_file(str(d / "run" / "checkpoints" / "step_000004" / "model.safetensors"))
    assert all(torch.equal(resumed[k], unbroken[k]) for k in unbroken)
    # and the checkpoints too: the signal's step_000003 counted toward keep_last, and average --last read it
    assert [p.name for p in checkpoint_dirs(run)] == [p.name for p in checkpoint_dirs(d / "run")]


def test_a_signals_checkpoint_never_counts_toward_keep_last_and_goes_once_a_newer_one_is_saved(tmp_path):
    """keep_last=2 over regular saves at 2, 4, 6, 8 and signals' saves at 5 and 7 (each resumed)."""
    run = tmp_path / "run"

    def save(step, interrupted=False):
        path = run / "checkpoints" / f"step_{step:06d}"
        path.mkdir(parents=True)
        meta = {"step": step, **({"interrupted": True} if interrupted else {})}
        (path / "meta.json").write_text(json.dumps(meta))

    for step, interrupted, kept in [(2, False, [2]), (4, False, [2, 4]), (5, True, [2, 4, 5]),
                                    (6, False, [4, 6]), (7, True, [4, 6, 7]), (8, False, [6, 8])]:
        save(step, interrupted)
        prune(run, keep_last=2, best_step=0)
        assert [int(p.name[5:]) for p in checkpoint_dirs(run)] == kept, step
    (run / "checkpoints" / "step_000008" / "meta.json").write_text("{damaged")  # read as not interrupted
    save(9, True)
    prune(run, keep_last=2, best_step=6)
    assert [int(p.name[5:]) for p in checkpoint_dirs(run)] == [6, 8, 9]


def test_time_left_counts_down_the_first_budget_to_end():
    """The bar's own estimate knew only updates and epochs: with max_minutes (tiny.toml's budget) it
    showed none, or hours for a run that stopped in seconds."""
    state = SimpleNamespace(step=25, epoch=2, cursor=5, seconds=50.0)  # 25 updates of 10 an epoch
    budgets = dict(max_minutes=0.0, max_updates=0, max_epochs=0)
    assert loop._time_left(state, SimpleNamespace(**budgets), 10) is None
    assert loop._time_left(state, SimpleNamespace(**{**budgets, "max_minutes": 10.0}), 10) == pytest.approx(550.0)
    assert loop._time_left(state, SimpleNamespace(**{**budgets, "max_updates": 100}), 10) == pytest.approx(150.0)
    both = SimpleNamespace(**{**budgets, "max_minutes": 2.0, "max_updates": 100000})  # minutes end first
    assert loop._time_left(state, both, 10) == pytest.approx(70.0)
    assert loop._time_left(state, SimpleNamespace(**{**budgets, "max_epochs": 5}), 10) == pytest.approx(50.0)
    assert [loop._clock(s) for s in (70.0, 3599.6, 3725.0)] == ["1:10", "1:00:00", "1:02:05"]


def test_the_bar_shows_one_time_left_the_one_that_knows_max_minutes(tmp_path, monkeypatch):
    """On a terminal tqdm's own time left ("[00:01<00:06"), which counts max_updates and max_epochs alone,
    stood beside the postfix's left=, which knows max_minutes too: where the minutes end first they said
    two times. The bar keeps left= alone, and tqdm's count, elapsed time and rate."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=4", "train.max_minutes=10")
    train(config)
    shown = terminal.getvalue()
    assert re.search(r"\| 4/4 \[\d\d:\d\d, [^]]*upd[^]]*left=0:00", shown), shown  # upd/s, or s/upd
    training = [frame for frame in shown.split("\r") if "validation:" not in frame]  # whose own time is its
    assert not re.search(r"\[\d\d:\d\d<", "".join(training)), shown


def test_a_validation_that_spends_the_time_budget_ends_the_run_there(tmp_path, monkeypatch):
    """max_minutes was checked before each validation, and the validation's time counted only after the
    next update: one that crossed the budget was followed by one more update, validation and checkpoint
    (a probe's step_000100, then step_000101). The clock is read again before the save, which records
    it, so the run stops with that checkpoint and a --resume from it trains nothing more."""
    elapsed = [0.0]  # seconds of this invocation's training, as the test sets them
    monkeypatch.setattr(loop, "_training_seconds", lambda before, start, tc, d: before + elapsed[0])
    real_validate, calls = loop.validate, []

    def slow_validation(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # update 4's: past the minute
            elapsed[0] = 61.0
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(loop, "validate", slow_validation)
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_minutes=1", "train.valid_every=2")
    result = train(config)
    assert result["step"] == 4 and result["stop"] == "max_minutes=1" and "valid_loss" in result
    run = tmp_path / "run"
    assert [p.name for p in checkpoint_dirs(run)] == ["step_000002", "step_000004"]
    saved = json.loads((run / "checkpoints" / "step_000004" / "trainer.json").read_text())["state"]
    assert saved["seconds"] == 61.0  # the validation's time included
    elapsed[0] = 0.0
    again = train(config, resume=True)
    assert again["step"] == 4 and again["stop"] == "max_minutes=1" and len(calls) == 2


def test_the_last_line_says_the_runs_training_time_and_a_resumed_sessions(tmp_path, monkeypatch, caplog):
    """"stopped (max_minutes=0.2) after 242 updates, 0.1 min": the run's updates beside this invocation's
    minutes, read as 242 updates in 6 s. It says the run's training time, which max_minutes and
    metrics.jsonl's elapsed_s count, and a resumed run's own minutes beside it."""
    monkeypatch.setattr(loop, "_training_seconds", lambda before, start, tc, d: before + 30.0)  # 30 s each
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2", "train.valid_every=2")
    with caplog.at_level("INFO", logger="aiayn"):
        train(config)
        assert caplog.messages[-1] == "stopped (max_updates=2) after 2 updates, 0.5 min of training"
        train(with_train(config, max_updates=4), resume=True)
    assert caplog.messages[-1] == ("stopped (max_updates=4) after 4 updates, 1.0 min of training "
                                   "(0.5 min in this session)")


@NO_SIGHUP
def test_processes_agree_on_the_signal_and_its_status(monkeypatch):
    """Under torchrun a process that got no signal stops with the others; two that got SIGINT were
    summed into a SIGTERM status before. Where processes got different signals, a SIGTERM wins, then a
    SIGHUP. The sums: the processes that got SIGTERM, SIGHUP, SIGINT."""
    d = SimpleNamespace(enabled=True)
    cases = [([0.0, 0.0, 0.0], None), ([0.0, 0.0, 2.0], "SIGINT"), ([0.0, 0.0, 1.0], "SIGINT"),
             ([1.0, 0.0, 1.0], "SIGTERM"), ([3.0, 0.0, 0.0], "SIGTERM"), ([0.0, 2.0, 0.0], "SIGHUP"),
             ([0.0, 1.0, 1.0], "SIGHUP"), ([1.0, 1.0, 0.0], "SIGTERM")]
    for others, expected in cases:
        monkeypatch.setattr(distributed, "all_reduce_sum", lambda values, d, others=others: others)
        stopper = loop.StopSignal()
        assert stopper.agreed(d) == expected
        assert stopper.signum == (None if expected is None else signal.Signals[expected])
    late = loop.StopSignal()  # a signal during the reduction: the others summed none, so none stops yet

    def signal_arrives(values, d):
        late.signum = signal.SIGTERM
        return [0.0, 0.0, 0.0]

    monkeypatch.setattr(distributed, "all_reduce_sum", signal_arrives)
    assert late.agreed(d) is None  # it said "SIGTERM" and stopped this process alone: a deadlock
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda values, d: values)
    assert late.agreed(d) == "SIGTERM"  # at the next update, for every process
    single = loop.StopSignal()
    assert single.agreed(SimpleNamespace(enabled=False)) is None
    single.signum = signal.SIGINT
    assert single.agreed(SimpleNamespace(enabled=False)) == "SIGINT"


def test_process_0_alone_says_that_a_signal_stops_the_run(monkeypatch, caplog, ctrl_c_handled):
    """Every process said "SIGTERM: stopping after this update" when a scheduler signalled the job (16
    lines for 16 GPUs); process 0 says it, also when the signal reached another process alone."""
    for announce in (True, False):  # process 0, another process
        caplog.clear()
        with loop.StopSignal(announce=announce).installed():
            signal.raise_signal(signal.SIGTERM)
        assert ("SIGTERM: stopping after this update" in caplog.text) == announce
        assert ("(a Ctrl-C: at once)" in caplog.text) == announce  # not "again": there was no first
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda values, d: [1.0, 0.0, 0.0])  # another's SIGTERM
    for announce in (True, False):
        caplog.clear()
        assert loop.StopSignal(announce=announce).agreed(SimpleNamespace(enabled=True)) == "SIGTERM"
        assert ("SIGTERM in another process: stopping after this update" in caplog.text) == announce
    caplog.clear()
    own = loop.StopSignal()  # process 0 got it itself, and said so then: not again as another's
    own.signum = signal.SIGTERM
    assert own.agreed(SimpleNamespace(enabled=True)) == "SIGTERM" and "in another process" not in caplog.text


@pytest.mark.parametrize("launched", [False, True])
def test_a_second_ctrl_c_under_torchrun_stops_at_once(monkeypatch, caplog, ctrl_c_handled, launched):
    """torchrun's launcher passes a Ctrl-C on as SIGINT and a second one as SIGTERM, which only set the stop
    again: a validation or BLEU pass ran on to the launcher's SIGKILL, though "at once" was announced.
    Outside torchrun a SIGTERM after a Ctrl-C is a scheduler's, and goes on with the stop under way."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if launched:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    stopper = loop.StopSignal()
    with stopper.installed():
        signal.raise_signal(signal.SIGINT)
        assert stopper.signum == signal.SIGINT and "(Ctrl-C again: at once)" in caplog.text
        if launched:
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
        else:
            signal.raise_signal(signal.SIGTERM)
    if not launched:
        assert stopper.signum == signal.SIGTERM
    with stopper.installed(), pytest.raises(KeyboardInterrupt):  # a Ctrl-C after a SIGTERM, as before
        signal.raise_signal(signal.SIGINT)
    caplog.clear()  # a first SIGTERM: torchrun passes a Ctrl-C on as SIGTERM, not at once: none offered
    with loop.StopSignal().installed():
        signal.raise_signal(signal.SIGTERM)
    assert "SIGTERM: stopping after this update" in caplog.text
    assert ("(a Ctrl-C: at once)" in caplog.text) == (not launched)


def test_a_stop_python_dropped_before_training_stops_it_as_the_handlers_take_over():
    """A Ctrl-C whose KeyboardInterrupt Python dropped during the data's preparation (the CLI records it):
    raised by the first checkpoint's rename, it would abort the save of a stop asked for later."""
    from aiayn.files import record_dropped_stop

    handler = signal.getsignal(signal.SIGINT)
    record_dropped_stop(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt), loop.StopSignal().installed():
        pytest.fail("the training ran")
    assert signal.getsignal(signal.SIGINT) is handler
    with loop.StopSignal().installed():  # raised once
        pass


def test_a_signal_the_process_ignores_stays_ignored_during_training(caplog):
    """A background job of a script (`aiayn train ... &`) starts with SIGINT ignored: the loop's handler
    made a Ctrl-C meant for the script stop the training, which ignored it while preparing the data."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stopper = loop.StopSignal()
        with stopper.installed():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # handled
            signal.raise_signal(signal.SIGINT)
            assert stopper.signum is None
            signal.raise_signal(signal.SIGTERM)  # its note offered a Ctrl-C, which does nothing here
        assert stopper.signum == signal.SIGTERM and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert "stopping after this update" in caplog.text and "Ctrl-C" not in caplog.text
    finally:
        signal.signal(signal.SIGINT, before)


@NO_SIGHUP
def test_a_run_started_by_nohup_trains_on_when_its_terminal_closes(caplog, hangup_caught):
    """A closed terminal's SIGHUP is handled as SIGTERM is (a save, then a stop), except where the process
    started with it ignored (`nohup aiayn train ...`): as an ignored SIGINT, it stays ignored."""
    stopper = loop.StopSignal()
    with stopper.installed():
        assert signal.getsignal(signal.SIGHUP) not in (hangup_caught, signal.SIG_IGN)
        signal.raise_signal(signal.SIGHUP)
    assert stopper.signum == signal.SIGHUP and signal.getsignal(signal.SIGHUP) is hangup_caught
    assert "SIGHUP: stopping after this update, with a checkpoint" in caplog.text
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stopper = loop.StopSignal()
    with stopper.installed():
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.raise_signal(signal.SIGHUP)
    assert stopper.signum is None and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGHUP", marks=NO_SIGHUP),
                                  pytest.param("SIGHUP ignored", marks=NO_SIGHUP)])
def test_a_signal_before_the_first_update_is_said_as_for_every_command(tmp_path, name):
    """SIGTERM or SIGHUP while the data was prepared or the model built killed `aiayn train` without a word
    (exit -15), where a Ctrl-C said "aiayn: interrupted" and every other command "aiayn: stopped by SIGTERM".
    A SIGHUP the process started ignoring (`nohup`) stays ignored: the run trains on. A process of its own:
    the old default action killed the test session."""
    name, ignored = name.split()[0], name.endswith("ignored")
    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    code = ("import os, signal, sys\nfrom aiayn.train import loop\nfrom aiayn.cli import main\n"
            # the case's own disposition: pytest run under nohup passes SIGHUP on ignored
            f"signal.signal(signal.{name}, signal.{'SIG_IGN' if ignored else 'SIG_DFL'})\n"
            "real = loop.build_model\n"
            f"def signalled(*args):\n    os.kill(os.getpid(), signal.{name})\n    return real(*args)\n"
            "loop.build_model = signalled\nsys.exit(main(sys.argv[1:]))\n")
    run = subprocess.run([sys.executable, "-c", code, "train", *set_args(sets)],
                         capture_output=True, text=True, timeout=300, check=False)
    if ignored:
        assert run.returncode == 0 and run.stdout.startswith("step 1: valid loss"), run.stderr
        return
    assert (run.returncode, run.stdout) == (128 + getattr(signal, name), ""), run.stderr
    assert run.stderr.splitlines()[-1] == f"aiayn: stopped by {name}"
    assert checkpoint_dirs(tmp_path / "run") == []  # nothing saved: a rerun starts again


@pytest.mark.parametrize("last", ["returned", "interrupted", "SIGTERM", "SIGHUP"])
def test_a_ctrl_c_after_the_last_line_ends_the_process_at_once_without_a_traceback(last):
    """Python takes seconds to exit once torch is loaded, and a Ctrl-C then (a second one after "stopped by
    SIGINT at update 20, saved ...", which the first's warning offers) printed a KeyboardInterrupt
    traceback; one as the last line was written, too, and a SIGTERM or SIGHUP there (`Terminated`, raised
    by `_signals_raise`'s handler) a traceback and exit 1. The exit is held here by an atexit hook that
    waits, `python -m aiayn` run with a `main` that says its last line and returns, or is stopped there."""
    stop = {"returned": "    return 2\n", "interrupted": "    raise KeyboardInterrupt\n"}.get(
        last, f"    raise cli.Terminated(signal.{last})\n")
    code = ("import atexit, runpy, signal, sys, time\nimport aiayn.cli as cli\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job's: ignored\n"
            "def main():\n    print('aiayn: the last line', file=sys.stderr)\n"
            + stop + "cli.main = main\n"
            "atexit.register(lambda: (print('exiting', file=sys.stderr, flush=True), time.sleep(20)))\n"
            "runpy.run_module('aiayn', run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline() == "aiayn: the last line\n"
        if last == "returned":
            assert proc.stderr.readline() == "exiting\n"
            proc.send_signal(signal.SIGINT)
        killed_by = getattr(signal, last, signal.SIGINT)
        assert (proc.stderr.read(), proc.wait(timeout=30)) == ("", -killed_by)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_train_in_a_job_s_later_process_keeps_sigterm_s_default_action(monkeypatch, rank):
    """A process other than 0 of a torchrun job waits in gloo's C++ broadcast while process 0 prepares the
    data, where a Python handler runs only once that call returns: with `Terminated` raised by one, a
    SIGTERM to it waited for process 0's preparation (hours on a big corpus). Its default action ends it
    at once; process 0 (and a process alone) still raises, to say "stopped by SIGTERM"."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    seen = []
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.append(signal.getsignal(signal.SIGTERM)))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert cli.main(["train", "--config", "none.toml"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIG_DFL if rank == "1" else cli._terminate]


def test_the_tokenizer_settings_are_those_a_tokenizer_is_trained_with():
    from aiayn.data.dataset import tokenizer_settings
    from aiayn.train.config import TOKENIZER_SETTINGS

    assert set(TOKENIZER_SETTINGS) == set(tokenizer_settings(8, "bpe", True))


def signalled_run(finished_run, tmp_path, monkeypatch, at_update: int):
    """The finished run's config in a new run_dir with its tokenizer, and SIGTERM sent as update
    `at_update` begins (delivered in the main thread, mid-loop, as from outside)."""
    d, config, _ = finished_run
    run = tmp_path / "run"
    run.mkdir()
    for name in ("spm.model", "tokenizer_inputs.json"):
        shutil.copy(d / "run" / name, run / name)
    real_step, calls = loop.train_step, []

    def step_then_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_update:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step_then_signal)
    return with_train(config, run_dir=str(run))


def test_a_signal_at_the_last_update_ends_the_run_as_usual(finished_run, tmp_path, monkeypatch):
    """The run is at its budget anyway: it validates its last checkpoint and returns (exit 0), instead of
    saving it unvalidated and saying that --resume continues. The answer names the signal, for a caller
    with more to do than the training (`aiayn demo` translated for minutes after it, and exited 0)."""
    config = signalled_run(finished_run, tmp_path, monkeypatch, at_update=4)
    result = train(config)
    assert result["stop"] == "max_updates=4" and result["step"] == 4 and "valid_loss" in result
    assert result["signal"] == "SIGTERM"
    again = train(with_train(config, max_updates=5), resume=True)  # no signal this time: none named
    assert again["step"] == 5 and "signal" not in again


def test_a_signals_save_writes_no_empty_record_and_the_curves_still_draw(finished_run, tmp_path, monkeypatch,
                                                                          capsys):
    """A signal's save at update 3 (no validation due) logged {"step": 3, "epoch": 1}: a record with
    nothing measured, which no unbroken run has. `aiayn plot` and the resumed run's purge go on."""
    from aiayn.train.metrics import read_metrics

    run = tmp_path / "run"
    config = signalled_run(finished_run, tmp_path, monkeypatch, at_update=3)
    with pytest.raises(Stopped):
        train(config)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 2] and all(set(r) - {"step", "epoch"} for r in records)
    assert cli.main(["plot", str(run)]) == 0 and capsys.readouterr().out.strip() == str(run / "curves.png")
    assert train(config, resume=True)["step"] == 4
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [2, 2, 4, 4]


def test_resume_uses_the_tokenizer_its_checkpoints_hold(finished_run, tmp_path):
    """A run dir holding only checkpoints/ trained a new tokenizer under the old model; a swapped spm.model
    was trained on silently."""
    d, config, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(d / "run" / "checkpoints", run / "checkpoints")
    assert train(with_train(config, run_dir=str(run), max_updates=5), resume=True)["step"] == 5
    assert (run / "spm.model").read_bytes() == (d / "run" / "spm.model").read_bytes()
    other = train_sentencepiece([f"ganz andere {i} Wörter" for i in range(200)], tmp_path / "other", 40)
    (run / "spm.model").write_bytes(other.read_bytes())
    with pytest.raises(UserError, match=r"its tokenizer is not the one step_000005 was trained with"):
        train(with_train(config, run_dir=str(run), max_updates=6), resume=True)


def other_tokenizer(tmp_path: Path) -> bytes:
    """A SentencePiece model of the tiny runs' 40 pieces, trained on other text."""
    lines = [f"ganz andere {i} Wörter" for i in range(200)]
    return train_sentencepiece(lines, tmp_path / "other", 40).read_bytes()


def test_a_latest_checkpoints_swapped_tokenizer_is_blamed_on_it_not_on_the_run(finished_run, tmp_path):
    """The newest checkpoint's spm.model replaced, the run's and the earlier checkpoint's alike: --resume
    blamed the run's and advised copying the checkpoint's over it, after which the run trained on silently
    with the wrong tokenizer. The odd copy is named now, with the way out."""
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    run = Path(config.train.run_dir)
    latest = checkpoint_dirs(run)[-1]
    whole = (run / "spm.model").read_bytes()
    (latest / "spm.model").write_bytes(other_tokenizer(tmp_path))
    said = (f"{latest / 'spm.model'}: not the tokenizer of the run directory and its earlier checkpoints "
            f"(damaged, replaced, or another run's); to resume from step_000002 instead, move {latest} out ")
    with pytest.raises(CorruptFile, match=f"^{re.escape(said)}"):
        train(config, resume=True)
    assert (run / "spm.model").read_bytes() == whole
    latest.rename(tmp_path / "swapped")  # the way out, taken
    assert train(config, resume=True)["step"] == 6


def test_a_tokenizer_no_earlier_checkpoint_arbitrates_is_not_blamed_on_either(finished_run, tmp_path):
    """With one checkpoint, its tokenizer and the run's differing, nothing tells which was replaced:
    copying the checkpoint's over the run's, as advised, could lose the right one."""
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    run = Path(config.train.run_dir)
    shutil.rmtree(checkpoint_dirs(run)[0])
    latest = checkpoint_dirs(run)[-1]
    (latest / "spm.model").write_bytes(other_tokenizer(tmp_path))
    with pytest.raises(UserError) as e:
        train(config, resume=True)
    assert str(e.value) == (f"{run}: its tokenizer is not the one in {latest}, and no earlier checkpoint "
                            "tells which of the two the run was trained with; keep both, and train in a new "
                            "train.run_dir or put the right one in the other's place")


def test_a_checkpoint_linked_in_from_another_run_is_said_to_be_one_before_its_tokenizer(finished_run,
                                                                                      tmp_path, monkeypatch):
    """step_000004 a link to another run's step_000002 (another tokenizer): "its tokenizer is not the one
    step_000004 was trained with" came first, advising to copy the other run's over this one's, and
    "holds update 2, not 4" never came."""
    config = with_train(copy_run(finished_run, tmp_path), max_updates=6)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    other = tmp_path / "other_run" / "checkpoints" / "step_000002"
    shutil.copytree(checkpoints / "step_000002", other)
    (other / "spm.model").write_bytes(other_tokenizer(tmp_path))
    shutil.rmtree(checkpoints / "step_000004")
    (checkpoints / "step_000004").symlink_to(other)
    monkeypatch.setattr(loop, "prepare_data", lambda *a, **k: pytest.fail("refused after the data work"))
    said = (f"{checkpoints / 'step_000004'}: holds update 2, not 4 as its name says (renamed or linked in by "
            "hand?); to resume from step_000002 instead")
    with pytest.raises(CorruptFile, match=f"^{re.escape(said)}"):
        train(config, resume=True)


def test_a_kill_after_a_checkpoint_appears_loses_no_validation_record(finished_run, tmp_path, monkeypatch):
    """Killed between the checkpoint's rename and the log's append (prune deletes old checkpoints between
    the two), the run resumed after that step and its validation was never logged."""
    config = copy_run(finished_run, tmp_path)

    class Killed(BaseException):
        pass

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(loop, "prune", killed)  # the process dies as old checkpoints are being deleted
    with pytest.raises(Killed):
        train(with_train(config, max_updates=6), resume=True)
    monkeypatch.undo()
    assert checkpoint_dirs(Path(config.train.run_dir))[-1].name == "step_000006"
    train(with_train(config, max_updates=8), resume=True)
    log = [json.loads(line) for line in (Path(config.train.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "valid_loss" in r] == [2, 4, 6, 8]


def test_putting_the_tokenizer_back_on_resume_is_whole_or_nothing(finished_run, tmp_path, monkeypatch):
    """It was a plain write into run_dir/spm.model: a full disk was a traceback that left a truncated file,
    which every later --resume then refused; a directory in the way, an IsADirectoryError traceback."""
    d, config, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(d / "run" / "checkpoints", run / "checkpoints")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=r"spm\.model: cannot write \(No space left on device\)$"):
        train(with_train(config, run_dir=str(run), max_updates=5), resume=True)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert not [p.name for p in run.iterdir() if "spm" in p.name]  # no file, whole or truncated, no temporary
    (run / "spm.model").mkdir()
    with pytest.raises(UserError, match=r"spm\.model: cannot write \(Is a directory\)$"):
        train(with_train(config, run_dir=str(run), max_updates=5), resume=True)
    (run / "spm.model").rmdir()
    assert train(with_train(config, run_dir=str(run), max_updates=5), resume=True)["step"] == 5


@pytest.mark.parametrize("change", [dict(update_freq=2), dict(max_tokens=128)])
def test_resume_refuses_another_update_shape(finished_run, tmp_path, change):
    """The saved position counts updates of processes x update_freq batches of max_tokens: another shape
    trained part of the epoch twice (or skipped it), silently."""
    config = copy_run(finished_run, tmp_path)
    (key, value), = change.items()
    with pytest.raises(UserError, match=rf": trained with train\.{key}={1 if key == 'update_freq' else 64} "
                                        rf"\(resumed with {value}\); --resume continues the run with its "
                                        r"batches \(the saved position in the epoch counts them\)"):
        train(with_train(config, max_updates=6, **change), resume=True)
    assert train(with_train(config, max_updates=5), resume=True)["step"] == 5


@pytest.mark.parametrize("items, message", [
    (["train.seed=7"], "--set 'train.seed=7': {ck}: trained with train.seed=1 (resumed with 7); "),
    (["data.max_len=20"], "--set 'data.max_len=20': {ck}: trained with data.max_len=32 (resumed with 20)"),
    (["train.max_tokens=128", "train.update_freq=2"], ("--set 'train.update_freq=2' and --set "
     "'train.max_tokens=128': {ck}: trained with train.update_freq=1 (resumed with 2), train.max_tokens=64 "
     "(resumed with 128); ")),
    (["model.d_ff=128"], "--set 'model.d_ff=128': {ck}: trained with model.d_ff=64 (resumed with 128); "),
    (["model.preset=tiny"], ("--set 'model.preset=tiny': {ck}: trained with model.d_model=32, "
     "model.n_heads=2, model.d_ff=64, model.n_layers=1 (resumed with 128, 4, 512 and 2 from "
     "model.preset='tiny'); ")),
    # a setting written between the preset's: the preset was said twice, its values split around it
    (["model.preset=tiny", "model.n_heads=8"], ("--set 'model.preset=tiny' and --set 'model.n_heads=8': "
     "{ck}: trained with model.d_model=32, model.d_ff=64, model.n_layers=1 (resumed with 128, 512 and 2 from "
     "model.preset='tiny'), model.n_heads=2 (resumed with 8); ")),
])
def test_resume_refusals_name_where_the_change_was_written(finished_run, tmp_path, monkeypatch, items,
                                                          message):
    """As a changed data.vocab_size's did: these said only the checkpoint, not which --set item or line
    to drop. The model's came after the tokenizer and the caches were read (here: refused before)."""
    d, _, sets = finished_run
    shutil.copytree(d / "run", tmp_path / "run")
    config = load_config(None, sets + [f"train.run_dir={tmp_path / 'run'}", "train.max_updates=6", *items])

    def no_data_work(*args):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(loop, "prepare_data", no_data_work)
    with pytest.raises(UserError) as refused:
        train(config, resume=True)
    assert str(refused.value).startswith(message.format(ck=checkpoint_dirs(tmp_path / "run")[-1]))


def test_a_resume_that_changes_several_settings_names_them_all_in_one_line(finished_run, tmp_path,
                                                                          monkeypatch):
    """Each was refused alone, one per try: without the run's config, max_len, then max_tokens, then the
    model (its d_model alone, of four settings the preset changed), then vocab_size, the first said as
    "resumed with 256", not as the default it was."""
    d, _, sets = finished_run
    shutil.copytree(d / "run", tmp_path / "run")
    files = [s for s in sets if s.startswith(("data.train_", "data.valid_"))]
    monkeypatch.setattr(loop, "prepare_data", lambda *a, **k: pytest.fail("refused after the data work"))
    with pytest.raises(UserError) as e:
        train(load_config(None, [*files, f"train.run_dir={tmp_path / 'run'}", "train.device=cpu",
                                 "train.seed=3", "model.norm_first=true"]), resume=True)
    checkpoint = checkpoint_dirs(tmp_path / "run")[-1]
    assert str(e.value) == (
        f"--set 'train.seed=3' and --set 'model.norm_first=true': {checkpoint}: trained with train.seed=1 "
        "(resumed with 3), data.max_len=32 (resumed with the default 256), train.max_tokens=64 (resumed with "
        "the default 4096), model.d_model=32, model.n_heads=2, model.d_ff=64, model.n_layers=1 (resumed with "
        "512, 8, 2048 and 6 from the default model.preset='base'), model.norm_first=false (resumed with "
        "true), data.vocab_size=40 (resumed with the default 8000); --resume continues the run with its "
        "batches (the saved position in the epoch counts them), its model and its tokenizer: set them as "
        "trained, or use a new train.run_dir")


def test_another_number_of_processes_on_resume_names_the_product(finished_run, tmp_path):
    """processes x update_freq batches make an update: two processes resuming a one-process run must halve
    update_freq, which is said as the product to keep."""
    config = copy_run(finished_run, tmp_path)
    checkpoint = checkpoint_dirs(Path(config.train.run_dir))[-1]
    meta = read_meta(checkpoint)["config"]
    two = distributed.Dist(0, 2, 0, torch.device("cpu"))
    kept = _other_batches(checkpoint, meta["train"], meta["data"], config, two)
    said = str(_resume_refusal(checkpoint, load_config(None, ["train.update_freq=1"]), kept))
    # it said "processes x train.update_freq=1 x 1 (...); ...: set it as trained": processes are no
    # setting, and no update_freq makes 1 batch an update of 2 processes
    batches = "--resume continues the run with its batches (the saved position in the epoch counts them)"
    assert said == (f"{checkpoint}: trained with 1 batch an update (1 process x train.update_freq=1; resumed "
                    f"with 2 x 1); {batches}: resume it with 1 process, or use a new train.run_dir")
    four = dict(meta["train"], update_freq=4)  # 4 batches an update: update_freq 2 makes them of two
    kept = _other_batches(checkpoint, four, meta["data"], config, two)
    said = str(_resume_refusal(checkpoint, config, kept))
    assert said.endswith(f"trained with 4 batches an update (1 process x train.update_freq=4; resumed with "
                         f"2 x 1); {batches}: set train.update_freq=2 (2 processes x 2), or use a new "
                         "train.run_dir")
    one = distributed.Dist(0, 1, 0, torch.device("cpu"))
    kept = _other_batches(checkpoint, meta["train"], meta["data"], with_train(config, update_freq=2), one)
    assert [k.setting for k in kept] == ["train.update_freq"]
    # a two-process run resumed by one: the fix said "(1 processes x 2)"
    said = str(_resume_refusal(checkpoint, config, [_kept_product(2, 1, 1, 1)]))
    assert said.endswith(f"trained with 2 batches an update (2 processes x train.update_freq=1; resumed with "
                         f"1 x 1); {batches}: set train.update_freq=2 (1 process x 2), or use a new "
                         "train.run_dir")


@pytest.mark.parametrize("model, said", [
    ({"d_model": "32"}, r"bad model configuration \(ModelConfig\.d_model='32' has type str, .*\)"),
    ({"d_model": -32}, r"bad model configuration \(ModelConfig: d_model=-32 must be positive\)"),
    ({"d_model": 64, "d_ff": 256}, (r"not the model its model\.safetensors holds \(wrong shape \[.*\]\); "
                                    "damaged, or copied from another checkpoint")),  # another run's meta.json
    # the run's vocabulary fields are meta.json's: refused after the data work, blamed on the run
    ({"vocab_size": 1000}, (r"not the model its model\.safetensors holds \(wrong shape \[.*\(1000, .*\]\); "
                            "damaged, or copied from another checkpoint")),
])
def test_a_damaged_model_in_meta_json_is_named_there_not_in_the_run_config(finished_run, tmp_path,
                                                                          monkeypatch, model, said):
    """--resume compared meta.json's model as written with [model], and blamed the difference on the
    run's config ("run.toml:2: ...: checkpoint from an incompatible model (d_model='32', this run has 32)")
    where info, translate and average name meta.json; a well-formed model the weights do not fit likewise.
    Named before the data work, with the way out."""
    config = copy_run(finished_run, tmp_path)
    latest = checkpoint_dirs(Path(config.train.run_dir))[-1]
    meta = json.loads((latest / "meta.json").read_text())
    meta["model"].update(model)
    (latest / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(loop, "prepare_data", lambda *a, **k: pytest.fail("refused after the data work"))
    with pytest.raises(CorruptFile, match=rf"^{re.escape(str(latest / 'meta.json'))}: {said}; to resume from "
                                          r"step_000002 instead"):
        train(with_train(config, max_updates=6), resume=True)


# 3. A validation set with every pair too long fails before training.


def test_a_validation_set_longer_than_max_len_fails_before_training(tmp_path):
    long_src, long_tgt = tmp_path / "long.de", tmp_path / "long.en"
    long_src.write_text("ein Hund läuft über die Wiese " * 12 + "\n", encoding="utf-8")
    long_tgt.write_text("a dog runs across the meadow " * 12 + "\n", encoding="utf-8")
    config, _ = tiny_config(
        tmp_path, tmp_path / "run", "train.max_updates=2", f"data.valid_src={long_src}", f"data.valid_tgt={long_tgt}"
    )
    with pytest.raises(UserError, match=r"long\.de, .*long\.en: all 1 validation pairs are longer than "
                                        r"data\.max_len=32"):
        train(config)
    assert checkpoint_dirs(tmp_path / "run") == []


def test_one_file_as_both_sides_of_the_validation_pair_is_said_as_validation(tmp_path, caplog):
    """A typo (valid_tgt=va.de for va.en) was said as of the training pair: "the model will learn to copy
    its input", which it does not; what it does is make every validation measure copying."""
    config, _ = tiny_config(tmp_path, tmp_path / "run")
    config = replace(config, data=replace(config.data, valid_tgt=config.data.valid_src))
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.WARNING):
        loop.prepare_data(config, tmp_path / "run", distributed.Dist(0, 1, 0, torch.device("cpu")))
    valid = config.data.valid_src
    said = (f"{valid} and {valid} are the same file: the model trains as usual, but validation (its loss, "
            "the best checkpoint, train.patience, BLEU) measures copying the input; check data.valid_src and "
            "data.valid_tgt")
    assert [m for m in caplog.messages if "same file" in m] == [said]


def test_the_pairs_longer_than_max_len_are_said_of_both_files(tmp_path, caplog):
    """Either side may be the long one: "train.de: 59 training pairs; 1 longer than max_len=64 dropped"
    named the source file of a pair whose target was too long."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "data.max_len=64")  # the toy pairs fit, at 40 pieces
    dc = config.data
    for path in (dc.train_tgt, dc.valid_tgt):  # a long target on the first line of each set
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        lines[0] = "a dog runs across the meadow " * 12
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.INFO):
        loop.prepare_data(config, tmp_path / "run", distributed.Dist(0, 1, 0, torch.device("cpu")))
    said = caplog.messages
    assert (f"{dc.train_src}, {dc.train_tgt}: 1 of 60 training pairs are longer than 64 tokens "
            "(data.max_len=64) and dropped; raise train.max_tokens with data.max_len to train on "
            "them") in said
    assert f"{dc.valid_src}, {dc.valid_tgt}: 1 validation pair longer than max_len=64 dropped" in said


def test_fewer_pairs_than_an_update_takes_are_refused_with_advice_that_can_work(tmp_path):
    """A batch holds a pair at least: "1 batches, fewer than one update needs (2); lower train.max_tokens or
    train.update_freq" named the source file alone, and advised a max_tokens that could never help."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.update_freq=2")
    src, tgt = write_corpus(tmp_path, 1, "one")
    config = replace(config, data=replace(config.data, train_src=str(src), train_tgt=str(tgt)))
    with pytest.raises(UserError) as caught:
        train(config)
    assert str(caught.value) == (
        f"{src}, {tgt}: 1 training pair makes 1 batch of train.max_tokens=64, fewer than the 2 one update "
        "takes (train.update_freq=2); set train.update_freq=1, or train on more pairs"
    )
    assert checkpoint_dirs(tmp_path / "run") == []


def test_too_few_batches_name_the_max_tokens_and_max_len_that_give_enough(tmp_path):
    """57 pairs kept of 60 (3 longer than data.max_len=32) in 18 batches: a lower max_tokens can give the 40
    an update takes, and the one named does; the 3 dropped pairs could not, and are not advised."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.update_freq=40")
    d = distributed.Dist(0, 1, 0, torch.device("cpu"))
    (tmp_path / "run").mkdir()
    data = loop.prepare_data(config, tmp_path / "run", d)
    assert (len(data.train), len(data.train_batches), data.train_too_long) == (57, 18, 3)
    said = str(loop._too_few_batches(config, data, d))
    assert said.endswith("set train.update_freq=18, or set train.max_tokens=33 (40 batches), or train on "
                         "more pairs"), said
    lower = replace(config, train=replace(config.train, max_tokens=33))
    assert len(loop.prepare_data(lower, tmp_path / "run", d).train_batches) == 40
    # at data.max_len=8, 48 pairs longer dropped: kept at the highest data.max_len, 64 (max_tokens), they
    # make 21 batches, too few for 40 (advised, as it was, the 48 could not give them) and enough for 20
    short = replace(config, data=replace(config.data, max_len=8))
    said = str(loop._too_few_batches(short, loop.prepare_data(short, tmp_path / "run", d), d))
    assert said.endswith(": 12 training pairs make 2 batches of train.max_tokens=64, fewer than the 40 one "
                         "update takes (train.update_freq=40); set train.update_freq=2, or train on more "
                         "pairs"), said
    twenty = replace(short, train=replace(short.train, update_freq=20))
    said = str(loop._too_few_batches(twenty, loop.prepare_data(twenty, tmp_path / "run", d), d))
    assert said.endswith("; set train.update_freq=2, or set data.max_len=64 (21 batches with the 48 longer "
                         "pairs it dropped), or train on more pairs"), said
    wider = replace(twenty, data=replace(short.data, max_len=64))
    assert len(loop.prepare_data(wider, tmp_path / "run", d).train_batches) == 21
    # several processes: an update takes update_freq batches of each; fewer processes are advised where they
    # give one (18 batches: 20 a process for one update on none, 10 on one, 6 on three)
    for processes, update_freq, advice in (
        (2, 20, "set train.update_freq=9, or set train.max_tokens=33 (40 batches)"),
        (2, 10, "set train.update_freq=9, or run 1 process, or set train.max_tokens="),
        (4, 6, "set train.update_freq=4, or run 3 processes or fewer, or set train.max_tokens="),
    ):
        per_update = replace(config, train=replace(config.train, update_freq=update_freq))
        said = str(loop._too_few_batches(per_update, data, distributed.Dist(0, processes, 0, d.device)))
        assert f"(train.update_freq={update_freq} x {processes} processes); {advice}" in said, said


def test_dropping_a_share_of_the_training_pairs_as_too_long_is_a_warning(tmp_path, caplog):
    """"tr.de, tr.en: 32 training pairs; 1968 longer than max_len=12 dropped" was an INFO line like the
    routine ones: from 1% dropped it is a warning that names data.max_len; fewer are a corpus' stray lines."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "data.max_len=8")  # 48 of the 60 toy pairs longer
    d = distributed.Dist(0, 1, 0, torch.device("cpu"))
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.INFO):
        loop.prepare_data(config, tmp_path / "run", d)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "training pair" in r.getMessage()]
    src, tgt = config.data.train_src, config.data.train_tgt
    warned = (f"{src}, {tgt}: 48 of 60 training pairs are longer than 8 tokens (data.max_len=8) and dropped; "
              "raise data.max_len (up to 64, train.max_tokens) to train on them")
    assert said == [(logging.WARNING, warned)]
    # a fine-tune's or a resume's model keeps its positions: model.max_len was advised, and refused
    for positions, cure in ((32, "raise data.max_len (up to 32, the model's positions)"),
                            (8, "the model has 8 positions: split or shorten them")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            loop.prepare_data(config, tmp_path / "run", d, fixed_positions=positions)
        said = [r.getMessage() for r in caplog.records if "training pair" in r.getMessage()]
        assert said == [warned.replace("raise data.max_len (up to 64, train.max_tokens)", cure)], said
    # 1 of 200: under 1%, said at INFO
    write_corpus(tmp_path, 200)
    lines = Path(tgt).read_text(encoding="utf-8").splitlines()
    lines[0] = "a dog runs across the meadow " * 12
    Path(tgt).write_text("\n".join(lines) + "\n", encoding="utf-8")
    caplog.clear()
    wide = replace(config, data=replace(config.data, max_len=64))
    (tmp_path / "wide").mkdir()
    with caplog.at_level(logging.INFO):
        loop.prepare_data(wide, tmp_path / "wide", d)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "training pair" in r.getMessage()]
    assert said == [(logging.INFO, f"{src}, {tgt}: 199 training pairs; 1 longer than max_len=64 dropped")]


def test_a_training_set_all_too_long_is_told_the_limit_the_run_has(tmp_path):
    """"raise data.max_len (and model.max_len)" was said whatever held data.max_len: a model.max_len of 1024
    where it was 32 (a fresh run stops at train.max_tokens), and a fine-tune's model, whose positions are
    its checkpoint's."""
    config, _ = tiny_config(tmp_path, tmp_path / "run")  # data.max_len=32, train.max_tokens=64
    src, tgt = Path(config.data.train_src), Path(config.data.train_tgt)
    src.write_text("ein Hund läuft über die Wiese " * 8 + "\n", encoding="utf-8")
    tgt.write_text("a dog runs across the meadow " * 8 + "\n", encoding="utf-8")
    d = distributed.Dist(0, 1, 0, torch.device("cpu"))
    (tmp_path / "run").mkdir()
    said = f"{src}, {tgt}: all 1 training pairs are longer than data.max_len=32 tokens; "
    shorter = ", or use shorter sentences"
    for model_max_len, positions, cure in (
        (1024, None, "raise data.max_len (up to 64, train.max_tokens)" + shorter),
        (32, None, "raise data.max_len (and model.max_len) (up to 64, train.max_tokens)" + shorter),
        (1024, 32, "the model has 32 positions: split or shorten them"),
    ):
        sized = replace(config, model={**config.model, "max_len": model_max_len})
        with pytest.raises(UserError) as caught:
            loop.prepare_data(sized, tmp_path / "run", d, fixed_positions=positions)
        assert str(caught.value) == said + cure


def test_a_resume_is_advised_only_what_a_resume_accepts(tmp_path, caplog):
    """--resume refuses another data.max_len, train.update_freq or train.max_tokens: the warning of pairs
    dropped as too long, and the refusals of a corpus too small for an update or of one too long, advised
    each of them ("raise data.max_len (up to 64, ...)", "set train.update_freq=1"), which the resume then
    refused in turn."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "data.max_len=8", "train.update_freq=2",
                            "train.max_updates=1")  # 48 of the 60 toy pairs dropped: 12 in 2 batches
    train(config)
    resumed = with_train(config, max_updates=2)
    src, tgt = resumed.data.train_src, resumed.data.train_tgt
    caplog.clear()  # the first run's warning
    with caplog.at_level(logging.WARNING):
        train(resumed, resume=True)
    warned = (f"{src}, {tgt}: 48 of 60 training pairs are longer than 8 tokens (data.max_len=8) and dropped; "
              "--resume keeps data.max_len (the saved position counts its batches): use a new train.run_dir "
              "to train on them")
    assert [m for m in caplog.messages if "training pairs are longer" in m] == [warned]
    def resumed_on(src: Path, tgt: Path) -> str:  # the refusal of a resume on other training files
        with pytest.raises(UserError) as caught:
            train(replace(resumed, data=replace(resumed.data, train_src=str(src), train_tgt=str(tgt))),
                  resume=True)
        return str(caught.value)

    one_src, one_tgt = write_corpus(tmp_path, 1, "one")  # 1 pair, 1 batch: an update takes 2
    assert resumed_on(one_src, one_tgt) == (
        f"{one_src}, {one_tgt}: 1 training pair makes 1 batch of train.max_tokens=64, fewer than the 2 one "
        "update takes (train.update_freq=2); --resume keeps the batches an update takes (the saved position "
        "counts them): train on more pairs, or use a new train.run_dir")
    long_src, long_tgt = tmp_path / "long.de", tmp_path / "long.en"
    long_src.write_text("ein Hund läuft über die Wiese " * 3 + "\n", encoding="utf-8")
    long_tgt.write_text("a dog runs across the meadow " * 3 + "\n", encoding="utf-8")
    assert resumed_on(long_src, long_tgt) == (
        f"{long_src}, {long_tgt}: all 1 training pairs are longer than data.max_len=8 tokens; --resume keeps "
        "data.max_len (the saved position counts its batches): use a new train.run_dir, or use shorter "
        "sentences")
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_000001", "step_000002"]


def test_a_bad_validation_file_fails_before_the_tokenizer_is_trained(tmp_path):
    """A missing line in the validation target is found before the (on real data, minutes-long)
    SentencePiece training, which leaves its model in the run directory."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    short = tmp_path / "short.en"
    short.write_text("one line\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"\.de:2: line counts differ: .*short\.en has 1$"):  # the longer file
        train(replace(config, data=replace(config.data, valid_tgt=str(short))))
    assert not (tmp_path / "run" / "spm.model").exists()


def test_validate_refuses_an_empty_validation_set():
    empty = EncodedCorpus.from_lists([], [])
    data = Data(SimpleNamespace(pad_id=0), empty, [], empty, [], None, 0)
    d = distributed.Dist(0, 1, 0, torch.device("cpu"))
    with pytest.raises(UserError, match="no target tokens"):  # not a ZeroDivisionError
        validate(torch.nn.Linear(1, 1), data, d, torch.autocast("cpu", enabled=False), 0.1)


def test_validate_leaves_a_training_model_training_after_an_error():
    """The model went back to training mode only after a pass that ended: one that raised (an
    out-of-memory, say) left it in eval mode, and a caller that caught the error trained on without
    dropout. `extract_attention` restored it always; now every eval-mode pass does (`evaluating`)."""

    class Failing(torch.nn.Linear):
        def forward(self, *args):
            raise RuntimeError("no memory left")

    pairs = EncodedCorpus.from_lists([[5, 2]], [[6]])
    data = Data(SimpleNamespace(pad_id=0, bos_id=1, eos_id=2), pairs, [], pairs, [[0]], None)
    d = distributed.Dist(0, 1, 0, torch.device("cpu"))
    model = Failing(1, 1).train()
    with pytest.raises(RuntimeError, match="no memory left"):
        validate(model, data, d, torch.autocast("cpu", enabled=False), 0.1)
    assert model.training


# 4. An unusable run_dir fails first.


@pytest.mark.parametrize("where", ["afile", "afile/run"])
def test_an_unusable_run_dir_gives_one_line_before_anything_runs(tmp_path, capsys, where):
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    _, sets = tiny_config(tmp_path, tmp_path / where, "train.max_updates=2")
    code, err = run_cli(capsys, "train", *set_args(sets))
    assert code == 2 and err[-1].startswith("aiayn: error: ") and "train.run_dir" in err[-1], err
    assert not any("SentencePiece" in line for line in err)  # nothing was trained first
    assert (tmp_path / "afile").read_text(encoding="utf-8") == "x"


def test_without_tomllib_configs_are_read_with_tomli(tmp_path):
    """Python 3.10, which pyproject allows, has no tomllib: `aiayn train` and `demo` were an ImportError
    there, though tomli was a dependency for it. A process without tomllib: on 3.11 and later, tomli standing
    in for the tomllib hidden; on 3.10, the tomli installed."""
    import subprocess
    import sys

    (tmp_path / "run.toml").write_text('[train]\nmax_updates = 7\n', encoding="utf-8")
    hide = ("import types, tomllib\n"
            "tomli = types.ModuleType('tomli')  # tomllib is tomli taken into the standard library\n"
            "tomli.loads, tomli.TOMLDecodeError = tomllib.loads, tomllib.TOMLDecodeError\n"
            "sys.modules['tomli'], sys.modules['tomllib'] = tomli, None\n")
    script = ("import sys\n" + (hide if sys.version_info >= (3, 11) else "") +
              "from aiayn.train.config import load_config, tomllib as parser\n"
              f"print(parser.__name__, load_config({str(tmp_path / 'run.toml')!r}, []).train.max_updates)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["tomli", "7"]


def test_a_second_config_file_is_refused_not_taken_instead_of_the_first(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", "base.toml", "--config", "mine.toml"])
    assert capsys.readouterr().err == ("aiayn train: error: --config given twice (base.toml, mine.toml): one "
                                       "file; change its values with --set (see aiayn train --help)\n")


def test_a_config_path_that_is_not_a_readable_file_is_one_line_saying_what_it_is(tmp_path, monkeypatch):
    fifo = tmp_path / "c.fifo"
    os.mkfifo(fifo)
    unreadable = tmp_path / "locked.toml"
    unreadable.write_text("[train]\n", encoding="utf-8")
    real_read_bytes = Path.read_bytes

    def read_bytes(self):  # chmod 000 does not stop root, whom CI may run as
        if self == unreadable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    for path, problem in [(tmp_path, "is a directory, not a config file"),
                          (Path("/dev/null"), "not a regular file"),  # a device
                          (tmp_path / "none.toml", "config file not found"),
                          (unreadable, r"cannot read \(Permission denied\)")]:
        with pytest.raises(UserError, match=f"^{path}: {problem}$"):  # was a traceback, or "not found"
            load_config(path)
    # a pipe, as `--config <(sed ... base.toml)` gives, is read once: it was refused as not a regular file
    writer = threading.Thread(target=lambda: fifo.write_text("[train]\nmax_updates = 7\n", encoding="utf-8"))
    writer.start()
    assert load_config(fifo).train.max_updates == 7
    writer.join()


def test_config_paths_and_line_ends_that_said_the_wrong_thing(tmp_path, monkeypatch):
    """A dangling link and '-' were "config file not found"; CR-only line ends, tomllib's "Expected
    newline ... at column 8"; an array of tables ([[train]]) was named without its line."""
    monkeypatch.chdir(tmp_path)
    Path("link.toml").symlink_to("gone.toml")
    Path("chain.toml").symlink_to("link.toml")  # the end of the chain named, not link.toml, which exists
    for link in ("link.toml", "chain.toml"):
        gone = re.escape(str(tmp_path / "gone.toml"))
        with pytest.raises(UserError, match=rf"^{link}: a symbolic link to {gone}, which does not exist$"):
            load_config(link)
    with pytest.raises(UserError, match=r"^-: a config file is not read from standard input as '-'; name a "):
        load_config("-")
    Path("mac.toml").write_bytes(b"[train]\rwarmup = 1\r")
    with pytest.raises(UserError, match=r"^mac\.toml: CR line ends and no LF \(a classic Mac OS file\?\)"):
        load_config("mac.toml")
    Path("array.toml").write_text("[model]\n[[train]]\nwarmup = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^array\.toml:2: train = \[\{'warmup': 1\}\] is not a table; "):
        load_config("array.toml")
    Path("array.toml").write_text("[train]\n[[foo]]\n", encoding="utf-8")  # a section, not a value
    with pytest.raises(ConfigError, match=r"^array\.toml:2: unknown section \[foo\] \(known: "):
        load_config("array.toml")


def test_dropped_empty_pairs_are_reported_once(tmp_path, caplog):
    """The tokenizer's scan, the early validation check and the encoding each said it (three lines)."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    src = Path(config.data.train_src)
    lines = src.read_text(encoding="utf-8").splitlines()
    src.write_text("\n".join([""] * 5 + lines[5:]) + "\n", encoding="utf-8")  # 5 pairs lose a side
    with caplog.at_level(logging.INFO):
        train(config)
    said = [m for m in caplog.messages if "with a side" in m and m.startswith(str(src))]
    tgt = config.data.train_tgt
    want = f"{src}, {tgt}: dropped 5 pair(s) of {len(lines)} with a side empty or of no pieces (5 empty in {src})"
    assert said == [want], said


def test_an_unwritable_checkpoints_folder_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    """Found at the first save before, `valid_every` updates (hours, in a real run) later."""
    import tempfile

    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    real = tempfile.TemporaryFile

    def temporary_file(*args, dir=None, **kwargs):  # chmod 555 does not stop root, whom CI may run as
        if dir is not None and Path(dir).name == "checkpoints":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    code, err = run_cli(capsys, "train", *set_args(sets))
    assert code == 2 and err[-1] == f"aiayn: error: {tmp_path / 'run' / 'checkpoints'}: cannot be written " \
        "(Permission denied)", err
    assert not any("SentencePiece" in line for line in err)  # nothing was trained first


def test_a_cache_folder_that_is_a_file_is_one_line_before_training(tmp_path, capsys):
    """Found after the tokenizer's training, as the ids cache was written: "cannot write ... (File
    exists)"."""
    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "cache").write_text("x", encoding="utf-8")
    code, err = run_cli(capsys, "train", *set_args(sets))
    cache = tmp_path / "run" / "cache"
    assert code == 2 and err[-1] == f"aiayn: error: {cache}: exists and is not a directory", err
    assert not any("SentencePiece" in line for line in err)  # nothing was trained first
    assert (tmp_path / "run" / "cache").read_text(encoding="utf-8") == "x"


def test_an_unreadable_cache_folder_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    """A cache/ of mode 000, or another user's of 0700: a PermissionError traceback after the tokenizer's
    training, from the look for a cached encoding."""
    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    cache = tmp_path / "run" / "cache"
    cache.mkdir(parents=True)
    real = os.scandir

    def scandir(path="."):  # chmod 000 does not stop root, whom CI may run as
        if Path(path) == cache:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    code, err = run_cli(capsys, "train", *set_args(sets))
    assert code == 2 and err[-1] == f"aiayn: error: {cache}: cannot be read (Permission denied)", err
    assert not any("SentencePiece" in line for line in err)


def test_a_full_run_dir_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    """The probe made an empty file, which a full disk allows: the run went on to the lock, a traceback."""
    import tempfile

    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    real = tempfile.TemporaryFile

    class FullDisk:  # a file the full disk made, no byte of which can be written
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "TemporaryFile", lambda *args, **kwargs: FullDisk(real(*args, **kwargs)))
    code, err = run_cli(capsys, "train", *set_args(sets))
    assert code == 2 and err[-1] == f"aiayn: error: {tmp_path / 'run'}: train.run_dir cannot be written " \
        "(No space left on device)", err
    assert not (tmp_path / "run" / ".lock").exists()


# 5. A full disk: one line naming the file, no temporary file left.


def test_a_full_disk_while_saving_the_tokenizer(tmp_path, monkeypatch):
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    fsync = os.fsync

    def full_disk_fsync(fd):  # what a disk that filled up says when the model's blocks are flushed
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(".spm.model."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_fsync)
    with pytest.raises(UserError, match=r"spm\.model: cannot write \(No space left"):
        train(config)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "spm" in p.name) == []


def test_a_full_disk_while_caching_the_ids(finished_run, tmp_path, monkeypatch):
    d, config, _ = finished_run
    (tmp_path / "run").mkdir()
    shutil.copy(d / "run" / "spm.model", tmp_path / "run" / "spm.model")  # an old run dir: no record

    def full_disk_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 10)
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr("aiayn.data.dataset.save_file", full_disk_save)
    with pytest.raises(UserError, match=r"cache/train\.de-train\.en\..*\.safetensors: cannot write the encoded-ids"):
        train(with_train(config, run_dir=str(tmp_path / "run")))
    assert list((tmp_path / "run" / "cache").iterdir()) == []


def test_ctrl_c_while_caching_the_ids_leaves_no_temporary(finished_run, tmp_path, monkeypatch):
    """The temporary is named by pid, so a rerun never reuses it: 86 MB were left for good per Ctrl-C."""
    d, config, _ = finished_run
    (tmp_path / "run").mkdir()
    shutil.copy(d / "run" / "spm.model", tmp_path / "run" / "spm.model")

    def interrupted_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr("aiayn.data.dataset.save_file", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        train(with_train(config, run_dir=str(tmp_path / "run")))
    assert list((tmp_path / "run" / "cache").iterdir()) == []


@pytest.mark.parametrize("setting", ["patience=2", "bleu_every=10"])
def test_settings_that_read_the_validation_set_need_one(tmp_path, setting):
    """They were silently ignored without one."""
    _, sets = tiny_config(tmp_path, tmp_path / "run")
    no_valid = [s for s in sets if not s.startswith("data.valid_")]
    # the --set, not the file
    message = rf"^--set 'train\.{setting}': train\.{setting} needs a validation set \("
    with pytest.raises(ConfigError, match=message):
        load_config(None, no_valid + [f"train.{setting}"])


# 6. A vocabulary smaller than the corpus' characters.


def test_a_vocabulary_smaller_than_the_alphabet_names_the_setting(tmp_path):
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2", "data.vocab_size=8")
    chars = len(set(" ".join(read_lines(config.data.train_src) + read_lines(config.data.train_tgt))))
    with pytest.raises(UserError) as e:
        train(config)
    assert str(e.value).startswith(f"data.vocab_size=8: the text has {chars} distinct characters, too many ")
    assert f"raise data.vocab_size to at least {chars + 4}, or lower data.character_coverage" in str(e.value)
    assert "--character_coverage" not in str(e.value)  # SentencePiece's flag, which aiayn does not have


# 7. Malformed configurations.


@pytest.mark.parametrize("toml", ["model = 3\n", 'data = "x"\n', "train = [1]\n"])
def test_a_section_that_is_not_a_table_names_file_and_section(tmp_path, toml):
    path = tmp_path / "bad.toml"
    path.write_text(toml, encoding="utf-8")
    section = toml.split(" ")[0]
    message = rf"bad\.toml:1: {section} = .* is not a table; write a \[{section}\]"
    with pytest.raises(ConfigError, match=message):
        load_config(path, [f"{section}.preset=micro"] if section == "model" else [])
    with pytest.raises(ConfigError, match=rf"bad\.toml:1: {section} = "):
        load_config(path)


@pytest.mark.parametrize("toml, message", [
    ('preset = "big"\n[model]\n', "preset is outside any section; put it under [model]"),
    ("max_len = 64\n[data]\n", "max_len is outside any section; put it under [data] or [model]"),
    # [model]'s vocab_size is the tokenizer's, not the user's
    ("vocab_size = 64\n", "vocab_size is outside any section; put it under [data]"),
    ("max_tokenz = 64\n",
     "max_tokenz is outside any section; no section has such a key (sections: data, model, train)"),
    ("[pre]\nx = 1\n", "unknown section [pre] (known: data, model, train)"),
])
def test_a_key_before_any_section_is_said_to_be_outside_one(tmp_path, toml, message):
    """It was "unknown section [preset]": TOML makes a key above the first header a top-level value."""
    path = tmp_path / "top.toml"
    path.write_text(toml, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:1: {re.escape(message)}$"):
        load_config(path)


def test_data_and_train_problems_are_said_together(tmp_path):
    """[data]'s were said alone, and [train]'s only once they were mended: a second run to find them."""
    path = tmp_path / "m1.toml"
    path.write_text("[train]\nwarmup = 0\nmax_tokens = 0\n[data]\nmax_len = 1\nvocab_size = 2\n",
                    encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}:6: data.vocab_size=2 must be >= 8; {path}:5: data.max_len=1 must be "
                            f">= 2; {path}:3: train.max_tokens=0 must be >= 1; {path}:2: train.warmup=0 "
                            "must be >= 1")
    both = r"^config: data.max_len=1 must be >= 2; train.warmup=0 must be >= 1$"
    with pytest.raises(ConfigError, match=both):
        run_config({"data": {"max_len": 1}, "train": {"warmup": 0}}, "config")


def test_a_key_in_another_section_names_the_section_that_has_it(tmp_path):
    """"unknown [train] key max_len (known: ...)" said nothing of [data] and [model], which have it, as a
    key above every section is told where to go."""
    path = tmp_path / "k.toml"
    path.write_text("[data]\nmax_len = 1\n[train]\nmax_len = 5\nvocab_size = 9\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}:4: unknown [train] key max_len (put it under [data] or [model]); "
                            f"{path}:5: unknown [train] key vocab_size (put it under [data])")
    path.write_text("[train]\nmax_len = 5\nmax_tokenz = 9\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r":3: unknown \[train\] key max_tokenz \(known: adam_beta1, "):
        load_config(path)  # a typo: the keys [train] has
    with pytest.raises(ConfigError, match=r"^--set 'train.max_len=5': unknown train key 'max_len'; did you "
                                          r"mean data.max_len or model.max_len\?$"):
        load_config(None, ["train.max_len=5"])


def test_an_unknown_set_key_is_blamed_on_set_not_the_file(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("[train]\nmax_updates = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"--set 'train\.max_updatez=3': unknown train key") as e:
        load_config(path, ["train.max_updatez=3"])
    assert str(path) not in str(e.value)
    with pytest.raises(ConfigError, match="--set 'trian.max_updates=3': unknown section"):
        load_config(path, ["trian.max_updates=3"])
    assert load_config(path, ["train.max_updates=5"]).train.max_updates == 5


@pytest.mark.parametrize("where", ["file", "set"])
def test_an_unknown_model_key_lists_only_the_keys_that_may_be_set(tmp_path, where):
    """--set listed vocab_size, pad_id and the other tokenizer fields as known, then refused each one as
    coming from the tokenizer; the file's message left them out."""
    path = tmp_path / "run.toml"
    path.write_text("[model]\nn_head = 4\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unknown .*n_head.*known: ") as e:
        load_config(path, []) if where == "file" else load_config(None, ["model.n_head=4"])
    known = str(e.value).rpartition("known: ")[2].strip(")").split(", ")
    assert "n_heads" in known and "preset" in known
    assert not {"vocab_size", "tgt_vocab_size", "pad_id", "decoder_start_id", "eos_id"} & set(known)


def test_zero_heads_is_a_config_error_not_a_division_by_zero():
    with pytest.raises(ConfigError, match="n_heads=0 must be positive"):
        model_config("micro", vocab_size=50, n_heads=0)
    with pytest.raises(ConfigError, match="n_heads=0 must be positive"):
        load_config(None, ["model.preset=micro", "model.n_heads=0"])


def test_cuda_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device='cuda', but PyTorch sees no CUDA GPU"):
        distributed.setup("cuda")


@pytest.mark.parametrize("key", ["data.train_src", "data.valid_tgt", "train.run_dir", "train.init_from"])
def test_a_path_whose_name_is_not_utf8_is_refused_up_front(key):
    """It trained, then the first checkpoint's meta.json failed with a UnicodeEncodeError traceback."""
    name = os.fsdecode(b"/tmp/tr\xff.de")  # as Python holds a name of such bytes: a surrogate
    sets = [f"{key}={name}"] + (["data.valid_src=v.de"] if key == "data.valid_tgt" else [])
    with pytest.raises(ConfigError, match=re.escape(f"{key}='/tmp/tr\\xff.de': the name is not UTF-8")):
        load_config(None, sets)
    lone = [f"{key}=/tmp/tr\ud800.de"] + sets[1:]  # from Python, a surrogate no byte is: was a traceback
    with pytest.raises(ConfigError, match=re.escape(f"{key}='/tmp/tr\\ud800.de': the name is not UTF-8")):
        load_config(None, lone)


ESCAPE_HINT = ("in TOML's \"...\" a backslash starts an escape: write such a path in '...', which keeps "
               "backslashes, or with /")


@pytest.mark.parametrize("key", ["data.train_src", "data.valid_tgt", "train.run_dir", "train.init_from"])
def test_a_path_with_a_control_character_is_refused_where_it_was_written(tmp_path, key):
    r"""A TOML escape nobody meant: `run_dir = "C:\runs\new"` (a Windows habit) trained into a directory
    whose name held CR and LF, and --set 'train.run_dir="runs/a\nb"' into one holding a line break, which
    split the result's line; --set refused a line break typed as one, not one TOML made of \n."""
    section, name = key.split(".")
    other = "valid_src = 'v.de'\n" if key == "data.valid_tgt" else ""
    toml = tmp_path / "run.toml"
    toml.write_text(f"[{section}]\n{other}{name} = \"C:\\runs\\new\"\n", encoding="utf-8")
    line = 3 if other else 2
    with pytest.raises(ConfigError, match=re.escape(
            f"{toml}:{line}: {key}='C:\\runs\\new' holds a carriage return (\\r), which no path should have; "
            + ESCAPE_HINT) + "$"):
        load_config(toml)
    sets = [f"{section}.valid_src=v.de"] if other else []
    item = f'{key}="runs/a\\nb"'
    with pytest.raises(ConfigError, match=re.escape(
            f"--set {item!r}: {key}='runs/a\\nb' holds a line feed (\\n), which no path should have; "
            + ESCAPE_HINT) + "$"):
        load_config(None, [*sets, item])
    with pytest.raises(ConfigError, match=re.escape(  # no escape makes DEL: no hint
            f"{key}='a\\x7fb' holds the control character U+007F, which no path should have") + "$"):
        load_config(None, [*sets, f"{key}=a\x7fb"])


@pytest.mark.parametrize("key", ["data.train_src", "train.run_dir"])
def test_a_name_too_long_or_with_a_nul_is_one_line(tmp_path, key):
    """Path.is_dir() and exists() let ENAMETOOLONG through: a traceback; a NUL, stat()'s ValueError (now
    refused with the other control characters, as the configuration is read)."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", f"{key}={tmp_path / ('a' * 300)}")
    said = {"data.train_src": "file name too long",
            "train.run_dir": "train.run_dir cannot be used \\(File name too long"}[key]
    with pytest.raises(UserError, match=f"a{{300}}: {said}"):
        train(config)
    with pytest.raises(ConfigError, match=f"{key}=.*a\\\\x00b' holds the control character U\\+0000"):
        tiny_config(tmp_path, tmp_path / "run", f"{key}={tmp_path / 'a'}\0b")  # refused before any work


@pytest.mark.parametrize("setting, problem", [
    ("data.shared_vocab=false", "one shared vocabulary, not data.shared_vocab=false"),
    ("data.vocab_size=20", "40 pieces, more than data.vocab_size=20"),
])
def test_a_tokenizer_left_in_run_dir_must_be_one_data_trains(finished_run, tmp_path, setting, problem):
    """A tokenizer in run_dir without the record of what it was trained with (copied there, or an
    older run's) was used whatever [data] said, and recorded as trained with [data]'s settings."""
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    shutil.rmtree(run / "checkpoints")
    (run / "tokenizer_inputs.json").unlink()
    sets = finished_run[2]
    config = load_config(None, [*sets, f"train.run_dir={run}", setting])
    with pytest.raises(UserError, match=f"^{run}: its tokenizer has {problem}; delete it"):
        train(config)


def user_spm(path: Path, lines: Path, **options: float | str) -> None:
    """A SentencePiece model trained as a user would, with SentencePiece's defaults (special ids unk=0,
    bos=1, eos=2, no pad; a unigram model, nmt_nfkc, character_coverage 0.9995) but for `options`, written
    to `path`."""
    model = io.BytesIO()
    text = lines.read_text(encoding="utf-8").splitlines()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=40,
                                   hard_vocab_limit=False, minloglevel=2, **options)
    path.write_bytes(model.getvalue())


@pytest.mark.parametrize("ids, missing", [
    ({}, "pad piece (pad_id=-1)"),  # SentencePiece's defaults
    ({"pad_id": 3, "bos_id": -1}, "bos piece (bos_id=-1)"),
    ({"pad_id": 3, "eos_id": -1}, "eos piece (eos_id=-1)"),
])
def test_a_tokenizer_left_in_run_dir_without_a_special_piece_is_refused_first(tmp_path, ids, missing):
    """It was used ("using the tokenizer there"), the corpus encoded and cached, then the model's
    configuration refused "pad_id=-1 is outside the vocabulary of 40", naming neither file nor fix."""
    config, _ = tiny_config(tmp_path, tmp_path / "run")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / "spm.model", Path(config.data.train_src), **ids)
    with pytest.raises(UserError, match=f"^{re.escape(str(run / 'spm.model'))}: the SentencePiece model has "
                                        f"no {re.escape(missing)}; aiayn needs pad, bos and eos pieces"):
        train(config)
    assert not (run / "cache").exists()  # refused before any encoding


def test_a_tokenizer_left_in_run_dir_may_have_its_own_special_ids(tmp_path, caplog):
    """Any ids will do, as long as the pieces exist: pad=3 beside SentencePiece's unk=0 trains."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1", "data.spm_type=unigram")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / "spm.model", Path(config.data.train_src), pad_id=3)
    with caplog.at_level(logging.INFO):
        assert train(config)["step"] == 1
    assert any("using the tokenizer there" in m for m in caplog.messages)


def test_a_tokenizer_left_in_run_dir_must_have_datas_model_type_and_normalization(tmp_path, caplog):
    """A model trained with another normalization (case folding) or model type was used unsaid, and
    meta.json recorded [data]'s: "nmt_nfkc" and "bpe" for a case-folding unigram model. Its character
    coverage (SentencePiece's default 0.9995) is said, not refused."""
    config, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / "spm.model", Path(config.data.train_src), pad_id=0, bos_id=1, eos_id=2, unk_id=3,
             normalization_rule_name="nmt_nfkc_cf")  # and SentencePiece's unigram
    with pytest.raises(UserError) as e:
        train(config)
    assert str(e.value) == (
        f"{run / 'spm.model'}: trained with spm_type \"unigram\" and normalization \"nmt_nfkc_cf\", not "
        "data.spm_type=bpe (the default) and data.normalization=nmt_nfkc (the default); set "
        "data.spm_type=\"unigram\" and data.normalization=\"nmt_nfkc_cf\" to train with it, or delete the "
        "tokenizer (spm.model, or source.spm and target.spm) to train a new one")
    assert not (run / "cache").exists()
    agreed = load_config(None, [*sets, "data.spm_type=unigram", "data.normalization=nmt_nfkc_cf"])
    with caplog.at_level(logging.INFO):
        assert train(agreed)["step"] == 1
    data = read_meta(checkpoint_dirs(run)[-1])["config"]["data"]
    assert (data["spm_type"], data["normalization"]) == ("unigram", "nmt_nfkc_cf")
    assert (f"{run / 'spm.model'}: trained with character_coverage=0.9995, not data.character_coverage=1.0, "
            "which only training a tokenizer uses (the run records it as set)") in caplog.messages


def test_a_tokenizer_left_in_run_dir_that_no_data_setting_trains_is_refused(tmp_path):
    """A character model: data.spm_type has no value for it, so no --set is advised."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / "spm.model", Path(config.data.train_src), pad_id=0, bos_id=1, eos_id=2, unk_id=3,
             model_type="char")
    with pytest.raises(UserError) as e:
        train(config)
    assert str(e.value) == (f"{run / 'spm.model'}: trained with spm_type \"char\", which data.spm_type "
                            "cannot be (bpe or unigram); delete the tokenizer (spm.model, or source.spm and "
                            "target.spm) to train a new one")


def test_a_tokenizer_left_in_run_dir_is_checked_against_the_training_text(tmp_path, caplog):
    """Its normalization's rewriting of the text was never checked (only a tokenizer aiayn trained, or one
    kept by a fine-tune or resume, was): a Persian ZWNJ made a space in every line, unsaid."""
    config, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    src = Path(config.data.train_src)
    joined = tmp_path / "joined.de"
    joined.write_text("".join(f"{line}\u200cein\n" for line in src.read_text(encoding="utf-8").splitlines()),
                      encoding="utf-8")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / "spm.model", joined, pad_id=0, bos_id=1, eos_id=2, unk_id=3, model_type="bpe",
             character_coverage=1.0)
    with caplog.at_level(logging.WARNING):
        assert train(load_config(None, [*sets, f"data.train_src={joined}"]))["step"] == 1
    said = [m for m in caplog.messages if "changes the training text" in m]
    start = "data.normalization='nmt_nfkc' changes the training text the model will read ("
    assert len(said) == 1 and said[0].startswith(start) and "U+200C" in said[0]
    assert 'set data.normalization = "nfkc"' in said[0]


def test_separate_tokenizers_left_in_run_dir_must_share_their_special_ids(tmp_path):
    """The ids come from target.spm: a source.spm with pad=3, unk=0 beside aiayn's pad=0, unk=3 had its
    sources padded with its <unk> id, and their unknown pieces read as padding, silently."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "data.shared_vocab=false", "train.max_updates=1")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / "source.spm", Path(config.data.train_src), pad_id=3)
    user_spm(run / "target.spm", Path(config.data.train_tgt), pad_id=0, bos_id=1, eos_id=2, unk_id=3)
    said = (f"{run / 'source.spm'}: special ids other than {run / 'target.spm'}'s "
            "(pad_id=3, not 0; unk_id=0, not 3); aiayn takes both sides' from target.spm")
    with pytest.raises(UserError, match=f"^{re.escape(said)}"):
        train(config)


def test_unknown_pieces_of_pairs_max_len_drops_are_not_warned_of(tmp_path, caplog):
    """A line past SentencePiece's limit (so left out of the tokenizer's training: its digits <unk>) and
    past data.max_len warned "12000 of its ... pieces (...) are <unk>", blaming the tokenizer's training
    text, then that data.max_len drops it: training never sees it."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    for path, line in ((config.data.train_src, " ".join(f"wort{i}" for i in range(12000))),
                       (config.data.train_tgt, "a long line")):
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    with caplog.at_level(logging.INFO):
        assert train(config)["step"] == 1
    assert [m for m in caplog.messages if "<unk>" in m] == []
    assert any("of 61 training pairs are longer than 32 tokens" in m for m in caplog.messages)


def test_unknown_pieces_are_counted_at_this_run_s_max_len_from_the_cache_too(tmp_path, caplog, monkeypatch):
    """The count was the encoding's, at the data.max_len of the run that encoded: a rerun that raised it,
    as the dropped pairs' warning advises, read the cache (whose key has no max_len) and trained on a
    line of <unk> pieces unwarned. It is counted every run, in the pairs that run keeps."""
    config, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1", "data.max_len=20",
                               "train.max_tokens=200", "data.spm_type=unigram")
    run = Path(config.train.run_dir)
    run.mkdir()
    both = tmp_path / "both.txt"  # a shared model of the two sides, as a user's would be
    both.write_text(Path(config.data.train_src).read_text() + Path(config.data.train_tgt).read_text())
    user_spm(run / "spm.model", both, pad_id=0, bos_id=1, eos_id=2, unk_id=3, character_coverage=1.0)
    lines = ((config.data.train_src, " ".join(["我们"] * 30)), (config.data.train_tgt, "the dog"))
    for path, line in lines:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "build_model", stopped)  # a first run stopped after its data, before a save
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
        train(config)
    assert [m for m in caplog.messages if "<unk>" in m] == []  # the line is past max_len=20
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert train(load_config(None, [*sets, "data.max_len=64"]))["step"] == 1
    assert any("pairs from the cache" in m for m in caplog.messages)
    said = [m for m in caplog.messages if "<unk>" in m]
    assert len(said) == 1 and said[0].startswith(f"{config.data.train_src}: 30 of its ")


@pytest.mark.parametrize("bleu_every, warned", [(4, True), (0, False)])
def test_unknown_validation_pieces_are_counted_in_every_pair_bleu_translates(tmp_path, caplog, bleu_every,
                                                                             warned):
    """Validation's <unk> pieces were counted within data.max_len, which only its loss keeps: its BLEU
    translates every pair, a long line of characters the tokenizer lacks among them, unwarned."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1",
                            f"train.bleu_every={bleu_every}")
    lines = ((config.data.valid_src, " ".join(["我们 Hund"] * 30)), (config.data.valid_tgt, "a dog"))
    for path, line in lines:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    with caplog.at_level(logging.WARNING):
        assert train(config)["step"] == 1
    said = [m for m in caplog.messages if "<unk>" in m]
    assert len(said) == warned and all(m.startswith(f"{config.data.valid_src}: 30 of its ") for m in said)


@pytest.mark.parametrize("lone, partner", [("source.spm", "target.spm"), ("target.spm", "source.spm")])
def test_half_a_pair_of_tokenizers_left_in_run_dir_is_refused_not_trained_over(tmp_path, lone, partner):
    """A lone source.spm was taken for no tokenizer: data.shared_vocab=false trained a new pair and wrote
    it over the user's model, unsaid."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "data.shared_vocab=false", "train.max_updates=1")
    run = Path(config.train.run_dir)
    run.mkdir()
    user_spm(run / lone, Path(config.data.train_src), pad_id=0, bos_id=1, eos_id=2, unk_id=3)
    mine = (run / lone).read_bytes()
    with pytest.raises(UserError) as e:
        train(config)
    assert str(e.value) == (f"{run / lone}: no {partner} beside it (separate vocabularies take both; a "
                            f"shared one is spm.model alone); put {partner} there, or delete {lone} to "
                            "train a new tokenizer")
    assert (run / lone).read_bytes() == mine and not (run / partner).exists()


def test_half_a_pair_left_by_aiayn_s_own_training_is_trained_again(tmp_path, monkeypatch):
    """A kill between the tokenizer training's two files leaves source.spm beside aiayn's record
    (tokenizer_inputs.json): trained again, as it was before lone files were refused (a user's is)."""
    from aiayn.data import dataset

    config, _ = tiny_config(tmp_path, tmp_path / "run", "data.shared_vocab=false", "train.max_updates=1")
    run = Path(config.train.run_dir)
    write_model = dataset.write_model

    def killed(path, model):
        if path.name == "target.spm":
            raise KeyboardInterrupt
        write_model(path, model)

    monkeypatch.setattr(dataset, "write_model", killed)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    assert (run / "source.spm").is_file() and not (run / "target.spm").exists()
    monkeypatch.setattr(dataset, "write_model", write_model)
    assert train(config)["step"] == 1 and (run / "target.spm").is_file()


def test_resume_mends_half_a_pair_that_is_its_checkpoint_s_and_refuses_another(tmp_path, caplog):
    """--resume put a checkpoint's pair back where target.spm was gone (deleted, or a full disk during its
    own restore: source.spm is written first); refused as a lone file, it could never resume. A lone file
    that is not the checkpoint's is refused and kept (it was written over, unsaid); a tokenizer of the
    other kind left there is said, unused: the checkpoints' is what counts."""
    config, sets = tiny_config(tmp_path, tmp_path / "run", "data.shared_vocab=false", "train.max_updates=1")
    run = Path(config.train.run_dir)
    train(config)
    (run / "target.spm").unlink()
    ours = (run / "source.spm").read_bytes()
    user_spm(run / "source.spm", Path(config.data.train_src), pad_id=0, bos_id=1, eos_id=2, unk_id=3)
    theirs = (run / "source.spm").read_bytes()
    step = [s for s in sets if "max_updates" not in s]
    with pytest.raises(UserError) as e:
        train(load_config(None, [*step, "train.max_updates=2"]), resume=True)
    checkpoint = checkpoint_dirs(run)[-1]
    assert str(e.value) == (f"{run / 'source.spm'}: not the source.spm of {checkpoint}'s tokenizer (damaged, "
                            f"replaced, or another run's), and no target.spm beside it; move it out of "
                            f"{run}: --resume then puts the checkpoint's tokenizer back")
    assert (run / "source.spm").read_bytes() == theirs and not (run / "target.spm").exists()
    (run / "source.spm").write_bytes(ours)
    assert train(load_config(None, [*step, "train.max_updates=2"]), resume=True)["step"] == 2
    assert (run / "target.spm").read_bytes() == (checkpoint / "target.spm").read_bytes()
    user_spm(run / "spm.model", Path(config.data.train_src), pad_id=0, bos_id=1, eos_id=2, unk_id=3)
    with caplog.at_level(logging.WARNING):
        assert train(load_config(None, [*step, "train.max_updates=3"]), resume=True)["step"] == 3
    assert f"{run}: spm.model left unused there: the checkpoints' tokenizer is source.spm and target.spm" \
        in caplog.messages


def test_a_shared_and_a_separate_tokenizer_left_in_run_dir_are_refused(tmp_path):
    """spm.model beside source.spm and target.spm was used, the pair ignored, unsaid."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    run = Path(config.train.run_dir)
    run.mkdir()
    for name in ("spm.model", "source.spm", "target.spm"):
        user_spm(run / name, Path(config.data.train_src), pad_id=0, bos_id=1, eos_id=2, unk_id=3)
    with pytest.raises(UserError) as e:
        train(config)
    assert str(e.value) == (f"{run}: holds spm.model (one shared vocabulary) beside source.spm and "
                            "target.spm (separate ones): two tokenizers; delete the one not meant")
    assert not (run / "cache").exists()


@pytest.mark.parametrize("written, item, message", [
    ("[data]\nmax_len = 64", "model.max_len=32", "data.max_len=64 is longer than model.max_len=32"),
    ("[model]\nd_model = 36", "model.n_heads=8", "model.d_model=36 is not divisible by model.n_heads=8"),
    ("[train]\ncooldown = 0.5", "train.max_updates=0",
     "train.cooldown needs a budget to end at: train.max_minutes, train.max_updates or train.max_epochs"),
])
def test_a_contradiction_names_both_places(tmp_path, written, item, message):
    """Each setting a contradiction names is placed: "the model's max_len=32" and "n_heads=8" named no
    setting, and the error blamed the file's line alone for a value --set had written."""
    toml = tmp_path / "run.toml"
    toml.write_text(written + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(toml))}:2 and --set {re.escape(repr(item))}: "
                                          rf"{re.escape(message)}$"):
        load_config(toml, [item])


@pytest.mark.parametrize("written, message", [
    ("[model]\nmax_len = 5", "{toml}:2: data.max_len=256 (the default) is longer than model.max_len=5"),
    ("[data]\nmax_len = 2000", "{toml}:2: data.max_len=2000 is longer than model.max_len=1024 (the default)"),
    ("[train]\nmax_tokens = 100",
     "{toml}:2: data.max_len=256 (the default) does not fit in train.max_tokens=100"),
])
def test_a_contradiction_with_a_default_says_it_is_one(tmp_path, written, message):
    """Placed at the line of the setting written, it read as if the user had written the default too."""
    toml = tmp_path / "run.toml"
    toml.write_text(written + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(toml)
    assert str(e.value) == message.format(toml=toml)


def test_validation_files_come_in_pairs():
    with pytest.raises(ConfigError, match="data.valid_src and data.valid_tgt"):
        DataConfig(valid_src="v.de")
    with pytest.raises(ConfigError, match="data.valid_src and data.valid_tgt"):
        DataConfig(valid_tgt="v.en")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(normalization="nfd"), "data.normalization='nfd' is not one of nmt_nfkc, nfkc, nmt_nfkc_cf"),
        (dict(normalization="NFKC"), "data.normalization='NFKC'"),
        (dict(character_coverage=0.0), r"data.character_coverage=0.0 is not in \[0.98, 1\]"),
        (dict(character_coverage=0.5), r"data.character_coverage=0.5 is not in \[0.98, 1\] \(SentencePiece"),
        (dict(character_coverage=1.5), "data.character_coverage=1.5"),
        (dict(character_coverage=-0.5), "data.character_coverage=-0.5"),
        (dict(character_coverage=math.nan), "data.character_coverage=nan"),
    ],
)
def test_data_config_refuses_a_normalization_or_coverage_sentencepiece_has_not(changes, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**changes)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("adam_beta1=1.5", r"train.adam_beta1=1.5 is not in \[0, 1\)"),  # was torch's traceback after encoding
        ("adam_beta2=1.0", r"train.adam_beta2=1.0 is not in \[0, 1\)"),
        ("adam_eps=0.0", "train.adam_eps=0.0 must be a finite number > 0"),  # was NaN at update 10
        ("adam_eps=-1.0", "train.adam_eps=-1.0"),
    ],
)
def test_adam_settings_are_checked_with_the_config(setting, message):
    name, value = setting.split("=")
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{name: float(value)})


@pytest.mark.parametrize("eps", [0.0, -1.0, math.nan, math.inf])
def test_layer_norm_eps_must_be_a_positive_number(eps):
    with pytest.raises(ConfigError, match=f"layer_norm_eps={eps} must be a finite number > 0"):
        model_config("micro", vocab_size=100, layer_norm_eps=eps)


def test_normalization_and_character_coverage_can_be_set(tmp_path):
    config = load_config(None, ["data.normalization=identity", "data.character_coverage=0.9995"])
    assert (config.data.normalization, config.data.character_coverage) == ("identity", 0.9995)
    assert (DataConfig().normalization, DataConfig().character_coverage) == ("nmt_nfkc", 1.0)  # as before


def test_a_directory_given_as_a_corpus_says_so(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        read_lines(tmp_path)
    with pytest.raises(UserError, match="file not found"):
        read_lines(tmp_path / "nope.de")


# 8. Damaged checkpoint files are named.


def test_a_corrupt_trainer_json_is_named(finished_run, tmp_path):
    config = copy_run(finished_run, tmp_path)
    (checkpoint_dirs(config.train.run_dir)[-1] / "trainer.json").write_text("{garbage", encoding="utf-8")
    with pytest.raises(UserError, match=r"step_000004/trainer\.json: corrupt training state"):
        train(with_train(config, max_updates=6), resume=True)


def test_a_meta_json_whose_config_is_not_a_table_is_named(finished_run, tmp_path):
    config = copy_run(finished_run, tmp_path)
    meta_path = checkpoint_dirs(config.train.run_dir)[-1] / "meta.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta_path.write_text(json.dumps({**meta, "config": "x"}), encoding="utf-8")
    with pytest.raises(UserError, match=r"step_000004/meta\.json: corrupt checkpoint metadata \('config'"):
        train(with_train(config, max_updates=6), resume=True)


# 9. A tokenizer left by a failed first run is reused only for the same data.


def test_a_tokenizer_left_by_a_failed_run_is_reused_only_for_the_same_data(tmp_path):
    run = tmp_path / "run"
    long_src, long_tgt = tmp_path / "long.de", tmp_path / "long.en"
    long_src.write_text("ein Hund läuft über die Wiese " * 12 + "\n", encoding="utf-8")
    long_tgt.write_text("a dog runs across the meadow " * 12 + "\n", encoding="utf-8")
    bad_valid = [f"data.valid_src={long_src}", f"data.valid_tgt={long_tgt}"]
    config, sets = tiny_config(tmp_path, run, "train.max_updates=1", "train.valid_every=1", *bad_valid)
    with pytest.raises(UserError, match="longer than data.max_len"):
        train(config)  # fails after training the tokenizer
    assert (run / "spm.model").is_file() and (run / "tokenizer_inputs.json").is_file()

    other_src, other_tgt = write_corpus(tmp_path, 40, "other")
    for extra, message in [
        (["data.vocab_size=50"], "data.vocab_size was 40, now 50"),
        (["data.spm_type=unigram"], "data.spm_type was 'bpe', now 'unigram'"),
        (["data.shared_vocab=false"], "data.shared_vocab was true, now false"),
        ([f"data.train_src={other_src}"], "data.train_src=.*other.de is not the .*train.de it was trained on"),
        ([f"data.train_tgt={other_tgt}"], "data.train_tgt=.*other.en is not the .*train.en"),
    ]:
        with pytest.raises(UserError, match=f"its tokenizer was trained for other data.*{message}.*delete"):
            train(load_config(None, sets[:-2] + extra))  # sets[:-2]: a valid validation set again
    model = (run / "spm.model").read_bytes()
    moved = tmp_path / "moved"  # the same corpus elsewhere: the same tokenizer
    moved.mkdir()
    src, tgt = (shutil.copy(tmp_path / f"train.{side}", moved) for side in ("de", "en"))
    assert train(load_config(None, sets[:-2] + [f"data.train_src={src}", f"data.train_tgt={tgt}"]))["step"] == 1
    assert (run / "spm.model").read_bytes() == model


def test_a_training_file_changed_in_place_is_said_to_have_changed(tmp_path, caplog):
    """The same path with other contents was "data.train_src=X is not the X it was trained on", refused
    before any checkpoint and logged on --resume: a sentence that contradicted itself."""
    src, tgt = write_corpus(tmp_path)
    settings = tokenizer_settings(40, "bpe", True)
    write_tokenizer_inputs(tmp_path, tokenizer_inputs(src, tgt, settings))
    write_corpus(tmp_path, 30)  # the same files, rewritten
    inputs = tokenizer_inputs(src, tgt, settings)
    said = f"data.train_src={src.resolve()} changed since the tokenizer was trained on it"
    with pytest.raises(UserError, match="its tokenizer was trained for other data") as e:
        check_tokenizer_inputs(tmp_path, inputs)
    assert said in str(e.value) and "is not the" not in str(e.value)
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        check_tokenizer_inputs(tmp_path, inputs, resumed=True)
    assert f"{said} (--resume keeps the run's tokenizer)" in caplog.messages


def test_a_training_file_changed_after_its_first_mb_is_said_to_have_changed(tmp_path):
    """The record held a hash of the first MB alone: a corpus edited after it, at the same size, was taken
    for the one the tokenizer was trained on ("using the tokenizer there"). A record written before the
    whole file's hash is compared by the first MB still, as it was: no old run dir refused for it."""
    src, tgt = write_corpus(tmp_path)
    long_text = "".join(f"ein Hund läuft über die Wiese {i}\n" for i in range(40_000))  # about 1.3 MB
    src.write_text(long_text, encoding="utf-8")
    tgt.write_text(long_text.replace("Hund", "dog"), encoding="utf-8")
    settings = tokenizer_settings(40, "bpe", True)
    recorded = tokenizer_inputs(src, tgt, settings)
    write_tokenizer_inputs(tmp_path, recorded)
    src.write_text(long_text[:-100] + long_text[-100:].replace("Hund", "Katz"), encoding="utf-8")
    assert src.stat().st_size == recorded["train_src"]["size"]  # the same size, the same first MB
    inputs = tokenizer_inputs(src, tgt, settings)
    with pytest.raises(UserError, match=re.escape(f"data.train_src={src.resolve()} changed since")):
        check_tokenizer_inputs(tmp_path, inputs)
    for side in ("train_src", "train_tgt"):  # as written before: the first MB's hash alone
        del recorded[side]["sha256"]
    write_tokenizer_inputs(tmp_path, recorded)
    assert check_tokenizer_inputs(tmp_path, inputs) is False
    src.write_text("eine" + long_text[3:], encoding="utf-8")  # the first MB edited: refused, as it was
    with pytest.raises(UserError, match=re.escape(f"data.train_src={src.resolve()} changed since")):
        check_tokenizer_inputs(tmp_path, tokenizer_inputs(src, tgt, settings))


def test_resume_refuses_other_tokenizer_settings_and_names_another_corpus(finished_run, tmp_path, caplog):
    """--resume keeps the tokenizer its checkpoints were trained with: a changed vocab_size cannot take
    effect, so it is refused (it was silently ignored, the printed config saying otherwise); another
    corpus is continued training on new data, so it trains, saying so."""
    config = copy_run(finished_run, tmp_path)
    for change, message in [(dict(vocab_size=50), "data.vocab_size=40 (resumed with 50)"),
                            (dict(spm_type="unigram"), "data.spm_type='bpe' (resumed with 'unigram')")]:
        with pytest.raises(UserError, match=re.escape(f": trained with {message}; --resume continues the run "
                                                      "with its tokenizer: set it as trained, or use a new "
                                                      "train.run_dir") + "$"):
            train(replace(config, data=replace(config.data, **change)), resume=True)
    other_src, other_tgt = write_corpus(tmp_path, 40, "other")
    moved = replace(config, data=replace(config.data, train_src=str(other_src),
                                                                  train_tgt=str(other_tgt)))
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        assert train(with_train(moved, max_updates=5), resume=True)["step"] == 5
    assert "other.de is not the" in caplog.text and "(--resume keeps the run's tokenizer)" in caplog.text


def test_a_tokenizer_setting_resume_refuses_is_named_where_it_was_written(finished_run, tmp_path):
    """It named the checkpoint and the setting, not the --set item or the file's line that wrote it, as a
    [model] setting that a checkpoint refuses is named."""
    run = copy_run(finished_run, tmp_path).train.run_dir
    sets = [s for s in finished_run[2] if not s.startswith("train.run_dir=")] + [f"train.run_dir={run}"]
    checkpoint = Path(run) / "checkpoints" / "step_000004"
    keeps = "--resume continues the run with its tokenizer: set it as trained, or use a new train.run_dir"
    with pytest.raises(UserError, match=re.escape(f"--set 'data.vocab_size=50': {checkpoint}: trained with "
                                                  f"data.vocab_size=40 (resumed with 50); {keeps}")):
        train(load_config(None, [*sets, "data.vocab_size=50"]), resume=True)
    # left out, it is the default: "drop the change" had no change to drop, and said of one, it left the
    # default, refused again
    with pytest.raises(UserError) as e:
        train(load_config(None, [s for s in sets if not s.startswith("data.vocab_size=")]), resume=True)
    assert str(e.value) == (f"{checkpoint}: trained with data.vocab_size=40 (resumed with the default 8000); "
                            f"{keeps}")
    toml = tmp_path / "run.toml"
    toml.write_text("[data]\nmax_len = 32\nspm_type = 'unigram'\n", encoding="utf-8")
    spm_type = f"{toml}:3: {checkpoint}: trained with data.spm_type="
    with pytest.raises(UserError, match=f"^{re.escape(spm_type)}"):
        train(load_config(toml, sets), resume=True)


def test_a_record_from_before_normalization_was_recorded_is_read_as_the_defaults(finished_run, tmp_path):
    """tokenizer_inputs.json written before data.normalization and data.character_coverage existed lacks
    them: the tokenizer was trained with the defaults, so a default config reuses it and resumes, and a
    record saying otherwise is refused."""
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    record = json.loads((run / "tokenizer_inputs.json").read_text(encoding="utf-8"))
    assert (record["normalization"], record["character_coverage"]) == ("nmt_nfkc", 1.0)
    old = {k: v for k, v in record.items() if k not in ("normalization", "character_coverage")}

    def left_by_a_failed_run(name: str, saved: dict) -> Path:
        """A run directory holding the tokenizer and `saved` as its record, and no checkpoint."""
        (tmp_path / name).mkdir()
        shutil.copy(run / "spm.model", tmp_path / name)
        (tmp_path / name / "tokenizer_inputs.json").write_text(json.dumps(saved), encoding="utf-8")
        return tmp_path / name

    (run / "tokenizer_inputs.json").write_text(json.dumps(old), encoding="utf-8")
    assert train(with_train(config, max_updates=5), resume=True)["step"] == 5  # --resume of an old run
    with pytest.raises(UserError, match=r"data\.character_coverage=1\.0 \(resumed with 0\.9995\)"):
        train(replace(config, data=replace(config.data, character_coverage=0.9995)), resume=True)
    reused = left_by_a_failed_run("old", old)
    assert train(with_train(config, run_dir=str(reused), max_updates=1, valid_every=1))["step"] == 1

    identity = {**old, "normalization": "identity"}
    (run / "tokenizer_inputs.json").write_text(json.dumps(identity), encoding="utf-8")
    with pytest.raises(UserError, match=r"--resume keeps the tokenizer .*\(data.normalization was "
                                        r"'identity', now 'nmt_nfkc'\)"):
        train(with_train(config, max_updates=6), resume=True)
    refused = left_by_a_failed_run("identity", identity)
    with pytest.raises(UserError, match="trained for other data.*data.normalization was 'identity'"):
        train(with_train(config, run_dir=str(refused), max_updates=1, valid_every=1))


def test_a_run_dir_from_before_the_record_is_accepted(finished_run, tmp_path):
    d, config, _ = finished_run
    (tmp_path / "run").mkdir()
    shutil.copy(d / "run" / "spm.model", tmp_path / "run" / "spm.model")  # no tokenizer_inputs.json
    result = train(with_train(config, run_dir=str(tmp_path / "run"), max_updates=1, valid_every=1))
    assert result["step"] == 1
    assert not (tmp_path / "run" / "tokenizer_inputs.json").exists()


# 6. Inputs that used to fail late or with a traceback.


@pytest.mark.parametrize("seed", [-(2**46), 2**46])
def test_the_extreme_seeds_train_config_accepts_can_order_batches(seed):
    """The bound is where `epoch_order` (seed * 100_003 + epoch, a 64-bit torch seed) still works."""
    from aiayn.data.batching import epoch_order

    assert TrainConfig(seed=seed).seed == seed
    assert sorted(epoch_order(5, seed, 10**6)) == list(range(5))


def test_a_seed_the_cpu_generator_cuts_to_32_bits_is_said(tmp_path, caplog):
    """train.seed=2**32 + 1 trains on a CPU what train.seed=1 trains (torch keeps a seed's low 32 bits),
    silently; accepted still, since runs trained with it must resume as they began, but said."""
    weights = {}
    for seed in (1, 2**32 + 1):
        config, _ = tiny_config(tmp_path, tmp_path / str(seed), "train.max_updates=2", f"train.seed={seed}")
        caplog.clear()
        with caplog.at_level(logging.INFO):
            train(config)
        weights[seed] = load_file(checkpoint_dirs(tmp_path / str(seed))[-1] / "model.safetensors")
        said = [m for m in caplog.messages if "low 32 bits" in m]
        assert said == ([] if seed == 1 else [(
            "train.seed=4294967297: PyTorch's CPU generator keeps a seed's low 32 bits, so this run is "
            "initialized, its batches ordered and (on a CPU) its dropout drawn as with train.seed=1; a seed "
            "from 0 to 2**32 - 1 is a run of its own")])
    assert weights[1].keys() == weights[2**32 + 1].keys()
    assert all(torch.equal(weights[1][k], weights[2**32 + 1][k]) for k in weights[1])


@pytest.mark.parametrize("seed", [-(2**46) - 1, 2**46 + 1, 10**29])
def test_train_config_refuses_a_seed_batch_order_cannot_take(seed):
    with pytest.raises(ConfigError, match=r"train\.seed"):
        TrainConfig(seed=seed)


def test_train_wants_a_run_config_not_a_dict(tmp_path):
    with pytest.raises(TypeError, match="RunConfig.*load_config"):
        train({"train": {"run_dir": str(tmp_path / "run")}})
    assert not (tmp_path / "run").exists()
    config = run_config({"train": {"run_dir": str(tmp_path / "run")}})
    for section, value, kind in (("data", {"max_len": 5}, "DataConfig"), ("train", {}, "TrainConfig"),
                                 ("model", "base", "dict")):  # "'dict' object has no attribute 'max_len'"
        with pytest.raises(TypeError, match=rf"^RunConfig's {section} is {type(value).__name__}: it is a "
                                            rf"{kind} \(run_config builds a RunConfig from dicts\)$"):
            RunConfig(**{section: value})
    for resume in ("no", 0, None):  # "no" is true: it resumed
        with pytest.raises(TypeError, match=rf"^resume must be True or False, not {type(resume).__name__} "):
            train(config, resume=resume)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", ["micro", "tiny", "small"])
def test_info_counts_the_parameters_of_the_real_model(capsys, preset):
    code = cli.main(["info", "--preset", preset, "--vocab-size", "1000"])
    real = Transformer(model_config(preset, vocab_size=1000)).num_parameters()
    assert code == 0 and f"parameters: {real:,}" in capsys.readouterr().out


def test_info_on_a_huge_vocabulary_allocates_nothing(capsys):
    """A billion-word vocabulary: 32e9 parameters, 128 GB if allocated."""
    code = cli.main(["info", "--preset", "micro", "--vocab-size", "1000000000"])
    # micro: 32 * 1e9 shared embedding + 21,376 for the layers (53,376 - 32 * 1000 at vocab_size 1000)
    assert code == 0 and "parameters: 32,000,021,376" in capsys.readouterr().out


def test_host_values_are_agreed_on_the_host_group_never_on_the_gpu(monkeypatch):
    """The stop flags and the training clock are all-reduced at every update. Under NCCL, a host value put
    on the GPU for it waits for the update's queued kernels (a sync per update); `setup` makes a gloo group
    for them, and every host-value collective must use it with a CPU tensor."""
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: seen.append((t.device.type, group)))
    monkeypatch.setattr(dist, "broadcast_object_list",
                        lambda objects, src=0, group=None: seen.append(("objects", group)))
    host = object()  # stands for the gloo group of a job whose default group is NCCL
    main = object()  # the gloo group in which the others wait for process 0's data preparation
    d = distributed.Dist(1, 2, 1, torch.device("cuda", 1), host, main)
    assert distributed.all_reduce_sum([1.0, 2.0], d) == [1.0, 2.0]  # (the fake leaves the values alone)
    distributed.on_main(d, lambda: None)
    distributed.on_main(d, lambda: None, long=True)
    assert seen == [("cpu", host), ("objects", host), ("objects", main)]


@pytest.mark.parametrize("file, edit, message", [
    ("trainer.json", lambda t: t["state"].update(step="4"), r"trainer\.json: corrupt training state \(step='4' is not a whole number"),
    ("trainer.json", lambda t: t["state"].update(epoch=None), r"trainer\.json: corrupt training state \(epoch=None"),
    ("meta.json", lambda m: m["config"]["train"].update(seed="1"), r"meta\.json: corrupt checkpoint metadata \(seed='1' is not a whole number"),
])
def test_hand_edited_training_metadata_of_the_wrong_type_is_named(finished_run, tmp_path, file, edit, message):
    """Each gave a TypeError traceback, or 'trained with train.seed=1, resumed with 1'."""
    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / file
    content = json.loads(path.read_text(encoding="utf-8"))
    edit(content)
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(UserError, match=message):
        train(with_train(config, max_updates=6), resume=True)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["state"].update(step=-5), r"\(step=-5 is not a whole number from 0 to 2\^53\)"),
    (lambda t: t["state"].update(cursor=-3), r"\(cursor=-3 is not a whole number from 0 to 2\^53\)"),
    (lambda t: t["state"].update(cursor=10**9), r"\(cursor=1000000000 is past the \d+ updates of an epoch"),
    (lambda t: t["state"].update(seconds=math.nan), r"\(seconds=nan is not a finite number, at least 0\)"),
    (lambda t: t["state"].update(best_valid=math.nan), r"\(best_valid=nan is not a finite number"),
    (lambda t: t["state"].update(best_step=99), r"\(best_step=99 is past step=4\)"),
    (lambda t: t["state"].update(earlier_bests=[2, 99]),
     r"\(earlier_bests=\[2, 99\] holds a step past step=4\)"),
    (lambda t: t["state"].update(earlier_bests=[0]), r"\(earlier_bests=\[0\] is not a list of whole numbers"),
    (lambda t: t["state"].update(earlier_bests=2), r"\(earlier_bests=2 is not a list\)"),
    (lambda t: t["param_groups"][0].update(betas="x"), r"\(param_groups betas='x', where this optimizer has"),
    (lambda t: t["param_groups"][0].update(eps=-1.0), r"\(param_groups eps=-1\.0, where"),
    (lambda t: t["param_groups"][0].pop("lr"), r"\(param_groups has no lr\)"),
    (lambda t: t["param_groups"][0]["params"].pop(), r"\(param_groups' params are not this model's \d+ "),
    (lambda t: t["param_groups"][0]["params"].reverse(),  # each parameter would get another's moments
     r"\(param_groups' params are not this model's \d+ parameters in order\)"),
    (lambda t: t["param_groups"][0].update(eps=10**400), r"\(param_groups eps=10+, where"),  # OverflowError
    (lambda t: t["state"].update(step=10**400), r"\(step=\d+ is not a whole number from 0 to 2\^53\)"),
    (lambda t: t["state"].update(seconds=10**400), r"\(seconds=\d+ is not a finite number, at least 0\)"),
    (lambda t: t.update(param_groups={}), r"\(param_groups is not 1 table\(s\)\)"),
])
def test_training_state_out_of_range_is_refused(finished_run, tmp_path, edit, message):
    """Each was resumed: a negative cursor trained on the wrong batches, a negative step shifted the
    schedule, NaN seconds never reached max_minutes; betas "x" failed at the first update."""
    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / "trainer.json"
    content = json.loads(path.read_text(encoding="utf-8"))
    edit(content)
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(CorruptFile, match=r"step_000004/trainer\.json: corrupt training state " + message):
        train(with_train(config, max_updates=6), resume=True)


def test_a_param_group_from_an_older_torch_resumes(finished_run, tmp_path):
    """torch 2.4-2.6 saved Adam's groups without the flags later versions added (decoupled_weight_decay,
    ...); load_state_dict fills them with defaults, and such a checkpoint was refused as corrupt."""
    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / "trainer.json"
    content = json.loads(path.read_text(encoding="utf-8"))
    content["param_groups"] = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "params")}
                               for g in content["param_groups"]]
    path.write_text(json.dumps(content), encoding="utf-8")
    assert train(with_train(config, max_updates=6), resume=True)["step"] == 6


@pytest.mark.parametrize("edit, message", [
    (lambda w: w.update({"optimizer.x.exp_avg": torch.zeros(1)}), r"optimizer\.x\.exp_avg is no Adam state"),
    (lambda w: w.update({"optimizer.3": torch.zeros(1)}), r"optimizer\.3 is no Adam state"),
    (lambda w: w.update({"optimizer.999.exp_avg": torch.zeros(1)}), r"optimizer\.999\.exp_avg is no Adam"),
    (lambda w: w.update({"optimizer.0.exp_avg": torch.zeros(7)}), r"optimizer\.0\.exp_avg has shape \(7,\)"),
    (lambda w: w.update({"optimizer.0.step": torch.zeros(2)}), r"optimizer\.0\.step has shape \(2,\)"),
    (lambda w: w["optimizer.0.exp_avg_sq"].view(-1)[0].fill_(math.nan),
     r"optimizer\.0\.exp_avg_sq holds a value that is not finite and at least 0"),
    (lambda w: w["optimizer.1.exp_avg_sq"].view(-1)[0].fill_(-1.0), r"optimizer\.1\.exp_avg_sq holds a value"),
    (lambda w: w["optimizer.0.exp_avg"].view(-1)[0].fill_(math.inf), r"optimizer\.0\.exp_avg holds a value"),
    (lambda w: w.pop("optimizer.2.exp_avg_sq"), r"optimizer\.2 has no exp_avg_sq"),  # a KeyError, later
    (lambda w: w.update({"optimizer.\u00b2.exp_avg": torch.zeros(1)}), r"optimizer\.\u00b2\.exp_avg is no"),
    (lambda w: w.update({"optimizer.0.max_exp_avg_sq": torch.zeros(1)}),  # amsgrad's, which this run has not
     r"optimizer\.0\.max_exp_avg_sq is no Adam state"),
    # A parameter's whole state gone: Adam restarted its moments and step count, and the run diverged
    (lambda w: [w.pop(k) for k in list(w) if k.startswith("optimizer.3.")],
     r"no Adam state for parameter 3 of \d+, after 4 updates\)"),
    (lambda w: [w.pop(k) for k in list(w) if k.startswith("optimizer.")],
     r"no Adam state for parameter 0 of \d+, after 4 updates\)"),
])
def test_a_damaged_adam_state_is_refused_naming_the_tensor(finished_run, tmp_path, edit, message):
    """A malformed name gave a ValueError traceback; a moment of another shape, or a NaN, loaded and
    surfaced two updates later as 'training diverged ... lower train.lr_scale'."""
    from safetensors.torch import save_file

    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / "trainer.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    with pytest.raises(CorruptFile, match=r"step_000004/trainer\.safetensors: corrupt training state \(" + message):
        train(with_train(config, max_updates=6), resume=True)


@pytest.mark.parametrize("keep", [0.5, 20])  # bytes kept: half the file; fewer than its header's length
def test_a_training_state_cut_short_is_said_so(finished_run, tmp_path, keep):
    """A copy or a full disk that cut trainer.safetensors short read as 'corrupt training state (...
    incomplete metadata, file not fully covered)', where the weights beside it say 'damaged or cut short'."""
    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / "trainer.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    said = r"step_000004/trainer\.safetensors: training state damaged or cut short"
    with pytest.raises(CorruptFile, match=said):
        train(with_train(config, max_updates=6), resume=True)


def test_an_update_freq_recorded_as_null_is_the_default(finished_run, tmp_path):
    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / "meta.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    meta["config"]["train"]["update_freq"] = None
    path.write_text(json.dumps(meta), encoding="utf-8")
    assert train(with_train(config, max_updates=6), resume=True)["step"] == 6


# 9. One run at a time in a run directory, and what killed runs leave behind.


def test_a_second_run_in_the_same_run_dir_is_refused(finished_run, tmp_path):
    """Two runs in one directory deleted each other's checkpoints mid-write and mixed their logs."""
    from aiayn.train.state import RunLock

    config = copy_run(finished_run, tmp_path)
    other = RunLock(Path(config.train.run_dir))  # as another process holding it: flock is per open file
    other.acquire()
    try:
        with pytest.raises(UserError, match=rf"run: another training run is writing there \(process {os.getpid()} on "):
            train(with_train(config, max_updates=6), resume=True)
    finally:
        other.release()
    assert train(with_train(config, max_updates=6), resume=True)["step"] == 6
    assert train(with_train(config, max_updates=8), resume=True)["step"] == 8  # released when a run ends


def test_a_resumed_run_checks_new_text_against_its_kept_tokenizer_and_not_its_own(finished_run, tmp_path,
                                                                                  caplog, monkeypatch):
    """--resume keeps the run's tokenizer: a new training corpus is checked against it as a fine-tune's is,
    while its own text encoded again (the cache deleted) is not blamed on "other text"."""
    from aiayn.data import dataset

    config = copy_run(finished_run, tmp_path)
    shutil.rmtree(Path(config.train.run_dir) / "cache")
    kept = []
    real = dataset.warn_if_unknown
    monkeypatch.setattr(loop, "warn_if_unknown", lambda *a: kept.append(a[-1]) or real(*a))
    assert train(with_train(config, max_updates=5), resume=True)["step"] == 5
    assert kept == [False, False]  # training and validation text, encoded again: the tokenizer's own
    src = Path(config.data.train_src)
    joined = tmp_path / "joined.de"  # a ZWNJ, which nmt_nfkc makes a space, in every line
    joined.write_text("".join(f"{line}\u200cein\n" for line in src.read_text(encoding="utf-8").splitlines()),
                      encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train(replace(with_train(config, max_updates=6), data=replace(config.data, train_src=str(joined))),
              resume=True)
    said = [m for m in caplog.messages if "tokenizer kept" in m]
    assert len(said) == 1 and "changes this training text" in said[0] and "U+200C" in said[0]


def test_a_refused_run_removes_the_run_dir_it_made_and_no_two_runs_hold_it(tmp_path, monkeypatch):
    """A run refused before writing anything left its new run_dir holding .lock alone; removing it must
    not let two runs hold the lock: one that opened the path just before the removal locked an unlinked
    file, and a third run could lock the path's new one."""
    from aiayn.train.state import RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = RunLock(run_dir)
    first.acquire()
    opened_before = open(run_dir / ".lock", "a+", encoding="utf-8")  # noqa: SIM115 (a run opening it then)
    first.release_made()
    assert not run_dir.exists()
    second = RunLock(run_dir)
    opens = iter([opened_before])
    real = second._open
    monkeypatch.setattr(second, "_open", lambda: next(opens, None) or real())
    second.acquire()  # the unlinked file first, then the path again: its directory made anew
    try:
        assert opened_before.closed and run_dir.is_dir()
        with pytest.raises(UserError, match="another training run is writing there"):
            RunLock(run_dir).acquire()
    finally:
        second.release()
    kept = RunLock(run_dir)
    kept.acquire()
    (run_dir / "spm.model").write_bytes(b"")  # anything written: the directory stays
    kept.release_made()
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "spm.model"]


def test_a_lock_that_cannot_be_written_is_released_and_one_line(tmp_path, monkeypatch):
    """A full disk as the holder's line is written: the lock stayed held by the file object in the
    traceback, and a second try in the same process (a notebook) was refused as another run."""
    import socket

    from aiayn.train.state import RunLock

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(socket, "gethostname", full)
    with pytest.raises(UserError, match=r"\.lock: cannot write the run's lock \(No space left on device\)"):
        RunLock(tmp_path).acquire()
    monkeypatch.undo()
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_a_lock_whose_line_fills_the_disk_is_one_line_and_left_no_file(tmp_path, monkeypatch):
    """The line's flush failed, then closing flushed it again: a second OSError, a traceback, and an empty
    .lock left in the run directory."""
    import io

    from aiayn.train import state
    from aiayn.train.state import RunLock

    class FullDisk(io.FileIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk_open(path, mode, encoding):
        return io.TextIOWrapper(io.BufferedRandom(FullDisk(path, mode)), encoding=encoding)

    monkeypatch.setattr(state, "open", full_disk_open, raising=False)  # the module's, before the builtin
    with pytest.raises(UserError, match=r"\.lock: cannot write the run's lock \(No space left on device\)$"):
        RunLock(tmp_path).acquire()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_save_leaves_nothing_the_next_run_keeps(finished_run, tmp_path, caplog):
    """A kill mid-save left a checkpoint-sized temporary that only a successful save removed: on a nearly
    full disk no save succeeded again. A kill between the two renames of a re-save left the checkpoint
    only as '.step_N.aiayn-old' (an older aiayn's '.step_N.old'), out of sight of --resume."""
    import subprocess
    import sys

    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    half = checkpoints / f".step_000006.aiayn-{exited.pid}.k2j4h5g6.tmp"  # just now: no waiting for it to age
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    os.rename(checkpoints / "step_000002", checkpoints / ".step_000002.aiayn-old")
    os.rename(checkpoints / "step_000004", checkpoints / ".step_000004.old")
    with caplog.at_level(logging.INFO, logger="aiayn"):
        assert train(with_train(config, max_updates=6), resume=True)["step"] == 6
    assert f"resuming from {checkpoints / 'step_000004'} (update 4" in caplog.text
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004", "step_000006"]


def assert_ends_as_the_unbroken_run(run: Path, unbroken_run: Path) -> None:
    """The same validations in metrics.jsonl, and the same weights at update 4, bit for bit."""
    def validations(path):  # the records of saves (training's log lines have a loss)
        return [(r["step"], r.get("valid_loss")) for r in map(json.loads, path.read_text().splitlines())
                if "loss" not in r]

    assert validations(run / "metrics.jsonl") == validations(unbroken_run / "metrics.jsonl")
    resumed = load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors"))
    unbroken = load_file(str(unbroken_run / "checkpoints" / "step_000004" / "model.safetensors"))
    assert all(torch.equal(resumed[k], unbroken[k]) for k in unbroken)


def test_resume_before_any_checkpoint_starts_from_the_beginning(tmp_path):
    """A run killed before its first save, restarted by a loop that always passes --resume."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2", "train.valid_every=2")
    assert train(config, resume=True)["step"] == 2


def test_a_signal_when_a_validation_is_due_validates_on_resume(finished_run, tmp_path, monkeypatch):
    """SIGTERM at update 2, where valid_every=2 validates: the signal's save skips the validation (a
    scheduler's grace is short), and --resume makes it first, so that the log, the patience count and
    the weights are the unbroken run's."""
    d, run = finished_run[0], tmp_path / "run"
    real_step = loop.train_step
    config = signalled_run(finished_run, tmp_path, monkeypatch, at_update=2)
    with pytest.raises(Stopped):
        train(config)
    monkeypatch.setattr(loop, "train_step", real_step)
    assert train(config, resume=True)["step"] == 4
    assert_ends_as_the_unbroken_run(run, d / "run")


@pytest.mark.parametrize("during", ["validation", "BLEU", "save", "after the passes"])
def test_a_signal_during_a_validation_or_a_save_stops_with_that_checkpoint(finished_run, tmp_path,
                                                                          monkeypatch, during):
    """SIGTERM during update 2's validation, its BLEU pass or its save was counted only after update 3,
    which a second checkpoint then saved (a probe's step_000050, then step_000051). A pass ends at its next
    batch and the update is saved unvalidated, as on a signal during the update (a scheduler's grace is
    short); during the save, the run stops once it is written, as it does after passes that ended (their
    results were dropped too, and --resume ran them again). --resume ends as the unbroken run does."""
    from aiayn.train import bleu

    d, config, _ = finished_run
    run = tmp_path / "run"
    run.mkdir()
    for name in ("spm.model", "tokenizer_inputs.json"):  # the same tokenizer as the unbroken run
        shutil.copy(d / "run" / name, run / name)
    config = with_train(config, run_dir=str(run), bleu_every=2 if during == "BLEU" else 0)
    module, name = {"validation": (loop, "batch_loss"), "BLEU": (bleu, "generate"),
                    "save": (loop, "_draw_curves"), "after the passes": (loop, "validate")}[during]
    real, calls = getattr(module, name), []

    def signal_then_go_on(*args, **kwargs):
        result = real(*args, **kwargs) if during == "after the passes" else None
        if during != "validation" or not args[0].training:  # a validation's batch: the model in eval mode
            calls.append(1)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        return result if during == "after the passes" else real(*args, **kwargs)

    monkeypatch.setattr(module, name, signal_then_go_on)
    with pytest.raises(Stopped, match=r"^stopped by SIGTERM at update 2, saved in .*/step_000002; --resume"):
        train(config)
    assert [p.name for p in checkpoint_dirs(run)] == ["step_000002"] and len(calls) == 1  # no batch more
    meta = json.loads((run / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta.get("interrupted", False) == (during in ("validation", "BLEU"))  # cut: saved unvalidated
    monkeypatch.setattr(module, name, real)
    assert train(config, resume=True)["step"] == 4
    assert_ends_as_the_unbroken_run(run, d / "run")


def test_set_keeps_a_bare_value_of_a_string_key_as_written(tmp_path):
    """'bare words are strings': a run_dir of 2024-05-01 or 123 was a TOML date or integer, then refused."""
    for text in ("2024-05-01", "123", "inf", "true"):
        assert load_config(None, [f"train.run_dir={text}"]).train.run_dir == text
    assert load_config(None, ["train.max_tokens=2048"]).train.max_tokens == 2048  # a number stays one


@pytest.mark.parametrize("item, value", [
    ('train.run_dir=["a"]', "['a'] is a list"),
    ('data.train_src=["x", "y"]', "['x', 'y'] is a list"),
    ("train.run_dir={ a = 1 }", "{'a': 1} is a dict"),
])
def test_set_refuses_an_array_or_table_for_a_string_key_as_a_file_does(tmp_path, item, value):
    """Only numbers, booleans and dates are taken as written: run_dir=["a"] trained into a directory named
    ["a"], and train_src=["x","y"] was '["x","y"]: file not found', where a file's array is a type error."""
    section, key = item.split("=")[0].split(".")
    quoted = f"{section}.{key}='{item.split('=', 1)[1]}'"  # how to give such a name (run_dir=[1]), said
    refused = rf"^--set {re.escape(repr(item))}: {re.escape(value)}, expected str \(a name is a TOML string: "
    with pytest.raises(ConfigError, match=refused + rf"{re.escape(quoted)}\)$"):
        load_config(None, [item])
    assert getattr(getattr(load_config(None, [quoted]), section), key) == item.split("=", 1)[1]  # as advised
    with pytest.raises(ConfigError, match=r"^--set 'model.d_model=\[512\]': \[512\] is a list, expected "
                                          r"int$"):  # no name: a string is advised for strings alone
        load_config(None, ["model.d_model=[512]"])
    path = tmp_path / "run.toml"
    path.write_text(f"[{section}]\n{key} = {item.split('=', 1)[1]}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2: \[{section}\] {key} = "
                                          rf"{re.escape(value)}, expected str$"):
        load_config(path)


def test_set_drops_a_comment_after_a_bare_word_as_after_a_number():
    """TOML dropped `# c` after `warmup=20`, but `run_dir=runs/x # c` trained into 'runs/x # c'."""
    assert load_config(None, ["train.warmup=20 # c"]).train.warmup == 20
    for text, name in (("runs/x # c", "runs/x"), ("123\t# c", "123"), ("runs/exp#3", "runs/exp#3"),
                       ('"a # b"', "a # b")):
        assert load_config(None, [f"train.run_dir={text}"]).train.run_dir == name
    with pytest.raises(ConfigError, match=r"\(TOML numbers need a digit on each side of the point: 0\.5\)$"):
        load_config(None, ["train.lr_scale=.5  # half"])


@pytest.mark.parametrize("where, content, sets, message", [
    ("file", "[train]\nmax_tokens = \"256\"\n", [],
     (r"bad\.toml:2: \[train\] max_tokens = '256' is a str, expected int; TOML numbers take no quotes: "
      r"max_tokens = 256$")),
    ("file", "[data]\nvocab_size = 200\n[train]\nrun_dir = 5\n", [],
     r'bad\.toml:4: \[train\] run_dir = 5 is an int, expected str; TOML strings need quotes: run_dir = "5"$'),
    # TOML's own writing, not Python's datetime.date(2024, 1, 1); quoted, a name, as --set takes it
    ("file", "[train]\nrun_dir = 2024-01-01\n", [],
     (r'bad\.toml:2: \[train\] run_dir = 2024-01-01 is a date, expected str; TOML strings need quotes: '
      r'run_dir = "2024-01-01"$')),
    ("file", "[train]\nwarmup = 2024-01-01 10:00:00\nrun_dir = 1.5\n", [],
     (r"bad\.toml:2: \[train\] warmup = 2024-01-01T10:00:00 is a datetime, expected int; .*bad\.toml:3: "
      r"\[train\] run_dir = 1\.5 is a float, expected str$")),  # a float may be written otherwise: no hint
    ("file", "data.vocab_size = '200'\n", [], r"bad\.toml:1: \[data\] vocab_size = '200' is a str"),
    ("file", "data = { max_len = 2, vocab_size = '2' }\n", [], r"bad\.toml:1: \[data\] vocab_size = '2'"),
    ("set", "", ["train.max_tokens=abc"], r"--set 'train\.max_tokens=abc': 'abc' is a str, expected int"),
    ("set", "", ["model.dropout=true"], r"--set 'model\.dropout=true': true is a bool, expected float"),
])
def test_a_value_of_the_wrong_type_is_named_where_it_was_written(tmp_path, where, content, sets, message):
    """The message named the dataclass field (TrainConfig.max_tokens), not the file or the --set item."""
    path = tmp_path / "bad.toml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_config(path if where == "file" else None, sets)


POINT = "TOML numbers need a digit on each side of the point"


@pytest.mark.parametrize("item, message", [
    ("train.lr_scale=.5", rf"'\.5' is a str, expected float \({POINT}: 0\.5\)"),
    ("train.lr_scale=5.", rf"'5\.' is a str, expected float \({POINT}: 5\.0\)"),
    ("model.dropout=-.1e-1", rf"'-\.1e-1' is a str, expected float \({POINT}: -0\.1e-1\)"),
    ("train.compile=True", r"'True' is a str, expected bool \(TOML booleans are true and false\)"),
    ("train.compile=yes", r"'yes' is a str, expected bool \(TOML booleans are true and false\)"),
    ("train.max_tokens=5.", r"'5\.' is a str, expected int"),  # 5.0 is no int either: no hint
    ("train.lr_scale=True", r"'True' is a str, expected float"),  # nor is true a float
])
def test_a_set_value_toml_refused_says_what_toml_wants(item, message):
    """TOML refuses Python's .5 and True, which --set then read as strings: "'.5' is a str, expected
    float" left the user to guess why a number was a string."""
    with pytest.raises(ConfigError, match=rf"^--set {re.escape(repr(item))}: {message}$"):
        load_config(None, [item])


@pytest.mark.parametrize("line, message", [
    ("lr_scale = .5", rf"Invalid value at column 12\); {POINT}: 0\.5"),
    ("lr_scale = 5.  # half",
     rf"Expected newline or end of document after a statement at column 13\); {POINT}: 5\.0"),
    ("compile = True", r"Invalid value at column 11\); TOML booleans are true and false"),
    ("compile = yes", r"Invalid value at column 11\); TOML booleans are true and false"),  # as --set's
    ("warmup = 5.", r"Expected newline or end of document after a statement at column 11\)"),  # 5.0: no int
    ("lr_scale = 1.5 x", r"Expected newline or end of document after a statement at column 16\)"),
    ("precision = bf16", r'Invalid value at column 13\); TOML strings need quotes: precision = "bf16"'),
    ("run_dir = runs/x  # mine",
     r'Invalid value at column 11\); TOML strings need quotes: run_dir = "runs/x"'),
    (r"run_dir = C:\runs", r"Invalid value at column 11\); TOML strings need quotes: run_dir = 'C:\\runs'"),
    ("warmup = abc", r"Invalid value at column 10\)"),  # no string is a number
])
def test_a_config_file_toml_refuses_is_named_by_line(tmp_path, line, message):
    """tomllib's "not valid TOML (Invalid value (at line 3, column 12))" named the file without its line,
    and said nothing of what a value Python would read, or a bare word --set takes as a string, wanted
    instead."""
    toml = tmp_path / "bad.toml"
    toml.write_text(f"[train]\nseed = 1\n{line}\n", encoding="utf-8")
    with pytest.raises(UserError, match=rf"^{re.escape(str(toml))}:3: not valid TOML \({message}$"):
        load_config(toml)


@pytest.mark.parametrize("toml, line, message", [
    ("[train]\nkeep_last = [1,\n", 2,
     "Invalid value at the end of the file); the array that line 2 opens is never closed"),
    ("[train]\nkeep_last = [\n  1,\n  2,\n\n# more\n", 6,
     "Invalid value at the end of the file); the array that line 2 opens is never closed"),
    ('[train]\nrun_dir = """runs/x\nseed = 2\n', 3,
     "Unterminated string at the end of the file); the multi-line string that line 2 opens is never closed"),
    ("[model]\npreset = 'micro'\n[train]\nseed = {a = 1,", 4,
     ("Invalid initial character for a key part at the end of the file); the inline table that line 4 opens "
      "is never closed")),
    ("[train]\nwarmup = [1]\nseed =", 3, "Invalid value at the end of the file)"),  # nothing left open
    ("[train]\nseed = 1\n[data", 3, "Expected ']' at the end of a table declaration at the end of the file)"),
    # Windows line ends: every line was taken for the one left open (a prefix ending in CR is no TOML)
    ("keep_last = [\r\n  1]\r\n[train]\r\nseed = 1\r\nwarmup = [2,\r\n", 5,
     "Invalid value at the end of the file); the array that line 5 opens is never closed"),
])
def test_toml_that_ends_too_soon_is_named_by_its_last_line_and_what_is_left_open(tmp_path, toml, line,
                                                                                    message):
    """tomllib says "(at end of document)" for these, and they were "bad.toml: not valid TOML (Invalid value
    (at end of document))": no line, and nothing of the array left open lines before."""
    path = tmp_path / "bad.toml"
    path.write_bytes(toml.encode())  # as written: CRLF kept
    with pytest.raises(UserError, match=rf"^{re.escape(f'{path}:{line}: not valid TOML ({message}')}$"):
        load_config(path)


@pytest.mark.parametrize("toml, line, message", [
    ("[train]\nwarmup = 10\nwarmup = 20\n", 3, "[train] warmup is set twice (first at line 2)"),
    ("[train]\n'warmup' = 10\nseed = 2\nwarmup.x = 20\n", 4, "[train] warmup is set twice (first at line 2)"),
    ('preset = "a"\npreset = "b"\n', 2, "preset is set twice (first at line 1)"),
    ("[train]\nseed = 1\n[data]\n[train]\n", 4, "[train] is declared twice (first at line 1)"),
    # a table over a value: "[train.warmup] is declared twice (first at line 2)" named no table there
    ("[train]\nwarmup = 1\n\n[train.warmup]\n", 4,
     "[train.warmup]: [train] warmup is a value already (line 2), not a table"),
])
def test_a_key_or_table_written_twice_is_named_with_its_first_line(tmp_path, toml, line, message):
    """It was "not valid TOML (Cannot overwrite a value at column 12)": the line, but not the key."""
    path = tmp_path / "twice.toml"
    path.write_text(toml, encoding="utf-8")
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}:{line}: {re.escape(message)}$"):
        load_config(path)


def test_separate_vocabularies_with_shared_embeddings(tmp_path):
    """model.share_embeddings with data.shared_vocab=false: false trains (it was a TypeError traceback, after
    the tokenizer was trained), true is refused before any data is read."""
    (tmp_path / "data").mkdir()
    base = ["data.shared_vocab=false", "train.max_updates=1"]
    config, _ = tiny_config(tmp_path / "data", tmp_path / "run", *base, "model.share_embeddings=false")
    assert train(config)["step"] == 1
    with pytest.raises(ConfigError, match="model.share_embeddings=true needs one vocabulary"):
        tiny_config(tmp_path / "data", tmp_path / "run2", *base, "model.share_embeddings=true")


@pytest.mark.parametrize("setting, message", [
    ("train.threads=4294967296", "train.threads=4294967296 is more than 1,024"),  # was an overflow traceback
    ("data.vocab_size=4294967296", "data.vocab_size=4294967296 is more than 16,777,216"),  # after the data
    ("model.d_ff=4294967296", "d_ff=4294967296 is more than 16,777,216"),  # an allocator traceback
    ("model.n_layers=100000", "n_layers=100000 is more than 4,096 layers"),
])
def test_sizes_past_any_machine_are_refused_before_any_work(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.preset=micro", setting])


def test_a_model_too_large_for_memory_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    config, _ = tiny_config(tmp_path / "data", tmp_path / "run", "train.max_updates=1")

    def no_memory(config):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(loop, "Transformer", no_memory)
    with pytest.raises(UserError, match=r"\[model\]: not enough memory for the model \(d_model=32"):
        train(config)

    def bad_alloc(config):  # C++'s, as a CPU kernel's own buffer fails under `ulimit -v`: a traceback
        raise RuntimeError("std::bad_alloc")

    monkeypatch.setattr(loop, "Transformer", bad_alloc)
    with pytest.raises(UserError, match=r"\[model\]: not enough memory for the model \(d_model=32"):
        train(config)


def test_lines_longer_than_sentencepieces_default_still_train_the_tokenizer(tmp_path):
    """SentencePiece skips lines over its max_sentence_length (4,192 bytes by default) when it trains: a
    corpus of long lines failed with 'SentencePiece cannot train on this text (RuntimeError)'."""
    words = " ".join(["ein", "Hund", "läuft", "über", "die", "Wiese"] * 150)  # about 4.8 KB a line
    lines = [f"{words} {i}" for i in range(30)]
    path = train_sentencepiece(lines, tmp_path / "spm", 40)
    assert path.is_file()


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors write one; it was 'not valid TOML (Invalid statement (at line 1, column 1))'."""
    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff[train]\nmax_updates = 7\n".encode("utf-8"))
    assert load_config(path).train.max_updates == 7


@pytest.mark.parametrize("content, message", [
    (b'[data]\ntrain_src = "a"\nvocab_size = 20\xff0\n', r"bad\.toml:3: invalid UTF-8 \(byte 0xff\)$"),
    ("[data]\nvocab_size = 200\n".encode("utf-16"),
     r"bad\.toml:1: invalid UTF-8 \(byte 0xff\); the file looks like UTF-16; convert it to UTF-8"),
    # ASCII in UTF-16 without a byte order mark is valid UTF-8 with NULs: it was "not valid TOML (...)"
    ("[data]\nvocab_size = 200\n".encode("utf-16-le"),
     r"bad\.toml:1: NUL byte \(binary or corrupt input\?\); the file looks like UTF-16 without a byte order"),
], ids=["bad-byte", "utf-16", "utf-16-no-bom"])
def test_a_config_that_is_not_utf8_is_named_by_line(tmp_path, content, message):
    """It was "not valid TOML ('utf-8' codec can't decode byte 0xff in position 46: ...)", for UTF-16 too."""
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    with pytest.raises(UserError, match=rf"^{path.parent}/{message}"):
        load_config(path)


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_a_refusal_every_process_reaches_is_printed_by_process_0_only(rank, printed, monkeypatch, capsys):
    """Under torchrun an unknown --set key or a resume refusal was printed once per process."""
    in_job(monkeypatch, rank)
    assert cli.main(["train", "--set", "train.bogus=1"]) == 2
    assert ("unknown train key 'bogus'" in capsys.readouterr().err) == printed

    def failing(error: Exception):
        def run(args):
            raise error
        return argparse.Namespace(command="train", func=run)

    assert cli._run(failing(distributed.SameOnEveryProcess("ck: saved by 2 process(es) x ..."))) == 2
    assert ("saved by 2 process(es)" in capsys.readouterr().err) == printed
    assert cli._run(failing(UserError("x.de: missing"))) == 2
    assert "x.de: missing" in capsys.readouterr().err  # a process's own failure: printed wherever it is


def test_a_logits_bias_that_training_would_never_change_is_refused():
    """model.final_logits_bias=true trained a model identical to one without it (a zero buffer)."""
    with pytest.raises(ConfigError, match="model.final_logits_bias=true is a fixed buffer"):
        load_config(None, ["model.preset=micro", "model.final_logits_bias=true"])


@pytest.mark.parametrize("rank, failures, raised", [
    (0, ["damaged", "damaged"], ("CorruptFile", "damaged")),  # process 0 prints its own
    (1, ["damaged", "damaged"], ("SameOnEveryProcess", "damaged")),  # the others stay quiet
    # named: another machine's first process says it too, where it did not fail
    (1, ["damaged", None], ("SameOnEveryProcess", "process 0: damaged")),
    (1, ["damaged", "other"], ("CorruptFile", "other")),  # a failure of its own: printed
    (0, [None, "unreadable here"], ("UserError", "process 1: unreadable here")),  # named by process 0
    (1, [None, "unreadable here"], ("SameOnEveryProcess", "process 1: unreadable here")),  # and the others
])
def test_a_checkpoint_every_process_reads_fails_with_one_line_for_all(monkeypatch, rank, failures, raised):
    """A damaged checkpoint to resume from was one line per process under torchrun (16 on two machines of
    eight GPUs): `on_every` gathers the processes' failures so that the command line prints one."""
    d = SimpleNamespace(enabled=True, is_main=rank == 0, rank=rank, world_size=2, host_group=None)
    monkeypatch.setattr(distributed.dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), failures))

    def work():
        if failures[rank] is not None:
            raise CorruptFile(failures[rank])
        return "state"

    with pytest.raises(UserError) as e:
        distributed.on_every(d, work)
    assert (type(e.value).__name__, str(e.value)) == raised
    monkeypatch.setattr(distributed.dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [None, None]))
    assert distributed.on_every(d, lambda: "state") == "state"
    assert distributed.on_every(SimpleNamespace(enabled=False, is_main=True), lambda: 7) == 7


def test_a_corpus_touched_while_it_is_encoded_still_trains(tmp_path, monkeypatch):
    """Process 0 names the cache by the key taken before encoding: taken again after, a file touched
    meanwhile (an rsync, a `touch`) named a cache never written, and training stopped with 'process 0's
    encoding of the corpus is missing'."""
    from aiayn.data import dataset

    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1")
    real = dataset._encode

    def touched_meanwhile(files, tokenizer):
        out = real(files, tokenizer)
        path = Path(config.data.train_src)
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
        return out

    monkeypatch.setattr(dataset, "_encode", touched_meanwhile)
    assert train(config)["step"] == 1


def test_an_unknown_field_in_the_saved_training_state_is_one_line(finished_run, tmp_path):
    """A newer aiayn's field, or a hand's edit, was TrainState's TypeError traceback."""
    config = copy_run(finished_run, tmp_path)
    path = checkpoint_dirs(config.train.run_dir)[-1] / "trainer.json"
    content = json.loads(path.read_text(encoding="utf-8"))
    content["state"]["extra_field"] = 1
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(CorruptFile, match=r"trainer\.json: corrupt training state \(unknown field\(s\) "
                                          r"'extra_field' in 'state'\)"):
        train(with_train(config, max_updates=6), resume=True)


def test_a_warmup_past_float_precision_and_a_bare_string_of_overrides_are_refused():
    """warmup=2**1024 trained the tokenizer and encoded the corpus, then failed in the schedule's
    warmup**-1.5 (OverflowError); a bare string was read character by character ("--set 't'")."""
    with pytest.raises(ConfigError, match=r"train\.warmup=\d+ is more than 2\^53 updates"):
        load_config(None, [f"train.warmup={2**60}"])
    with pytest.raises(TypeError, match=r"^overrides is a list of SECTION\.KEY=VALUE strings: pass \['train"):
        load_config(None, "train.warmup=10")


def test_the_config_functions_name_an_argument_of_another_type():
    """load_config(dict) failed in pathlib ("expected str, bytes or os.PathLike object, not dict"), an
    override that is no str in str.partition ("'int' object has no attribute 'partition'"), None for the
    overrides as "'NoneType' object is not iterable", run_config(None) with "... no attribute 'items'"."""
    with pytest.raises(TypeError, match=r"^load_config's path is dict: a TOML file's path, or None for the "
                                        r"defaults \(run_config builds a RunConfig from dicts\)$"):
        load_config({"model": {"preset": "tiny"}})
    with pytest.raises(TypeError, match=r"^overrides\[1\] is int, not str$"):
        load_config(None, ["train.seed=3", 5])
    assert load_config(None, None) == load_config(None)
    with pytest.raises(TypeError, match=r"^run_config takes a dict of sections .*, not NoneType; "
                                        r"load_config\(path\) reads a TOML file$"):
        run_config(None)


def test_another_validation_set_on_resume_starts_the_best_loss_again(finished_run, tmp_path, caplog):
    """Its losses were compared with the old set's best: none was better, train.patience stopped the run
    and `prune` kept the old best's checkpoint. The same pairs under another name keep the best."""
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    best = json.loads((run / "checkpoints" / "step_000004" / "trainer.json").read_text())["state"]
    assert best["valid_digest"] and best["best_valid"] < math.inf
    same = tmp_path / "same.de", tmp_path / "same.en"  # a copy: another path, inode and mtime
    shutil.copy(config.data.valid_src, same[0])
    shutil.copy(config.data.valid_tgt, same[1])
    copied = replace(config, data=replace(config.data, valid_src=str(same[0]), valid_tgt=str(same[1])))
    with caplog.at_level(logging.WARNING):
        train(with_train(copied, max_updates=6), resume=True)
    assert "validation pairs differ" not in caplog.text
    kept = json.loads((run / "checkpoints" / "step_000006" / "trainer.json").read_text())["state"]
    assert kept["valid_digest"] == best["valid_digest"] and kept["best_valid"] <= best["best_valid"]
    hard = write_corpus(tmp_path, 9, "hard")
    other = replace(config, data=replace(config.data, valid_src=str(hard[0]), valid_tgt=str(hard[1])))
    with caplog.at_level(logging.WARNING):
        train(with_train(other, max_updates=8), resume=True)
    so_far = f"{kept['best_valid']:.4f}"
    assert f"differ from those of the best validation loss so far ({so_far} at update" in caplog.text
    state = json.loads((run / "checkpoints" / "step_000008" / "trainer.json").read_text())["state"]
    assert state["best_step"] == 8 and state["valid_digest"] != best["valid_digest"]  # on the new set


def test_a_validation_set_dropped_or_changed_on_resume_is_said(finished_run, tmp_path, caplog):
    """Resumed without its validation set, a run went on unvalidated without a word, where another warmup
    or thread count is said; another set's files are said too (its pairs also restart the best loss)."""
    config = copy_run(finished_run, tmp_path)
    checkpoint = Path(config.train.run_dir) / "checkpoints" / "step_000004"
    valid = f"data.valid_src={config.data.valid_src!r}, data.valid_tgt={config.data.valid_tgt!r}"
    unvalidated = replace(config, data=replace(config.data, valid_src="", valid_tgt=""))
    with caplog.at_level(logging.INFO):
        train(with_train(unvalidated, max_updates=5), resume=True)
    dropped = f"trained with the validation set {valid}, resumed without one: no validation from here"
    assert [m for m in caplog.messages if ": trained with" in m] == [f"{checkpoint}: {dropped}"]
    caplog.clear()
    other = [str(p) for p in write_corpus(tmp_path, 5, "other")]
    copied = [shutil.copy(path, tmp_path / f"copy.{path[-2:]}") for path in other]  # the same text
    said, main = [], distributed.Dist(0, 1, 0, torch.device("cpu"))
    # a relative path recorded by a run started in another directory, not there from this one: it was
    # said as other files on every resume from elsewhere, the same files
    for data in ({"valid_src": "", "valid_tgt": ""}, dict(zip(("valid_src", "valid_tgt"), other)),
                 {"valid_src": config.data.valid_src, "valid_tgt": config.data.valid_tgt},
                 {"valid_src": "gone/valid.de", "valid_tgt": "gone/valid.en"}):
        with caplog.at_level(logging.INFO):
            _say_other_validation(checkpoint, data, config, main)
            _say_other_validation(checkpoint, data, replace(config, data=replace(
                config.data, valid_src=str(copied[0]), valid_tgt=str(copied[1]))), main)
        said.append([m.removeprefix(f"{checkpoint}: ") for m in caplog.messages])
        caplog.clear()
    resumed_copy = f"data.valid_src={str(copied[0])!r}, data.valid_tgt={str(copied[1])!r}"
    trained_other = f"data.valid_src={other[0]!r}, data.valid_tgt={other[1]!r}"
    assert said == [[f"trained without a validation set, resumed with {valid}",
                     f"trained without a validation set, resumed with {resumed_copy}"],
                    [f"trained with {trained_other}, resumed with {valid}"],  # the copy: the same text
                    [f"trained with {valid}, resumed with {resumed_copy}"], []]


def test_a_config_without_training_files_leaves_no_run_dir(tmp_path):
    """The run directory and its lock were made before the refusal."""
    config, _ = tiny_config(tmp_path, tmp_path / "run")
    for data, message in (({"train_src": ""}, "must name the training files"),
                          ({"valid_tgt": str(tmp_path / "nope.en")}, "nope.en: file not found")):
        with pytest.raises((ConfigError, UserError), match=message):
            train(replace(config, data=replace(config.data, **data)))
        assert not (tmp_path / "run").exists()


def test_train_without_a_config_or_training_files_says_how_to_give_them(tmp_path, capsys, monkeypatch):
    """`aiayn train` with no arguments named the settings alone, never --config; with a config file, its
    settings are the file's to mend, and the refusal is train's own."""
    monkeypatch.chdir(tmp_path)
    said = ("aiayn: error: data.train_src and data.train_tgt must name the training files (give --config "
            "FILE, a TOML file such as configs/tiny.toml, or --set data.train_src=FILE --set "
            "data.train_tgt=FILE)\n")
    for args in ([], ["--set", "data.train_src=tr.de"]):
        assert cli.main(["train", *args]) == 2
        assert capsys.readouterr().err == said
    (tmp_path / "run.toml").write_text("[train]\nmax_updates = 5\n", encoding="utf-8")
    assert cli.main(["train", "--config", "run.toml"]) == 2
    assert capsys.readouterr().err == ("aiayn: error: data.train_src and data.train_tgt must name the "
                                       "training files\n")
    assert not (tmp_path / "runs").exists()


def test_a_data_file_not_found_is_named_with_its_setting_and_where_relative_paths_are_read(
    tmp_path, capsys, monkeypatch
):
    """`cd /tmp; aiayn train --config .../configs/tiny.toml` said only "../shared/data/multi30k/train.de:
    file not found", though the config file's directory holds it: named now with the setting and its line
    (or --set item), as other settings' problems are, and, for a relative path, where it was looked for."""
    project = tmp_path / "project"
    project.mkdir()
    write_corpus(project)  # project/train.de, project/train.en
    toml = project / "run.toml"
    toml.write_text('[data]\ntrain_src = "train.de"\ntrain_tgt = "train.en"\n', encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, err = run_cli(capsys, "train", "--config", str(toml))
    said = (f"aiayn: error: {toml}:2: data.train_src=train.de: file not found (a relative path is read from "
            f"the current directory, {elsewhere})")
    assert code == 2 and err == [said]
    item = f"data.train_tgt={project / 'nope.en'}"  # absolute: no word of the current directory
    found = f"data.train_src={project / 'train.de'}"
    code, err = run_cli(capsys, "train", "--config", str(toml), "--set", found, "--set", item)
    assert code == 2 and err == [f"aiayn: error: --set {item!r}: {item}: file not found"]
    code, err = run_cli(capsys, "train", "--config", str(toml), "--set", found, "--set",
                        "data.train_tgt=./no/")
    said = (f"aiayn: error: --set 'data.train_tgt=./no/': data.train_tgt=./no/: file not found (a relative "
            f"path is read from the current directory, {elsewhere})")
    assert err == [said]  # the path as written: it was said as "=no"
    monkeypatch.chdir(project)
    loop._check_data_files(load_config(toml))  # from the config's directory: found


def test_a_perplexity_past_the_cap_is_printed_as_a_bound():
    from aiayn.train.metrics import shown_ppl

    assert shown_ppl(math.log(12.34), 2) == "12.34"
    assert shown_ppl(50.0, 1) == f"{math.exp(50):.1f}"
    assert shown_ppl(2e10, 1) == ">5.2e+21"  # exp(50) was printed as if it were the value

    from aiayn.cli import _train_summary

    diverged = {"step": 9, "valid_loss": 70.0, "valid_nll": 66.2, "valid_ppl": math.exp(50), "stop": "x"}
    assert _train_summary(diverged) == "step 9: valid loss 70.0000, valid NLL 66.2000, valid ppl >5.2e+21 (x)"


def test_train_gives_the_caller_its_thread_count_back(finished_run, tmp_path):
    """train.threads=1 left the caller's process on one thread: a notebook's next run trained another
    model (a thread count changes the sums' order), and slower."""
    config = copy_run(finished_run, tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert config.train.threads == 1
        assert train(with_train(config, max_updates=5), resume=True)["step"] == 5
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_train_is_its_configs_run_under_the_callers_autocast_or_no_grad(finished_run, tmp_path):
    """Called under the caller's `torch.autocast` (bf16), an fp32 run ran its backward in bf16 and trained
    another model, recorded as fp32; under `no_grad` or `inference_mode` it failed at the first update, a
    traceback after the data work."""
    d, config, _ = finished_run
    unbroken = read_meta(d / "run" / "checkpoints" / "step_000004")["metrics"]["valid_loss"]
    for n, outer in enumerate((lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad,
                               torch.inference_mode)):
        with outer():
            result = train(with_train(config, run_dir=str(tmp_path / f"run{n}")))
        assert result["valid_loss"] == unbroken and torch.is_grad_enabled()


def test_train_from_a_script_shows_its_progress_and_leaves_logging_as_it_was(finished_run, tmp_path):
    """A script or notebook that set up no logging saw nothing until train() returned: the bar needs a
    terminal, and Python drops INFO lines. Its lines now go to stderr for the run, as the CLI's do."""
    import subprocess

    config = copy_run(finished_run, tmp_path)
    script = ("import logging, sys\n"
              "from aiayn.train.config import load_config\n"
              "from aiayn.train.loop import train\n"
              f"train(load_config(None, {finished_run[2]!r} + ['train.run_dir={config.train.run_dir}', "
              "'train.max_updates=6']), resume=True)\n"
              "logger = logging.getLogger('aiayn')\n"
              "print(logger.handlers, logger.level, logging.getLogger().handlers)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout == "[] 0 []\n"
    lines = done.stderr.splitlines()
    resumed = r"\d\d:\d\d:\d\d resuming from .*step_000004 \(update 4, epoch 1\)"
    assert any(re.fullmatch(resumed, x) for x in lines)
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d update 6: valid loss .*", x) for x in lines), lines


def test_log_lines_above_the_bar_keep_the_callers_handlers(monkeypatch):
    """tqdm's logging_redirect_tqdm swapped the console handler for one without its level: a console set
    to WARNING showed every update's INFO line while the bar was up."""
    import io

    from tqdm import tqdm

    from aiayn.train.progress import lines_above

    class ColorHandler(logging.StreamHandler):  # as colorlog's is: a subclass (glued onto the bar, skipped)
        pass

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    console = ColorHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    logger = logging.getLogger("aiayn")  # where the CLI's basicConfig or a user's own handler would be
    logger.addHandler(console)
    bar = tqdm(total=3, file=terminal, disable=False)
    try:
        with lines_above(bar):
            assert console.stream is not terminal
            logger.info("update 2: loss 3.0")
            logger.warning("curves.png not drawn")
        assert console.stream is terminal and console in logger.handlers
        elsewhere = io.StringIO()
        with lines_above(bar):
            console.setStream(elsewhere)  # the caller's change while the bar is up: kept
        assert console.stream is elsewhere
    finally:
        bar.close()
        logger.removeHandler(console)
    shown = terminal.getvalue()
    assert "curves.png not drawn\n" in shown and "update 2" not in shown
    assert "\rcurves.png" in shown  # the bar lifted off its line first: not glued onto it


def test_a_level_set_on_aiayns_logger_is_kept_and_its_lines_shown(monkeypatch):
    """`logging.getLogger("aiayn").setLevel(...)` with no handler: a level of the caller's (INFO, the usual
    way to ask for the lines; ERROR) is kept, and the lines it lets through are shown."""
    from aiayn.train import progress

    logger = logging.getLogger("aiayn")
    monkeypatch.setattr(logger, "hasHandlers", lambda: False)  # as in a script: pytest's handlers are there
    for level in (logging.INFO, logging.ERROR):
        monkeypatch.setattr(logger, "level", level)
        with progress.shown_if_unconfigured(False):  # a process other than 0 would be set to WARNING
            assert len(logger.handlers) == 1 and logger.level == level
        assert logger.handlers == [] and logger.level == level
    monkeypatch.setattr(logger, "level", logging.INFO)
    with progress.shown_if_unconfigured(False):  # under torchrun, process 0 alone says INFO lines
        assert logger.handlers[0].level == logging.WARNING
    monkeypatch.setattr(logger, "propagate", False)  # turned off to quiet the lines: left so
    with progress.shown_if_unconfigured(True):
        assert logger.handlers == []
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    with progress.shown_if_unconfigured(True):
        added = list(logger.handlers)
        with progress.shown_if_unconfigured(True):  # another train() in another thread: the same one
            assert logger.handlers == added and len(added) == 1
        assert logger.handlers == added and logger.level == logging.INFO  # still held by the first
    assert logger.handlers == [] and logger.level == logging.NOTSET


def test_a_warning_in_trainings_log_says_it_is_one():
    """Training's lines were time and message alone: "1,999 of 2,000 training pairs ... dropped" read like
    any progress line. In a process of its own, as the command line and a script set logging up."""
    script = (
        "import logging, sys\n"
        "from aiayn.cli import _log_to_stderr\n"
        "_log_to_stderr(int(sys.argv[1]) if len(sys.argv) > 1 else None)\n"
        "log = logging.getLogger('aiayn.train')\n"
        "log.info('update 1'); log.warning('most pairs dropped')\n"
        "logging.getLogger().handlers.clear()\n"
        "from aiayn.train.progress import shown_if_unconfigured\n"
        "with shown_if_unconfigured(True):\n"
        "    log.warning('in a script')\n")
    for rank, tag in ((None, ""), ("0", "[rank 0] ")):
        done = subprocess.run([sys.executable, "-c", script, *([rank] if rank else [])], capture_output=True,
                              text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
        lines = [line.split(" ", 1)[1] for line in done.stderr.splitlines()]  # the time cut off
        assert lines == [f"{tag}update 1", f"{tag}warning: most pairs dropped", "warning: in a script"], done


def test_a_best_checkpoint_deleted_by_hand_is_said_and_never_named(finished_run, tmp_path, caplog, capsys):
    """Deleted to free a full disk, the best's checkpoint was still named by the run's last line, a path
    that was gone, with nothing said."""
    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    trainer = json.loads((checkpoints / "step_000004" / "trainer.json").read_text())
    trainer["state"].update(best_step=2, best_valid=0.5)  # as a run whose update 2 validated best
    (checkpoints / "step_000004" / "trainer.json").write_text(json.dumps(trainer))
    shutil.rmtree(checkpoints / "step_000002")
    with caplog.at_level("WARNING", logger="aiayn"):
        result = train(with_train(config, max_updates=6), resume=True)
    assert result["step"] == 6 and "best_checkpoint" not in result
    said = (f"{checkpoints / 'step_000002'}, the best validation loss so far (0.5000), is gone; "
            "train.patience still counts from it, and the best checkpoint is named again once a validation "
            "beats it")
    assert said in caplog.messages


def test_a_checkpoint_named_for_another_update_is_not_resumed(finished_run, tmp_path):
    """step_000006 holding update 2 (renamed, or a link to another run's): --resume went back to update 2
    and pruned the newer checkpoints as older ones, at every resume."""
    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    (checkpoints / "step_000002").rename(checkpoints / "step_000006")
    said = (f"^{checkpoints / 'step_000006'}: holds update 2, not 6 as its name says "
            r"\(renamed or linked in by hand\?\); to resume from step_000004")
    with pytest.raises(CorruptFile, match=said):
        train(with_train(config, max_updates=8), resume=True)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000006"]


@pytest.mark.parametrize("stray", ["file", "dangling link"])
def test_a_step_name_that_is_no_directory_is_refused_before_any_work(finished_run, tmp_path, monkeypatch,
                                                                     stray):
    """A file step_000006 in checkpoints/ was no checkpoint to --resume, which retrained updates 5 and 6
    from step_000004 and then failed at the save ("exists and is not a directory"), at every resume."""
    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    if stray == "file":
        (checkpoints / "step_000006").write_text("not a checkpoint")
    else:
        (checkpoints / "step_000006").symlink_to(tmp_path / "gone")
    what = ("is a file, not a checkpoint directory" if stray == "file"
            else "is a link that leads to no directory")
    monkeypatch.setattr(loop, "prepare_data", lambda *a, **k: pytest.fail("refused after the data work"))
    said = (f"{checkpoints / 'step_000006'}: {what}, under a name training saves its checkpoints by; move it "
            f"out of {checkpoints}")
    with pytest.raises(UserError, match=rf"^{re.escape(said)}$"):
        train(with_train(config, max_updates=8), resume=True)
    assert [p.name for p in checkpoint_dirs(checkpoints.parent)] == ["step_000002", "step_000004"]


def test_a_resave_of_a_step_replaces_it_whatever_it_holds(finished_run, tmp_path):
    """A step saved on a signal is validated and saved again on resume: training's own directory, replaced
    whole, as before save_checkpoint refused other callers' folders of the user's files."""
    config = copy_run(finished_run, tmp_path)
    step = Path(config.train.run_dir) / "checkpoints" / "step_000004"
    trainer = json.loads((step / "trainer.json").read_text())
    trainer["state"]["validation_due"] = True  # as a signal's save leaves it
    (step / "trainer.json").write_text(json.dumps(trainer))
    (step / ".DS_Store").write_text("a file browser's")
    assert train(with_train(config, max_updates=6), resume=True)["step"] == 6
    assert not (step / ".DS_Store").exists()


def test_a_best_gone_and_started_again_is_said_once(finished_run, tmp_path, caplog):
    """Another label smoothing starts the best again: "is gone; patience still counts from it" was said
    too, just before "the best loss and train.patience's count start again"."""
    config = copy_run(finished_run, tmp_path)
    checkpoints = Path(config.train.run_dir) / "checkpoints"
    trainer = json.loads((checkpoints / "step_000004" / "trainer.json").read_text())
    trainer["state"].update(best_step=2, best_valid=0.5)
    (checkpoints / "step_000004" / "trainer.json").write_text(json.dumps(trainer))
    shutil.rmtree(checkpoints / "step_000002")
    with caplog.at_level("WARNING", logger="aiayn"):
        train(with_train(config, max_updates=6, label_smoothing=0.2), resume=True)
    assert not any("is gone" in m for m in caplog.messages)
    assert any("start again" in m for m in caplog.messages)


def test_another_label_smoothing_on_resume_starts_the_best_loss_again(finished_run, tmp_path, caplog):
    """best_valid is a smoothed loss: resumed with more smoothing, every validation was worse than the old
    best by the smoothing alone, train.patience stopped the run and `prune` kept the old best's checkpoint."""
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    best = json.loads((run / "checkpoints" / "step_000004" / "trainer.json").read_text())["state"]
    with caplog.at_level(logging.WARNING):
        result = train(with_train(config, max_updates=8, patience=2, label_smoothing=0.5), resume=True)
    assert result["step"] == 8 and result["stop"] == "max_updates=8"  # not stopped at 6 by patience
    assert (f"the best validation loss so far ({best['best_valid']:.4f} at update {best['best_step']}) was "
            "smoothed with train.label_smoothing=0.1, not 0.5: the best loss and train.patience's count "
            "start again") in caplog.text
    state = json.loads((run / "checkpoints" / "step_000006" / "trainer.json").read_text())["state"]
    assert state["best_step"] == 6 and state["best_valid"] > best["best_valid"]  # on the new smoothing


def test_key_lines_count_newlines_only():
    """str.splitlines also split at U+2028, U+2029 and U+0085, which TOML allows in comments and strings:
    every later key was named a line too far down."""
    from aiayn.train.config import key_lines

    text = '[data]\n# a note \u2028 and \u0085 more\nname = "x\u2029y"\r\nvocab_size = 4\n[train]\nseed = 1\n'
    assert key_lines(text) == {"data": 1, "data.name": 3, "data.vocab_size": 4, "train": 5, "train.seed": 6}


def test_key_lines_find_multiline_strings_by_where_they_start():
    """Counting triple quotes on a line took one in a comment or a one-line string for the start of a
    multi-line string: the [data] after it was skipped and its keys went unplaced."""
    from aiayn.train.config import key_lines

    text = ('[train]\nrun_dir = "r" # """\nseed = 1\n[data]\nname = \'"""\'\nvocab_size = 4\n'
            'notes = """\nmax_len = 9\n[model]\n"""\nmax_len = 1\n'
            'items = [\n  \'\'\'\n[x]\n\'\'\', "b"]\nd = 2\n')
    assert key_lines(text) == {"train": 1, "train.run_dir": 2, "train.seed": 3, "data": 4, "data.name": 5,
                               "data.vocab_size": 6, "data.notes": 7, "data.max_len": 11, "data.items": 12,
                               "data.d": 16}


@pytest.mark.parametrize("change", ["label_smoothing", "validation set"])
def test_the_old_best_checkpoint_stays_when_the_best_starts_again(finished_run, tmp_path, caplog, change):
    """Another label_smoothing or validation set on --resume starts the best loss again: the old best's
    checkpoint was then deleted at the next save with keep_last's older ones, the warning saying nothing of
    it, though the new criterion never measured it (a better model, by its NLL, went). It stays, outside
    keep_last, also through later resumes, and the warning says so."""
    config = copy_run(finished_run, tmp_path)
    run = Path(config.train.run_dir)
    old = json.loads((run / "checkpoints" / "step_000004" / "trainer.json").read_text())["state"]["best_step"]
    if change == "validation set":
        hard = write_corpus(tmp_path, 9, "hard")
        config = replace(config, data=replace(config.data, valid_src=str(hard[0]), valid_tgt=str(hard[1])))
    else:
        config = with_train(config, label_smoothing=0.5)
    with caplog.at_level(logging.WARNING):
        train(with_train(config, max_updates=8, keep_last=1), resume=True)
    old_checkpoint = run / "checkpoints" / f"step_{old:06d}"
    assert old_checkpoint.is_dir()
    assert (f"the best loss and train.patience's count start again, and that best's checkpoint "
            f"{old_checkpoint} is kept besides the new best's, outside train.keep_last: training no longer "
            "deletes it") in caplog.text
    for until in (8, 10):  # and so does a later resume with the new settings
        if until == 10:
            train(with_train(config, max_updates=10, keep_last=1), resume=True)
        state = json.loads((run / "checkpoints" / f"step_{until:06d}" / "trainer.json").read_text())["state"]
        assert state["earlier_bests"] == [old] and state["best_step"] > 4
        kept = {old, state["best_step"], until}
        assert [p.name for p in checkpoint_dirs(run)] == [f"step_{s:06d}" for s in sorted(kept)]


def test_curves_drawn_at_a_stop_after_a_validation_hold_the_last_window(tmp_path, monkeypatch):
    """Patience or the time budget spent in a validation off the log_every grid logs the last window after
    the save, which had drawn curves.png: the picture stopped an update or more short of metrics.jsonl."""
    from aiayn.train.metrics import plot_metrics, read_metrics

    monkeypatch.setattr(loop, "_patience_exhausted", lambda state, tc: "patience" if state.step >= 3 else "")
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=10", "train.valid_every=3",
                            "train.log_every=2")
    assert train(config)["step"] == 3
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [2, 3]
    redrawn = plot_metrics(run / "metrics.jsonl", tmp_path / "c.png")
    assert (run / "curves.png").read_bytes() == redrawn.read_bytes()


def test_the_bar_total_is_where_max_epochs_ends_the_run():
    """The bar's total was max_epochs x this corpus' epoch: after a --resume on another corpus (30 updates
    done on one of 24 an epoch, then 13 an epoch) it read 30/52 and ran on to 56/?, where the run stopped."""
    from aiayn.train.state import TrainState

    tc = SimpleNamespace(max_epochs=4)
    assert loop._epochs_end(TrainState(), tc, 13) == 52
    # as epoch_on_this_corpus leaves it: update 30, the next epoch (the third) from its first update
    assert loop._epochs_end(TrainState(step=30, epoch=2, cursor=0), tc, 13) == 56
    assert loop._epochs_end(TrainState(step=30, epoch=1, cursor=6), tc, 24) == 4 * 24  # the same corpus
    assert loop._epochs_end(TrainState(step=50, epoch=5, cursor=0), tc, 13) == 50  # max_epochs lowered
    assert loop._epochs_end(TrainState(step=9), SimpleNamespace(max_epochs=0), 13) == 0
