"""`aiayn info CHECKPOINT`: what a checkpoint holds, read from its files' headers, against the loaded
model."""

import json

import pytest
import torch
from conftest import tiny_model

from aiayn.checkpoint import WEIGHTS, load_checkpoint, save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.errors import UserError
from aiayn.train.average import average_checkpoints

LINES = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'} und die Zahl {i}" for i in range(40)]
METRICS = {"step": 300, "epoch": 2, "valid_loss": 1.5, "valid_nll": 1.25, "valid_ppl": 3.4903}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(train_sentencepiece(LINES, tmp_path_factory.mktemp("spm") / "spm", vocab_size=60))


def save(path, tokenizer, step=300, dtype=torch.float32, **overrides):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size, **overrides).to(dtype)
    meta = {"step": step, "epoch": 2, "metrics": {**METRICS, "step": step},
            "config": {"data": {"train_src": "corpus.en", "train_tgt": "corpus.de"}}}
    return save_checkpoint(path, model, tokenizer, meta)


def info(capsys, *args):
    code = main(["info", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err.strip()


def test_a_trained_checkpoint_is_described_as_loading_it_finds_it(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "ck", tokenizer, dtype=torch.bfloat16)
    loaded = load_checkpoint(path)
    code, lines, err = info(capsys, path)
    assert code == 0 and not err
    assert lines[0] == f"checkpoint: {path}" and lines[1] == str(loaded.model.config)
    size = (path / WEIGHTS).stat().st_size
    count = loaded.model.num_parameters()
    assert lines[2] == f"parameters: {count:,} (bfloat16; {WEIGHTS} {size / 1e3:.0f} kB)"
    assert lines[3] == f"tokenizer: SentencePiece (spm.model), {tokenizer.src_vocab_size} pieces, both sides"
    assert lines[4] == "trained: update 300, epoch 2; valid_loss 1.5, valid_nll 1.25, valid_ppl 3.49"
    # a checkpoint from before runs recorded their directory: the paths as given, said to be relative
    assert lines[5] == "data: corpus.en -> corpus.de (relative to the directory training ran in)"
    assert len(lines) == 6


def test_training_data_is_named_where_it_is(tmp_path, tokenizer, capsys):
    """`data: tr.de -> tr.en`, the paths as training was given them, meant nothing from another directory."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    data = {"train_src": "corpus.en", "train_tgt": "/data/corpus.de"}
    save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 3, "workdir": "/home/u/mt",
                                                        "config": {"data": data}})
    assert "data: /home/u/mt/corpus.en -> /data/corpus.de" in info(capsys, tmp_path / "ck")[1]


def test_a_run_records_the_directory_it_ran_in(tmp_path, monkeypatch):
    from train_helpers import tiny_config

    from aiayn.train.loop import train

    monkeypatch.chdir(tmp_path)
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2", "train.valid_every=2")
    train(config)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "step_000002").meta["workdir"] == str(tmp_path)


def test_an_average_does_not_show_its_newest_checkpoints_validation(tmp_path, tokenizer, capsys):
    paths = [save(tmp_path / f"step_{i}", tokenizer, step=i) for i in (100, 200)]
    out = average_checkpoints(paths, tmp_path / "avg")
    code, lines, _ = info(capsys, out)
    assert code == 0 and "trained: update 200, epoch 2" in lines
    assert not any("valid_" in line for line in lines)
    assert lines[-1] == f"averaged: 2 checkpoints, {paths[0]}, {paths[1]} (not validated as an average)"


def test_an_average_of_one_checkpoint_says_checkpoint(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "step_100", tokenizer, step=100)
    _, lines, _ = info(capsys, average_checkpoints([path], tmp_path / "avg"))
    assert lines[-1] == f"averaged: 1 checkpoint, {path} (not validated as an average)"  # not "1 checkpoints"


def test_a_preset_is_named_as_an_argument_or_an_option(capsys):
    assert info(capsys, "small")[:2] == info(capsys, "--preset", "small")[:2]
    code, lines, _ = info(capsys, "small")
    assert code == 0 and lines[0].startswith("ModelConfig(vocab_size=37000, tgt_vocab_size=None, d_model=256")
    assert info(capsys)[1] == info(capsys, "base")[1]  # base, as before the argument existed


def test_a_checkpoint_named_like_a_preset_is_the_checkpoint(tmp_path, tokenizer, capsys, monkeypatch):
    save(tmp_path / "small", tokenizer)
    monkeypatch.chdir(tmp_path)
    code, lines, _ = info(capsys, "small")
    assert code == 0 and lines[0] == "checkpoint: small"


@pytest.mark.parametrize("args, message", [
    (["bse"], "info: 'bse' is neither a preset (base, big, micro, small, tiny) nor a checkpoint directory"),
    # were "checkpoint not found": only a name that is an identifier was said to be no preset either
    (["transformer-big"], ("info: 'transformer-big' is neither a preset (base, big, micro, small, tiny) nor "
                           "a checkpoint directory")),
    (["base "], ("info: 'base ' is neither a preset (base, big, micro, small, tiny) nor a checkpoint "
                 "directory")),
    (["small", "--preset", "base"],
     "info: give a preset or a checkpoint, not both ('small' and --preset base)"),
    (["nowhere/ck"], "nowhere/ck: checkpoint not found"),
    # were "ModelConfig: eos_id=2 is outside the vocabulary of 2" and "vocab_size=... is more than ...":
    # no flag named
    (["small", "--vocab-size", "2"],
     "info: --vocab-size 2 is not in 3 to 2,147,483,647 (ids 0 to 2 are pad, BOS and EOS)"),
    (["--vocab-size", "2147483648"],
     "info: --vocab-size 2147483648 is not in 3 to 2,147,483,647 (ids 0 to 2 are pad, BOS and EOS)"),
])
def test_wrong_arguments_are_one_line(capsys, args, message):
    code, lines, err = info(capsys, *args)
    assert code == 2 and not lines and err == f"aiayn: error: {message}"


def test_a_checkpoint_a_killed_save_left_moved_aside_is_named_there(tmp_path, tokenizer, capsys):
    """A kill between the two renames of a re-save left step_N only as .step_N.aiayn-old, until the run's
    next `aiayn train` puts it back: info and translate said "checkpoint not found", no more."""
    checkpoints = tmp_path / "run" / "checkpoints"
    path = save(checkpoints / "step_000060", tokenizer)
    path.rename(checkpoints / ".step_000060.aiayn-old")
    aside = ("checkpoint not found: a save killed as it replaced it left it as .step_000060.aiayn-old; "
             "rename that back to step_000060 (`aiayn train --resume` of its run does so itself)")
    for command in ("info", "translate"):
        assert main([command, str(path)]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {path}: {aside}\n"
    with pytest.raises(UserError, match=f"^{path}: checkpoint not found: a save killed"):
        average_checkpoints([path, path], tmp_path / "avg")  # meta.json read first
    other = save(tmp_path / "out", tokenizer)  # an output of average or convert: no training run there
    other.rename(tmp_path / ".out.aiayn-old")
    assert info(capsys, other)[2] == (f"aiayn: error: {other}: checkpoint not found: a save killed as it "
                                      "replaced it left it as .out.aiayn-old; rename that back to out")


def test_the_smallest_vocab_size_holds_the_special_ids(capsys):
    code, lines, _ = info(capsys, "micro", "--vocab-size", "3")
    assert code == 0 and "vocab_size=3," in lines[0] and lines[-1] == "parameters: 21,472"


def test_vocab_size_is_refused_for_a_checkpoint(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "ck", tokenizer)
    code, _, err = info(capsys, path, "--vocab-size", "8000")
    assert code == 2
    assert err == f"aiayn: error: info: --vocab-size sizes a preset; {path} is described as saved"


def test_weights_of_another_model_are_named(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "ck", tokenizer)
    save(tmp_path / "wide", tokenizer, d_ff=96)
    (path / WEIGHTS).write_bytes((tmp_path / "wide" / WEIGHTS).read_bytes())
    code, lines, err = info(capsys, path)
    assert code == 2 and not lines
    assert err.startswith(f"aiayn: error: {path / WEIGHTS}: weights do not fit this model: wrong shape [")
    assert "(96, 32) vs (64, 32)" in err


def test_a_damaged_header_is_named(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "ck", tokenizer)
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[:8] + b"{not json" + data[17:])
    code, _, err = info(capsys, path)
    assert code == 2 and err.startswith(f"aiayn: error: {path / WEIGHTS}: corrupt weights (")


def test_a_damaged_meta_json_is_named(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "ck", tokenizer)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "model": "base"}))
    code, _, err = info(capsys, path)
    assert code == 2 and err == (f"aiayn: error: {path / 'meta.json'}: corrupt checkpoint metadata "
                                 "('model' is not a table)")


def test_a_folder_named_like_a_preset_but_no_checkpoint_is_refused(tmp_path, tokenizer, capsys, monkeypatch):
    """A damaged checkpoint ./base (no meta.json) was described as the preset base, exit 0."""
    path = save(tmp_path / "base", tokenizer)
    (path / "meta.json").unlink()
    monkeypatch.chdir(tmp_path)
    code, lines, err = info(capsys, "base")
    assert code == 2 and not lines
    assert err == ("aiayn: error: info: base exists here but is no checkpoint directory; for the preset, "
                   "give --preset base")
    assert info(capsys, "--preset", "base")[0] == 0


def test_fine_tuning_a_signals_save_and_hand_edited_counts_are_described(tmp_path, tokenizer, capsys):
    path = save(tmp_path / "ck", tokenizer)
    meta = json.loads((path / "meta.json").read_text())
    meta["config"]["train"] = {"init_from": "opus/converted"}
    (path / "meta.json").write_text(json.dumps({**meta, "interrupted": True, "epoch": True}))
    _, lines, _ = info(capsys, path)
    assert "trained: update 300; valid_loss 1.5, valid_nll 1.25, valid_ppl 3.49 (saved on a signal, not " \
           "validated)" in lines  # "epoch True" was printed
    assert lines[-1] == "fine-tuned from: opus/converted"


def test_a_path_that_is_not_utf8_is_named_as_such(tmp_path, tokenizer, capsys):
    """safetensors and SentencePiece open only UTF-8 paths: 'corrupt weights', or a pybind TypeError."""
    import os

    path = save(tmp_path / "ck", tokenizer)
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9")
    os.rename(path, odd)
    code, _, err = info(capsys, odd)
    assert code == 2 and "a path that is not valid UTF-8, which safetensors cannot open; rename it" in err
    with pytest.raises(UserError, match="not valid UTF-8"):
        load_checkpoint(odd)
    assert Tokenizer.load(odd, {"files": {"source": "spm.model"}}).src_vocab_size == tokenizer.src_vocab_size


def _stop_dropped_in(monkeypatch, name, after=False):
    """`aiayn.cli`'s `name` records a Ctrl-C that Python dropped (as the CLI's unraisable hook records one
    raised in a weakref callback) each time it is called, before its work or (`after`) once it is done."""
    from aiayn import cli, files

    real = getattr(cli, name)

    def recorded(*args, **kwargs):
        if not after:
            files.record_dropped_stop(KeyboardInterrupt())
        result = real(*args, **kwargs)
        if after:
            files.record_dropped_stop(KeyboardInterrupt())
        return result

    monkeypatch.setattr(cli, name, recorded)


def test_a_stop_python_dropped_prints_no_result_after_it(capsys, monkeypatch):
    """A Ctrl-C dropped while the command worked: stdout's next write stops it, nothing printed."""
    _stop_dropped_in(monkeypatch, "model_config")
    code = main(["info", "tiny"])
    captured = capsys.readouterr()
    assert (code, captured.out, captured.err) == (130, "", "aiayn: interrupted\n")


def test_a_stop_python_dropped_as_the_command_ends_is_a_stop(capsys, monkeypatch):
    """A Ctrl-C dropped after the command's last output (no rename, no line after it): exit 130, not 0."""
    _stop_dropped_in(monkeypatch, "cmd_info", after=True)
    assert main(["info", "tiny"]) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith("ModelConfig(") and captured.err == "aiayn: interrupted\n"


def test_a_stop_python_dropped_before_an_error_is_not_the_next_commands(capsys, monkeypatch):
    """The command ends with its error (exit 2), the stop left recorded would stop the next command (or a
    Python caller's next atomic write) at once."""
    from aiayn import files

    _stop_dropped_in(monkeypatch, "_info_preset")
    assert main(["info", "small", "--vocab-size", "2"]) == 2
    assert files._dropped_stops == []
    monkeypatch.undo()
    assert info(capsys, "tiny")[0] == 0
