"""`aiayn average` refuses checkpoints whose tokenizers differ and warns about independently trained runs."""

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.errors import UserError
from aiayn.train.average import average_checkpoints, average_last

LINES = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'} und die Zahl {i}" for i in range(40)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two tokenizers with the same number of pieces (so the same weight shapes) but other pieces."""
    d = tmp_path_factory.mktemp("spm")
    first = Tokenizer(train_sentencepiece(LINES, d / "a", vocab_size=60))
    other = Tokenizer(train_sentencepiece([line.upper() for line in LINES], d / "b", vocab_size=60))
    assert first.src_vocab_size == other.src_vocab_size and not first.same_as(other)
    return first, other


def save(path, tokenizer, seed=None, step=1, data=None, workdir=None):
    meta = {"step": step}
    if seed is not None:
        meta["config"] = {"train": {"seed": seed}}
    if data is not None:  # (train_src, train_tgt), as the run was given them
        meta.setdefault("config", {})["data"] = dict(zip(("train_src", "train_tgt"), data))
    if workdir is not None:
        meta["workdir"] = str(workdir)
    save_checkpoint(path, tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer, meta)
    return path


def test_other_tokenizer_is_refused_in_one_line(tmp_path, tokenizers, capsys):
    first, other = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    a = save(ckpts / "step_000001", first, step=1)
    save(ckpts / "step_000002", first, step=2)
    b = save(ckpts / "step_000003", other, step=3)  # the last one: its tokenizer would have been kept
    capsys.readouterr()
    assert main(["average", str(tmp_path / "run"), "--last", "3", "-o", str(tmp_path / "avg")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"aiayn: error: {b}: its tokenizer differs from {a}'s; cannot average them"]
    assert not (tmp_path / "avg").exists()


def test_same_tokenizer_still_averages(tmp_path, tokenizers):
    first, _ = tokenizers
    paths = [save(tmp_path / f"ck{i}", first, seed=7, step=i) for i in (1, 2)]
    out = average_checkpoints(paths, tmp_path / "avg")
    assert load_checkpoint(out).tokenizer.same_as(first)


def test_different_seeds_warn_once_naming_the_checkpoints(tmp_path, tokenizers, caplog):
    first, _ = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    a = save(ckpts / "step_000001", first, seed=1, step=1)
    b = save(ckpts / "step_000002", first, seed=2, step=2)
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        out = average_last(tmp_path / "run", 2, tmp_path / "avg")
    assert out.exists()  # warned, not refused
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "train.seed" in warnings[0]
    assert str(a) in warnings[0] and str(b) in warnings[0]


@pytest.mark.parametrize("other", [("tr.en", "tr.de"), ("more.de", "more.en")])
def test_runs_trained_on_other_data_or_in_the_other_direction_warn_once(tmp_path, tokenizers, caplog, other):
    """Of one seed, a de->en run and an en->de one sharing their spm.model were averaged silently."""
    first, _ = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    a = save(ckpts / "step_000001", first, seed=1, step=1, data=("tr.de", "tr.en"), workdir=tmp_path)
    save(ckpts / "step_000002", first, seed=1, step=2, data=(str(tmp_path / "tr.de"), "./tr.en"),
         workdir=tmp_path)  # the same files
    b = save(ckpts / "step_000003", first, seed=1, step=3, data=other, workdir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        assert average_last(tmp_path / "run", 3, tmp_path / "avg").exists()  # warned, not refused
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    src, tgt = (tmp_path / name for name in other)
    assert warnings == [(f"averaging checkpoints of runs recorded as trained on other files ({a}: "
                         f"{tmp_path / 'tr.de'} -> {tmp_path / 'tr.en'}, {b}: {src} -> {tgt}): models of "
                         "other data or direction average into a broken one")]


@pytest.mark.parametrize("recorded", ["moved", "moved here", "older", "scratch", "linked"])
def test_the_same_data_recorded_otherwise_does_not_warn(tmp_path, tokenizers, caplog, recorded):
    """The same data was warned of as different: a run moved and resumed elsewhere (data/tr.de from
    /old/proj, gone, and from the project here; or from two paths of one folder here), an older aiayn's
    relative paths beside a newer one's absolute ones, each job's scratch copy, a link to the data under
    another name."""
    first, _ = tokenizers
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tr.de").write_text("x")
    (tmp_path / "data" / "tr.en").write_text("x")
    (tmp_path / "data" / "train.de").symlink_to(tmp_path / "data" / "tr.de")
    (tmp_path / "alias").symlink_to(tmp_path)
    data, workdirs = {
        "moved": ([("data/tr.de", "data/tr.en")] * 2, ["/old/proj", tmp_path]),
        "moved here": ([("data/tr.de", "data/tr.en")] * 2, [tmp_path / "alias", tmp_path]),
        "older": ([("data/tr.de", "data/tr.en"), ("data/tr.de", "data/tr.en")], [None, tmp_path]),
        "scratch": ([(f"/scratch/job{i}/tr.de", f"/scratch/job{i}/tr.en") for i in (1, 2)], ["/home/u"] * 2),
        "linked": ([("data/tr.de", "data/tr.en"), ("data/train.de", "data/tr.en")], [tmp_path] * 2),
    }[recorded]
    paths = [save(tmp_path / f"ck{i}", first, seed=1, step=i, data=d, workdir=w)
             for i, (d, w) in enumerate(zip(data, workdirs))]
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        average_checkpoints(paths, tmp_path / "avg")
    assert not [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("corpora, names", [(("wmt14-en-de", "iwslt17-en-de"), ("train.en", "train.de")),
                                            (("en-de", "en-fr"), ("train.src", "train.tgt"))])
def test_other_data_sets_of_the_same_file_names_warn(tmp_path, tokenizers, caplog, corpora, names):
    """Two corpora with the usual file names (train.en, train.de in /data/wmt14-en-de and in
    /data/iwslt17-en-de) were taken for one by their names alone: both are here, and other files."""
    first, _ = tokenizers
    data = []
    for corpus in corpora:
        (tmp_path / corpus).mkdir()
        for name in names:
            (tmp_path / corpus / name).write_text(f"{corpus} {name}")
        data.append(tuple(str(tmp_path / corpus / name) for name in names))
    paths = [save(tmp_path / f"ck{i}", first, seed=1, step=i, data=d) for i, d in enumerate(data)]
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        assert average_checkpoints(paths, tmp_path / "avg").exists()  # warned, not refused
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "recorded as trained on other files" in warnings[0]
    assert all(f"{p}: {src} -> {tgt}" in warnings[0] for p, (src, tgt) in zip(paths, data))


def test_one_seed_does_not_warn(tmp_path, tokenizers, caplog):
    first, _ = tokenizers
    torch.manual_seed(0)
    paths = [save(tmp_path / f"ck{i}", first, seed=3, step=i) for i in (1, 2)] + [save(tmp_path / "ck3", first)]
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        average_checkpoints(paths, tmp_path / "avg")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_checkpoint_with_another_model_is_the_one_named(tmp_path, tokenizers):
    """Each model was compared with the newest's: a damaged newest meta.json (d_ff 16 M) blamed the first
    of the good ones. The odd one out is named now, with the setting that differs; of two, both."""
    import json

    first, _ = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    paths = [save(ckpts / f"step_{s:06d}", first, step=s) for s in (1, 2, 3)]
    meta = json.loads((paths[-1] / "meta.json").read_text())
    d_ff = meta["model"]["d_ff"]
    meta["model"]["d_ff"] = 16_777_216
    (paths[-1] / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=rf"^{paths[-1]}: a different model from the other checkpoints "
                                        rf"\(d_ff 16777216 against {d_ff}\); cannot average them$"):
        average_checkpoints(paths, tmp_path / "avg")
    with pytest.raises(UserError, match=rf"^{paths[-1]} and {paths[-2]}: different models \(d_ff "):
        average_checkpoints(paths[1:], tmp_path / "avg")


def test_a_damaged_checkpoint_is_named_not_the_newest(tmp_path, tokenizers):
    """A NaN in one checkpoint went into the mean, which was checked as the newest checkpoint's weights:
    the message sent the user to delete a good one."""
    from safetensors.torch import load_file, save_file

    first, _ = tokenizers
    paths = [save(tmp_path / f"ck{i}", first, step=i) for i in (1, 2, 3)]
    weights = load_file(paths[0] / "model.safetensors")
    name = next(k for k in weights if k.endswith("bias"))
    weights[name][0] = float("nan")
    save_file(weights, paths[0] / "model.safetensors")
    named = re.escape(str(paths[0] / "model.safetensors"))
    with pytest.raises(UserError, match=rf"^{named}: 1 tensor\(s\) hold NaN or infinite values \({name}"):
        average_checkpoints(paths, tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


@pytest.mark.parametrize("damage, said", [
    ("removed", r"missing \['{name}'\]"), ("reshaped", r"wrong shape \['{name} \(1,"),
    ("int32", r"wrong dtype \['{name} torch.int32 vs torch.float32'\]"),
    ("extra", r"unexpected \['extra'\]")])
def test_the_newest_checkpoints_damaged_weights_are_named_not_an_older_one(tmp_path, tokenizers, damage,
                                                                           said):
    """The newest checkpoint's weights were the reference every other was compared with: one of its tensors
    removed, reshaped or made int32, or one added, blamed the intact oldest ("ck1: weight names differ from
    ck3"). Each file is checked against the model its meta.json describes first."""
    from safetensors.torch import load_file, save_file

    first, _ = tokenizers
    paths = [save(tmp_path / f"ck{i}", first, step=i) for i in (1, 2, 3)]
    weights = load_file(paths[-1] / "model.safetensors")
    name = next(k for k in weights if k.endswith("bias"))
    if damage == "removed":
        del weights[name]
    elif damage == "reshaped":
        weights[name] = weights[name][:1].clone()
    elif damage == "int32":
        weights[name] = weights[name].to(torch.int32)
    else:
        weights["extra"] = torch.zeros(2)
    save_file(weights, paths[-1] / "model.safetensors")
    named = re.escape(str(paths[-1] / "model.safetensors"))
    with pytest.raises(UserError, match=rf"^{named}: weights do not fit this model: "
                                        + said.format(name=re.escape(name))):
        average_checkpoints(paths, tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


@pytest.mark.parametrize("mixed", [False, True])
def test_bfloat16_checkpoints_average_into_bfloat16(tmp_path, tokenizers, mixed):
    """They were loaded into a float32 model and saved from it: twice the size, the mean widened. Mixed
    (LayerNorms kept in float32), each tensor keeps its own dtype."""
    from safetensors.torch import load_file, save_file

    first, _ = tokenizers
    paths = [save(tmp_path / f"ck{i}", first, step=i) for i in (1, 2)]
    for p in paths:
        weights = p / "model.safetensors"
        save_file({k: v if mixed and "norm" in k else v.bfloat16() for k, v in load_file(weights).items()},
                  weights)
    out = average_checkpoints(paths, tmp_path / "avg")
    states = [load_file(p / "model.safetensors") for p in (*paths, out)]
    for name, t in states[2].items():
        kept = torch.float32 if mixed and "norm" in name else torch.bfloat16
        assert t.dtype == states[0][name].dtype == kept
        expected = ((states[0][name].double() + states[1][name].double()) / 2).to(t.dtype)
        assert torch.equal(t, expected)  # rounded once, from the float64 mean


def test_a_checkpoint_saved_on_a_signal_is_left_out_of_the_last_k(tmp_path, tokenizers, caplog):
    """A run stopped by a signal saves one update or a few after its last regular checkpoint: averaged,
    it counted nearly the same weights twice and pushed an older checkpoint out of the window, and the
    average said it was "saved on a signal" itself."""
    first, _ = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (10, 20, 30):
        save(ckpts / f"step_{step:06d}", first, step=step)
    signal = save(ckpts / "step_000031", first, step=31)
    meta = json.loads((signal / "meta.json").read_text())
    (signal / "meta.json").write_text(json.dumps({**meta, "interrupted": True}))
    with caplog.at_level(logging.INFO):
        out = average_last(tmp_path / "run", 2)
    assert out.name == "average_last_2"
    averaged = json.loads((out / "meta.json").read_text())
    assert averaged["averaged"] == [str(ckpts / "step_000020"), str(ckpts / "step_000030")]
    assert "interrupted" not in averaged
    assert "left out step_000031: saved on a signal" in caplog.text
    for step in (10, 20, 30):  # a run of nothing but signal saves still averages them
        shutil.rmtree(ckpts / f"step_{step:06d}")
    alone = average_last(tmp_path / "run", 2)
    assert json.loads((alone / "meta.json").read_text())["averaged"] == [str(signal)]


def test_fewer_checkpoints_than_asked_for_are_counted_in_words_that_fit(tmp_path, tokenizers, caplog):
    """A run that had saved one checkpoint, averaged with --last 2: "only 1 checkpoints, averaging those",
    then "averaged 1 checkpoints"."""
    first, _ = tokenizers
    save(tmp_path / "run" / "checkpoints" / "step_000010", first, step=10)
    with caplog.at_level(logging.INFO):
        out = average_last(tmp_path / "run", 2)
    assert f"{tmp_path / 'run'}: only 1 checkpoint where 2 were asked for; averaging that one" in caplog.text
    assert f"averaged 1 checkpoint into {out}" in caplog.text
    save(tmp_path / "run" / "checkpoints" / "step_000020", first, step=20)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        out = average_last(tmp_path / "run", 3)
    assert "only 2 checkpoints where 3 were asked for; averaging those" in caplog.text
    assert f"averaged 2 checkpoints into {out}" in caplog.text


def test_a_checkpoint_a_killed_save_left_moved_aside_is_named_not_skipped(tmp_path, tokenizers):
    """A kill between the two renames of a re-save left step_N only as .step_N.aiayn-old, out of the
    listing until the run's next `aiayn train` puts it back: --last 2 averaged the two before it, silently."""
    first, _ = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (10, 20, 30):
        save(ckpts / f"step_{step:06d}", first, step=step)
    (ckpts / "step_000030").rename(ckpts / ".step_000030.aiayn-old")
    with pytest.raises(UserError) as e:
        average_last(tmp_path / "run", 2)
    assert str(e.value) == (
        f"{ckpts / 'step_000030'}: checkpoint not found: a save killed as it replaced it left it as "
        ".step_000030.aiayn-old; rename that back to step_000030 (`aiayn train --resume` of its run does so "
        "itself); average the run's last checkpoints once it is back")
    assert not (tmp_path / "run" / "average_last_2").exists()
    assert (ckpts / ".step_000030.aiayn-old").is_dir()  # left for the run to put back
    save(ckpts / "step_000030", first, step=30)  # beside a complete one it is a leftover: nothing missing
    assert average_last(tmp_path / "run", 2).name == "average_last_2"


def test_paths_as_strings_average_and_are_recorded_absolute(tmp_path, tokenizers, monkeypatch):
    """Strings failed at `directory / META` (a TypeError); the relative paths recorded in "averaged"
    meant nothing from another directory (`aiayn info`)."""
    first, _ = tokenizers
    for i in (1, 2):
        save(tmp_path / f"ck{i}", first, step=i)
    monkeypatch.chdir(tmp_path)
    out = average_checkpoints(["ck1", "ck2"], "avg")
    assert json.loads((out / "meta.json").read_text())["averaged"] == [str(tmp_path / "ck1"),
                                                                         str(tmp_path / "ck2")]


def test_one_path_is_refused_and_a_missing_one_is_not_found(tmp_path, tokenizers):
    """One str was read character by character ("r: not an aiayn checkpoint (no meta.json)"), a Path failed
    as not iterable; a missing checkpoint was "not an aiayn checkpoint (no meta.json)", where loading it
    says "checkpoint not found"."""
    ck = save(tmp_path / "ck1", tokenizers[0])
    refused = rf"^paths is a list of checkpoints: pass \[{re.escape(repr(str(ck)))}\]$"
    for one in (str(ck), ck):
        with pytest.raises(TypeError, match=refused):
            average_checkpoints(one, tmp_path / "avg")
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'nope'))}: checkpoint not found$"):
        average_checkpoints([ck, tmp_path / "nope"], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_models_are_compared_as_they_load_and_without_dropout(tmp_path, tokenizers):
    """A setting left out of meta.json is its default as loading reads it, and dropout shapes training,
    not the weights: "different models (final_logits_bias False against None)" was untrue, and a
    fine-tune's other dropout was refused."""
    first, _ = tokenizers
    paths = [save(tmp_path / f"ck{i}", first, step=i) for i in (1, 2, 3)]
    edits = ((paths[0], lambda m: m.pop("final_logits_bias")), (paths[1], lambda m: m.update(dropout=0.3)))
    for path, edit in edits:
        meta = json.loads((path / "meta.json").read_text())
        edit(meta["model"])
        (path / "meta.json").write_text(json.dumps(meta))
    averaged = load_checkpoint(average_checkpoints(paths, tmp_path / "avg")).model.config
    assert averaged == load_checkpoint(paths[-1]).model.config  # the newest's, its dropout with it


def test_a_setting_is_compared_as_what_it_means(tmp_path, tokenizers):
    """n_decoder_layers None is n_layers: a fine-tune that restated it (2 layers both ways) was refused as
    "different models (n_decoder_layers 2 against None)"; another number of layers still is."""
    first, _ = tokenizers
    paths = [save(tmp_path / f"ck{i}", first, step=i) for i in (1, 2)]
    meta = json.loads((paths[1] / "meta.json").read_text())
    assert meta["model"]["n_layers"] == 2 and meta["model"]["n_decoder_layers"] is None
    meta["model"]["n_decoder_layers"] = 2
    (paths[1] / "meta.json").write_text(json.dumps(meta))
    assert load_checkpoint(average_checkpoints(paths, tmp_path / "avg")).model.config.decoder_layers == 2
    meta["model"]["n_decoder_layers"] = 1
    (paths[1] / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"different models \(n_decoder_layers 1 against 2\)"):
        average_checkpoints(paths, tmp_path / "avg2")


def test_whole_number_tensors_must_agree_and_are_kept():
    """Their mean was truncated toward zero (1.5 -> 1), a boolean one became an OR, int64 past 2^53
    rounded: a tensor of whole numbers that differs has no mean of its kind."""
    from aiayn.train.average import average_state_dicts

    big = torch.tensor([2**60 + 1])
    mean = average_state_dicts([{"w": torch.tensor([1.0, 2.0]), "n": big},
                                {"w": torch.tensor([2.0, 4.0]), "n": big}])
    assert torch.equal(mean["w"], torch.tensor([1.5, 3.0])) and torch.equal(mean["n"], big)
    for a, b in ((torch.tensor([1]), torch.tensor([2])), (torch.tensor([True]), torch.tensor([False]))):
        with pytest.raises(ValueError, match=f"n: a {a.dtype} tensor that differs between the states"):
            average_state_dicts([{"n": a}, {"n": b}])


def test_a_checkpoints_folder_or_a_checkpoint_given_as_the_run_says_so(tmp_path, tokenizers, monkeypatch):
    first, _ = tokenizers
    ckpts = tmp_path / "run" / "checkpoints"
    one = save(ckpts / "step_000001", first, step=1)
    with pytest.raises(UserError, match=f"it is a run's checkpoints folder: give the run directory, "
                                        f"{tmp_path / 'run'}"):
        average_last(ckpts, 2)
    with pytest.raises(UserError, match="it is a checkpoint: give the run directory whose last checkpoints"):
        average_last(one, 2)
    monkeypatch.chdir(ckpts)  # `aiayn average .` there: "no checkpoints found", no hint
    with pytest.raises(UserError, match=r"^\.: no checkpoints found \(it is a run's checkpoints folder: give "
                                        r"the run directory, \.\.\)"):
        average_last(Path("."), 2)


def test_a_demo_folder_given_as_the_run_names_its_run_as_plot_does(tmp_path, tokenizers, capsys):
    """`aiayn average demo` said only "demo: no checkpoints found"; `plot demo` named demo/run."""
    first, _ = tokenizers
    demo = tmp_path / "demo"
    save(demo / "run" / "checkpoints" / "step_000001", first, step=1)
    capsys.readouterr()
    assert main(["average", str(demo)]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: {demo}: no checkpoints found (the run directory is "
                                       f"{demo / 'run'})\n")
    assert main(["average", str(demo / "run")]) == 0 and (demo / "run" / "average_last_1").is_dir()


def test_the_running_mean_is_the_float64_mean_in_each_dtype_and_holds_one_state_at_a_time():
    """average read every checkpoint before adding any (20 of `big`: 17 GB); the running sum must give
    the float64 mean of a list, for float32, bfloat16, float64 and complex tensors alike."""
    from aiayn.train.average import RunningMean

    g = torch.Generator().manual_seed(0)
    states = [{"a": torch.randn(5, generator=g), "b": torch.randn(3, generator=g).bfloat16(),
               "c": torch.randn(2, generator=g, dtype=torch.float64),
               "z": torch.randn(2, generator=g, dtype=torch.complex128), "n": torch.tensor([7])}
              for _ in range(3)]
    mean = RunningMean()
    for s in states:
        mean.add(s)
    got = mean.mean({n: t.dtype for n, t in states[0].items()})
    for name in ("a", "b", "c", "z"):
        want = sum(s[name].to(torch.complex128 if name == "z" else torch.float64) for s in states) / 3
        assert got[name].dtype == states[0][name].dtype, name
        assert torch.equal(got[name], want.to(states[0][name].dtype)), name
    assert torch.equal(got["n"], torch.tensor([7]))
