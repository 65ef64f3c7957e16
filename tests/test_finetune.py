"""Fine-tuning: `train.init_from` starts a run from a checkpoint's weights, model and tokenizer.

The loss is measured here, outside the loop, on the training pairs with the checkpoints before and
after; the Marian case starts from a random `transformers.MarianMTModel` converted offline.
"""

from __future__ import annotations

import json
from dataclasses import replace
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import numbers_checkpoint

from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.config import ConfigError, model_config
from aiayn.data.dataset import collate, load_encoded
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.errors import UserError
from aiayn.model import Transformer
from aiayn.train.config import finetune_model_config, load_config
from aiayn.train.loop import _check_outside_other_runs, train
from aiayn.train.loss import label_smoothed_nll
from aiayn.translate import Translator
from train_helpers import write_corpus


def settings(src: Path, tgt: Path, run_dir: Path, init_from: Path, *extra: str) -> list[str]:
    """A short fine-tuning run on (src, tgt): every pair seen, a checkpoint at the end."""
    return [
        f"data.train_src={src}",
        f"data.train_tgt={tgt}",
        "data.max_len=32",
        f"train.run_dir={run_dir}",
        f"train.init_from={init_from}",
        "train.max_tokens=256",
        "train.warmup=4",
        "train.valid_every=100",
        "train.log_every=1",
        "train.threads=1",
        "train.label_smoothing=0.0",
        "train.device=cpu",  # as train_helpers.tiny_config: what CI runs, also on a machine with a GPU
        *extra,
    ]


@torch.no_grad()
def corpus_nll(checkpoint: Path, src: Path, tgt: Path, cache: Path) -> float:
    """NLL per target token of `checkpoint` (eval mode) on the pairs, batched as training does."""
    ck = load_checkpoint(checkpoint)
    corpus, _ = load_encoded(src, tgt, ck.tokenizer, cache)
    batch = collate(corpus, list(range(len(corpus))), ck.tokenizer)
    _, nll = label_smoothed_nll(ck.model(batch.src, batch.tgt_in), batch.tgt_out, 0.0, ck.tokenizer.pad_id)
    return nll.item() / batch.n_tokens


def only_checkpoint(run_dir: Path) -> Path:
    found = sorted((run_dir / "checkpoints").glob("step_*"))
    assert found, f"no checkpoint in {run_dir}"
    return found[-1]


@pytest.fixture
def aiayn_checkpoint(tmp_path) -> tuple[Path, Path, Path]:
    """A random micro model with a SentencePiece model of the toy corpus: (checkpoint, src, tgt)."""
    src, tgt = write_corpus(tmp_path, 40)
    spm = train_sentencepiece(src.read_text().split("\n") + tgt.read_text().split("\n"), tmp_path / "spm", 40)
    tok = Tokenizer(spm)
    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=tok.src_vocab_size, pad_id=tok.pad_id,
                                     decoder_start_id=tok.bos_id, eos_id=tok.eos_id, max_len=64))
    return save_checkpoint(tmp_path / "start", model, tok, {"step": 7}), src, tgt


def test_finetune_aiayn_checkpoint_lowers_loss_and_resumes(aiayn_checkpoint, tmp_path):
    start, src, tgt = aiayn_checkpoint
    run_dir = tmp_path / "run"
    sets = settings(src, tgt, run_dir, start, "train.max_updates=6")
    result = train(load_config(None, sets))
    assert result["step"] == 6  # counted from 0: a new run, not the checkpoint's step 7
    assert not list(run_dir.glob("*.model")) and not list(run_dir.glob("*.spm"))  # no tokenizer trained
    tuned = only_checkpoint(run_dir)
    before, after = (corpus_nll(p, src, tgt, tmp_path / "cache") for p in (start, tuned))
    assert after < before - 0.2, (before, after)
    assert load_checkpoint(tuned).meta["config"]["train"]["init_from"] == str(start)
    assert all(isinstance(t, str) for t in Translator.load(tuned).translate(["ein Hund", "zwei Katzen"]))

    shutil.rmtree(start)  # --resume reads the run's own checkpoint, not init_from
    no_record = ("records no tokenizer settings (imported, or saved outside training), and its tokenizer is "
                 "kept")
    with pytest.raises(UserError, match=re.escape(no_record) + ": data.vocab_size cannot be set"):
        # resumed: the hand-saved start recorded no vocab_size, so the run recorded none (not the default)
        train(load_config(None, sets[:-1] + ["train.max_updates=8", "data.vocab_size=99"]), resume=True)
    result = train(load_config(None, sets[:-1] + ["train.max_updates=8"]), resume=True)
    assert result["step"] == 8

    again = settings(src, tgt, tmp_path / "run2", tuned, "train.max_updates=1")
    assert "vocab_size" not in load_checkpoint(tuned).meta["config"]["data"]  # 8,000 was, for 40 pieces
    with pytest.raises(UserError, match=re.escape(no_record) + ": data.vocab_size cannot be set"):
        train(load_config(None, again + ["data.vocab_size=100"]))  # was ignored, and printed as if used
    assert train(load_config(None, again))["step"] == 1

    # A checkpoint of a run that trained its tokenizer records its settings: [data] left at the defaults
    # takes them (it was refused: "vocab_size was 40, now 8000"), and the run records what it used
    meta = json.loads((tuned / "meta.json").read_text())
    meta["config"]["data"].update(vocab_size=40, spm_type="bpe", shared_vocab=True, character_coverage=0.9995)
    (tuned / "meta.json").write_text(json.dumps(meta))
    third = settings(src, tgt, tmp_path / "run3", tuned, "train.max_updates=1")
    assert train(load_config(None, third))["step"] == 1
    recorded = load_checkpoint(only_checkpoint(tmp_path / "run3")).meta["config"]["data"]
    assert (recorded["vocab_size"], recorded["character_coverage"]) == (40, 0.9995)
    # a value set: refused, named where it was written (it named the checkpoint alone)
    with pytest.raises(UserError, match=r"^--set 'data.vocab_size=100': .*\(data.vocab_size was 40, now 100"):
        train(load_config(None, third + ["train.run_dir=" + str(tmp_path / "run4"), "data.vocab_size=100"]))
    with pytest.raises(UserError, match=r"\(data.vocab_size was 40, now 8000\)"):  # set to the default: too
        train(load_config(None, third + ["train.run_dir=" + str(tmp_path / "run4"), "data.vocab_size=8000"]))
    # resumed without its init_from: told to give it, not that vocab_size 40 was "resumed with the default
    # 8000" (nothing is adopted without init_from), whose remedy led to the init_from refusal next
    no_init = [s for s in third if not s.startswith(("train.init_from=", "train.max_up"))]
    with pytest.raises(UserError, match=f"fine-tunes {tuned}; resume it with train.init_from={tuned}$"):
        train(load_config(None, no_init + ["train.max_updates=2"]), resume=True)

    forgot = [s for s in sets[:-1] if not s.startswith("train.init_from=")] + ["train.max_updates=9"]
    with pytest.raises(UserError, match=f"fine-tunes {start}; resume it with train.init_from={start}") as e:
        train(load_config(None, forgot), resume=True)
    assert "\n" not in str(e.value)
    # Another init_from was ignored (the run goes on from its own checkpoint) and saved as its origin
    other = [s for s in forgot if not s.startswith("train.max_updates")] + [f"train.init_from={tuned}",
                                                                             "train.max_updates=9"]
    with pytest.raises(UserError, match=f"fine-tunes {start}; resume it with train.init_from={start}"):
        train(load_config(None, other), resume=True)
    with pytest.raises(UserError, match=f"^{run_dir}: already holds checkpoints; pass --resume"):
        train(load_config(None, sets))  # the fine-tune of `start` that is there: --resume is the way on
    meta_path = only_checkpoint(run_dir) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["train"]["init_from"] = 123  # a hand's edit: a TypeError traceback
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"corrupt checkpoint metadata \(init_from=123 is not a path\)"):
        train(load_config(None, other), resume=True)
    plain = tmp_path / "plain"  # a run that fine-tuned nothing, resumed with an init_from
    assert train(load_config(None, [s for s in forgot if not s.startswith(("train.run_dir", "train.max_up"))]
                             + [f"train.run_dir={plain}", "train.max_updates=1"]))["step"] == 1
    with pytest.raises(UserError, match="was not fine-tuned from a checkpoint; resume it without train.init"):
        train(load_config(None, settings(src, tgt, plain, tuned, "train.max_updates=2")), resume=True)
    # without --resume it said "pass --resume to continue", which led to the refusal above
    with pytest.raises(UserError, match=rf"^{plain}: already holds the checkpoints of a run that did not "
                                        rf"fine-tune {tuned}; set another train.run_dir$"):
        train(load_config(None, settings(src, tgt, plain, tuned, "train.max_updates=2")))


def test_a_corpus_the_kept_tokenizer_cannot_write_is_warned_of(aiayn_checkpoint, tmp_path, caplog):
    """A fine-tune keeps its checkpoint's tokenizer, trained on other text, and checked none of the new
    corpus: Chinese through a German tokenizer trained on sentences of two <unk>s each, a joiner (ZWNJ)
    the tokenizer turns into a space was learnt as a space, and nothing was said; training a tokenizer
    warns of both."""
    start, src, tgt = aiayn_checkpoint
    zh, en = tmp_path / "zh.src", tmp_path / "zh.tgt"
    zh.write_text("".join(f"我们今天{i}在这里学习\n" for i in range(40)), encoding="utf-8")
    en.write_text(tgt.read_text(encoding="utf-8"), encoding="utf-8")
    with caplog.at_level("WARNING"):
        train(load_config(None, settings(zh, en, tmp_path / "run", start, "train.max_updates=1")))
    unknown = [m for m in caplog.messages if "are <unk>" in m]
    assert len(unknown) == 1 and unknown[0].startswith(f"{zh}: ")
    assert "another language or script?" in unknown[0]
    caplog.clear()
    joined = tmp_path / "zwnj.de"
    joined.write_text("".join(f"{line}\u200cja\n" for line in src.read_text(encoding="utf-8").splitlines()),
                      encoding="utf-8")
    with caplog.at_level("WARNING"):
        train(load_config(None, settings(joined, tgt, tmp_path / "run2", start, "train.max_updates=1")))
    said = [m for m in caplog.messages if "changes this training text" in m]
    assert len(said) == 1 and "U+200C ZERO WIDTH NON-JOINER" in said[0], caplog.messages
    # a source the model reads, as it will read what it translates (was "will learn to write it so")
    assert said[0].endswith(": the model will read it so") and "train a new tokenizer" not in said[0]
    caplog.clear()
    with caplog.at_level("WARNING"):  # the corpus it was trained on: nothing to say
        train(load_config(None, settings(src, tgt, tmp_path / "run3", start, "train.max_updates=1")))
    assert not [m for m in caplog.messages if "<unk>" in m or "changes this training text" in m]


def test_what_the_kept_tokenizer_rewrites_is_said_of_each_file_as_its_set(aiayn_checkpoint, tmp_path, caplog):
    """The warning came once a pair, the training pair's and the validation pair's alike, naming no file
    and saying of both "the model will learn to write it so": of validation text it never learns from."""
    start, src, tgt = aiayn_checkpoint
    wide = {"train": tmp_path / "wide.de", "valid": tmp_path / "wide_valid.de"}
    for path in wide.values():  # a fullwidth letter a line, which nmt_nfkc writes as ASCII
        lines = src.read_text(encoding="utf-8").splitlines()
        path.write_text("".join(f"{line} \uff45in\n" for line in lines), encoding="utf-8")
    sets = settings(wide["train"], tgt, tmp_path / "run", start, "train.max_updates=1",
                    f"data.valid_src={wide['valid']}", f"data.valid_tgt={tgt}")
    with caplog.at_level("WARNING"):
        train(load_config(None, sets))
    said = [m for m in caplog.messages if m.startswith("the tokenizer kept")]
    assert len(said) == 2, caplog.messages
    assert f"this training text (40 of 40 sampled source lines of {wide['train']}), e.g. U+FF45" in said[0]
    assert said[0].endswith(": the model will read it so")  # a source side: the model does not write it
    assert f"this validation text (40 of 40 sampled source lines of {wide['valid']}), e.g. U+FF45" in said[1]
    assert said[1].endswith(": the model trains as usual, but is validated on it as rewritten")


@pytest.mark.parametrize("key", ["d_model=64", "preset=tiny"])
def test_conflicting_model_key_is_a_config_error(aiayn_checkpoint, tmp_path, key):
    start, src, tgt = aiayn_checkpoint
    sets = settings(src, tgt, tmp_path / "run", start, "train.max_updates=1", f"model.{key}")
    with pytest.raises(ConfigError, match=f"model.{key.split('=')[0]}="):
        train(load_config(None, sets))


def test_the_checkpoints_own_preset_may_be_named(aiayn_checkpoint, tmp_path):
    """configs/*.toml name a preset: fine-tuning a run of that shape with its own config is allowed."""
    start, src, tgt = aiayn_checkpoint
    train(load_config(None, settings(src, tgt, tmp_path / "run", start, "train.max_updates=1", "model.preset=micro")))
    assert load_checkpoint(only_checkpoint(tmp_path / "run")).model.config == load_checkpoint(start).model.config
    with pytest.raises(ConfigError, match=r"model.preset='tiny' has d_model=128 \(the checkpoint's: 32\), "):
        train(load_config(None, settings(src, tgt, tmp_path / "run2", start, "model.preset=tiny")))


def test_the_runs_own_config_with_a_preset_and_overrides_may_fine_tune_it(aiayn_checkpoint, tmp_path):
    """preset micro with d_model 48 trained a model that the same config could not fine-tune: the preset's
    own d_model (32) was compared with the checkpoint's, not the config's."""
    start, src, tgt = aiayn_checkpoint
    first = settings(src, tgt, tmp_path / "run", start, "train.max_updates=1")
    first = [s for s in first if not s.startswith("train.init_from=")]
    first += ["model.preset=micro", "model.d_model=48", "data.vocab_size=40"]
    train(load_config(None, first))
    def again(run: str, *extra: str) -> list[str]:
        return settings(src, tgt, tmp_path / run, only_checkpoint(tmp_path / "run"), "train.max_updates=1",
                        "model.preset=micro", "model.d_model=48", "data.vocab_size=40", *extra)

    assert train(load_config(None, again("run2")))["step"] == 1
    with pytest.raises(ConfigError, match=r"model.d_model=64 differs from .*'s 48"):  # the override, named
        train(load_config(None, again("run3", "model.d_model=64")))


def test_an_equivalent_model_value_is_not_a_difference(aiayn_checkpoint, tmp_path):
    """The checkpoint's n_decoder_layers is None, meaning n_layers (1): restating it as 1 was refused."""
    start, src, tgt = aiayn_checkpoint
    assert load_checkpoint(start).model.config.n_decoder_layers is None
    sets = settings(src, tgt, tmp_path / "run", start, "train.max_updates=1", "model.n_decoder_layers=1")
    assert train(load_config(None, sets))["step"] == 1
    # the resolved 1, not None
    refusal = (rf"^--set 'model.n_decoder_layers=2': model.n_decoder_layers=2 differs from "
               rf"{re.escape(str(start))}'s 1;")
    with pytest.raises(ConfigError, match=refusal):
        train(load_config(None, settings(src, tgt, tmp_path / "run2", start, "model.n_decoder_layers=2")))


def test_a_refusal_blames_what_was_written_not_the_checkpoints_settings(aiayn_checkpoint, tmp_path):
    """A checkpoint of separate vocabularies, fine-tuned by a config silent about data.shared_vocab, with
    model.share_embeddings=true: the refusal said "data.shared_vocab=false trains one per side"."""
    _, src, tgt = aiayn_checkpoint
    first = [s for s in settings(src, tgt, tmp_path / "run", Path(), "train.max_updates=1")
             if not s.startswith("train.init_from=")]
    train(load_config(None, [*first, "model.preset=micro", "data.vocab_size=40", "data.shared_vocab=false",
                             "model.share_embeddings=false"]))
    ck = only_checkpoint(tmp_path / "run")
    sets = settings(src, tgt, tmp_path / "run2", ck, "model.share_embeddings=true")
    # named where it was written, as load_config's own refusals are ("run.toml:3: ...")
    # as TOML writes them (True and False were Python's)
    refusal = (rf"^--set 'model.share_embeddings=true': model.share_embeddings=true differs from "
               rf"{re.escape(str(ck))}'s false; with train.init_from")
    with pytest.raises(ConfigError, match=refusal + " only model.dropout may be set"):
        train(load_config(None, sets))
    assert not (tmp_path / "run2").exists()  # refused before it wrote anything: no empty run_dir left
    toml = tmp_path / "tune.toml"
    toml.write_text("[model]\ndropout = 0.2\nd_model = 64\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(toml))}:3: model.d_model=64 differs from"):
        train(load_config(toml, settings(src, tgt, tmp_path / "run2", ck)))
    short = tmp_path / "short"  # a model of 20 positions, fine-tuned by a config silent about data.max_len
    tuned = load_checkpoint(ck)
    model = Transformer(replace(tuned.model.config, max_len=20))
    model.load_state_dict(tuned.model.state_dict(), strict=False)  # the position tables: 20 rows now
    save_checkpoint(short, model, tuned.tokenizer)
    sets = [s for s in settings(src, tgt, tmp_path / "run2", short) if not s.startswith("data.max_len")]
    with pytest.raises(ConfigError, match=rf"^data.max_len=256 \(the default\) is longer than "
                                          rf"{re.escape(str(short))}'s max_len=20; set data.max_len <= 20$"):
        train(load_config(None, sets))
    # A config changed in Python since it was read names no place for a value not written there, and a
    # value set, not defaulted, is not called the default
    config = load_config(None, [*sets, "data.max_len=30"])
    saved = load_checkpoint(short).model.config
    with pytest.raises(ConfigError, match=r"^--set 'data.max_len=30': data.max_len=30 is longer"):
        finetune_model_config(config, saved, short)
    with pytest.raises(ConfigError, match=r"^data.max_len=40 is longer"):
        finetune_model_config(replace(config, data=replace(config.data, max_len=40)), saved, short)
    from aiayn.train.config import DataConfig, RunConfig, TrainConfig

    plain = RunConfig(data=DataConfig(max_len=100), train=TrainConfig(init_from=str(short)))
    with pytest.raises(ConfigError, match=r"^data.max_len=100 is longer"):
        finetune_model_config(plain, saved, short)
    with pytest.raises(ConfigError, match=r"^model.d_model=48 differs"):
        finetune_model_config(replace(config, model={"d_model": 48}), saved, short)


def test_tokenizer_settings_a_checkpoint_cannot_take_are_each_named_where_written(aiayn_checkpoint, tmp_path):
    """A checkpoint that records no tokenizer settings (imported, or saved by hand) refused the first [data]
    tokenizer key alone, naming neither the file's line nor the --set item that wrote it."""
    start, src, tgt = aiayn_checkpoint
    toml = tmp_path / "tune.toml"
    toml.write_text('[data]\nvocab_size = 120\nspm_type = "bpe"\n', encoding="utf-8")
    sets = settings(src, tgt, tmp_path / "run", start, "data.shared_vocab=true")
    with pytest.raises(UserError) as e:
        train(load_config(toml, sets))
    assert str(e.value) == (
        f"{toml}:2 and {toml}:3 and --set 'data.shared_vocab=true': {start}: records no tokenizer settings "
        "(imported, or saved outside training), and its tokenizer is kept: data.vocab_size, data.spm_type, "
        "data.shared_vocab cannot be set (drop them)")


def test_dropout_may_be_set_and_missing_checkpoint_is_one_line(aiayn_checkpoint, tmp_path):
    start, src, tgt = aiayn_checkpoint
    sets = settings(src, tgt, tmp_path / "run", start, "train.max_updates=1", "model.dropout=0.3",
                    "model.d_model=32")  # the checkpoint's own value is allowed too
    train(load_config(None, sets))
    assert load_checkpoint(only_checkpoint(tmp_path / "run")).model.config.dropout == 0.3
    missing = settings(src, tgt, tmp_path / "run2", tmp_path / "nowhere", "train.max_updates=1")
    with pytest.raises(UserError, match="nowhere: checkpoint not found") as e:
        train(load_config(None, missing))
    assert "\n" not in str(e.value)


def test_an_init_from_refused_is_named_where_it_was_written(aiayn_checkpoint, tmp_path, monkeypatch):
    """"runs/ref/checkpoints/step_000015: checkpoint not found" named neither the setting nor where it was
    written, as a data file's refusal does."""
    start, src, tgt = aiayn_checkpoint
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "tune.toml"
    toml.write_text('[train]\ninit_from = "runs/step_000015"\n', encoding="utf-8")
    sets = [s for s in settings(src, tgt, tmp_path / "run", start) if not s.startswith("train.init_from=")]
    with pytest.raises(UserError) as e:
        train(load_config(toml, sets))
    assert str(e.value) == (f"{toml}:2: train.init_from=runs/step_000015: checkpoint not found (a relative "
                            f"path is read from the current directory, {tmp_path})")
    shutil.copytree(start, tmp_path / "runs" / ".step_000015.aiayn-old")  # a killed save's: it is found
    with pytest.raises(UserError) as e:
        train(load_config(toml, sets))
    assert str(e.value).startswith(f"{toml}:2: train.init_from=runs/step_000015: checkpoint not found: a "
                                   "save")
    assert "relative path" not in str(e.value)  # said as if the path were wrong
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # the current directory deleted: a FileNotFoundError traceback from the hint's getcwd
    with pytest.raises(UserError) as e:
        train(load_config(None, ["data.train_src=x.de", "data.train_tgt=x.en",
                                 f"train.run_dir={tmp_path}/r"]))
    assert str(e.value) == "--set 'data.train_src=x.de': data.train_src=x.de: file not found"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        train(load_config(None, settings(src, tgt, tmp_path / "run", src)))
    assert str(e.value) == (f"--set 'train.init_from={src}': train.init_from={src}: is a file, not a "
                            "checkpoint directory")
    (start / "meta.json").write_text("{", encoding="utf-8")  # a file inside names itself
    with pytest.raises(UserError, match=re.escape(f"--set 'train.init_from={start}': {start / 'meta.json'}: "
                                                  "corrupt checkpoint metadata")):
        train(load_config(None, settings(src, tgt, tmp_path / "run", start)))
    assert not (tmp_path / "run").exists()


def test_a_fine_tune_resumed_with_another_dropout_is_refused_before_the_data_work(aiayn_checkpoint, tmp_path,
                                                                                  caplog):
    """[model] was compared on --resume for runs that fine-tune nothing alone: a fine-tune's other dropout
    was refused by `restore`, after the data work, naming neither the setting nor where it was written."""
    start, src, tgt = aiayn_checkpoint
    run_dir = tmp_path / "run"
    sets = settings(src, tgt, run_dir, start, "model.dropout=0.2", "train.max_updates=1")
    train(load_config(None, sets))
    checkpoint = only_checkpoint(run_dir)
    caplog.clear()  # the first run's lines (its pairs dropped as too long, a warning)
    with caplog.at_level("INFO", logger="aiayn"), pytest.raises(UserError) as e:
        train(load_config(None, [*sets, "model.dropout=0.3", "train.max_updates=2"]), resume=True)
    assert str(e.value) == (f"--set 'model.dropout=0.3': {checkpoint}: trained with model.dropout=0.2 "
                            "(resumed with 0.3); --resume continues the run with its model: set it as "
                            "trained, or use a new train.run_dir; to train on with another dropout, "
                            "fine-tune from the checkpoint (train.init_from) in another train.run_dir")
    assert "training pairs" not in caplog.text
    assert train(load_config(None, [*sets, "train.max_updates=2"]), resume=True)["step"] == 2


def test_fine_tuning_an_average_says_what_it_averages(aiayn_checkpoint, tmp_path, caplog):
    """An average keeps its newest checkpoint's step: "fine-tuning avg (update 7 of its run)" said so of
    the mean of two."""
    from aiayn.train.average import average_checkpoints

    start, src, tgt = aiayn_checkpoint
    shutil.copytree(start, tmp_path / "copy")
    average = average_checkpoints([start, tmp_path / "copy"], tmp_path / "avg")
    with caplog.at_level("INFO", logger="aiayn"):
        train(load_config(None, settings(src, tgt, tmp_path / "run", average, "train.max_updates=1")))
    said = f"fine-tuning {average} (the average of 2 checkpoints, {start}, {tmp_path / 'copy'})\n"
    assert said in caplog.text


def test_finetune_converted_marian(tmp_path, caplog):
    pytest.importorskip("transformers")
    from test_marian import SRC_LINES, TGT_LINES, make_marian_dir, source_batch

    from aiayn.interop.marian import convert_marian

    make_marian_dir(tmp_path / "opus", "swish", shared=True)
    start = convert_marian(tmp_path / "opus", tmp_path / "aiayn")
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("\n".join(SRC_LINES[:24]) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(TGT_LINES[:24]) + "\n", encoding="utf-8")
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="aiayn"):
        train(load_config(None, settings(src, tgt, run_dir, start, "train.max_updates=6",
                                         "train.lr_scale=0.5")))
    assert f"fine-tuning {start}\n" in caplog.text  # was "(update ? of its run)": a converted model has none
    tuned = only_checkpoint(run_dir)
    before, after = (corpus_nll(p, src, tgt, tmp_path / "cache") for p in (start, tuned))
    assert after < before - 0.2, (before, after)

    a, b = load_checkpoint(start), load_checkpoint(tuned)
    sentence = "the number 12 is even"
    assert b.tokenizer.encode_src(sentence) == a.tokenizer.encode_src(sentence)
    assert b.tokenizer.vocab == a.tokenizer.vocab and b.tokenizer.pad_id == a.tokenizer.pad_id
    assert b.model.config == a.model.config
    assert b.model.generator.weight is b.model.src_embed.embed.weight  # tied as in the Marian model
    assert b.model.tgt_embed.embed.weight is b.model.src_embed.embed.weight
    x = source_batch(a.tokenizer, [sentence])  # (1, S)
    y = torch.tensor([[a.model.config.decoder_start_id] + a.tokenizer.encode_tgt("die Zahl 12")])  # (1, T)
    with torch.no_grad():
        assert not torch.allclose(a.model(x, y), b.model(x, y), atol=1e-3)

    # The Marian tokenizer records no [data] settings: the fine-tune recorded the defaults (vocab_size 8000,
    # bpe) as its own, and refused the true values in the next fine-tune; one given was taken and recorded.
    assert not {"vocab_size", "spm_type", "shared_vocab"} & set(b.meta["config"]["data"])
    again = settings(src, tgt, tmp_path / "run2", tuned, "train.max_updates=1")
    assert train(load_config(None, again))["step"] == 1
    for start_from in (start, tuned):
        given = settings(src, tgt, tmp_path / "run3", start_from, "train.max_updates=1",
                         "data.vocab_size=120")
        with pytest.raises(UserError, match=re.escape(f"{start_from}: records no tokenizer settings")):
            train(load_config(None, given))


def test_imported_vocabulary_changes_the_cache_key(aiayn_checkpoint):
    """The same SentencePiece model read through a piece -> id vocabulary gives other ids: another cache."""
    from aiayn.data.dataset import cache_key

    start, src, tgt = aiayn_checkpoint
    plain = load_checkpoint(start).tokenizer
    pieces = [plain.src.id_to_piece(i) for i in range(plain.src_vocab_size)]
    mapped = Tokenizer(plain.src_path, vocab={p: len(pieces) - 1 - i for i, p in enumerate(pieces)},
                       specials=dict(pad=0, bos=1, eos=2, unk=3))
    assert mapped.encode_src("ein Hund") != plain.encode_src("ein Hund")
    assert cache_key(src, tgt, mapped) != cache_key(src, tgt, plain)
    assert cache_key(src, tgt, plain) == cache_key(src, tgt, load_checkpoint(start).tokenizer)


def test_cache_key_needs_no_tokenizer_files(aiayn_checkpoint, tmp_path):
    """A tokenizer whose files are gone (its fine-tuning checkpoint pruned by keep_last) still keys the
    encoded cache, with the key its files gave: the models' bytes are read from memory."""
    import shutil

    from aiayn.data.dataset import cache_key

    start, src, tgt = aiayn_checkpoint
    copy = tmp_path / "ck"
    shutil.copytree(start, copy)
    tok = load_checkpoint(copy).tokenizer
    before = cache_key(src, tgt, tok)
    shutil.rmtree(copy)
    assert cache_key(src, tgt, tok) == before == cache_key(src, tgt, load_checkpoint(start).tokenizer)


def test_a_relative_init_from_is_recorded_absolute_and_resumes_from_another_directory(
        aiayn_checkpoint, tmp_path, monkeypatch):
    """Recorded as typed, `runs/x/step_7` was refused by a --resume from another directory that named the
    same checkpoint by its absolute path, and the refusal suggested the relative one, which named nothing
    there."""
    start, src, tgt = aiayn_checkpoint
    monkeypatch.chdir(start.parent)
    run_dir = tmp_path / "run"
    train(load_config(None, settings(src, tgt, run_dir, Path(start.name), "train.max_updates=2")))
    assert load_checkpoint(only_checkpoint(run_dir)).meta["config"]["train"]["init_from"] == str(start)
    monkeypatch.chdir(tmp_path)
    resumed = train(load_config(None, settings(src, tgt, run_dir, start, "train.max_updates=3")), resume=True)
    assert resumed["step"] == 3


def test_a_moved_project_resumes_its_fine_tune_with_init_from_at_the_same_place(aiayn_checkpoint, tmp_path,
                                                                               monkeypatch):
    """init_from is recorded absolute: a project moved or copied whole (the run and the checkpoint it
    fine-tunes), resumed with the command it was started with, was refused ("this run fine-tunes
    /old/...; resume it with train.init_from=/old/..."). The checkpoint at the same place relative to
    the run directory is the one it fine-tuned; another is still refused."""
    start, src, tgt = aiayn_checkpoint
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(start, old / "runs" / "start")
    monkeypatch.chdir(old)

    def tune(init_from: str, run_dir: str = "runs/tune", updates: int = 3) -> list[str]:
        return settings(src, tgt, Path(run_dir), Path(init_from), f"train.max_updates={updates}")

    train(load_config(None, tune("runs/start", updates=2)))
    shutil.copytree(old, new)
    shutil.rmtree(old)
    monkeypatch.chdir(new)
    with pytest.raises(UserError, match="^runs/tune: already holds checkpoints; pass --resume"):
        train(load_config(None, tune("runs/start")))  # said "a run that did not fine-tune runs/start"
    shutil.copytree(new / "runs" / "start", new / "runs" / "other")
    # the init_from to resume with is the one here: the old place, deleted, was advised
    with pytest.raises(UserError, match=f"fine-tunes {old / 'runs' / 'start'}; resume it with "
                                        "train.init_from=runs/start$"):
        train(load_config(None, tune("runs/other")), resume=True)
    (new / "sub").mkdir()
    monkeypatch.chdir(new / "sub")  # the same place relative to the run, written from elsewhere
    assert train(load_config(None, tune("../runs/start", "../runs/tune")), resume=True)["step"] == 3
    tuned = load_checkpoint(only_checkpoint(new / "runs" / "tune"))
    assert tuned.meta["config"]["train"]["init_from"] == str(new / "runs" / "start")


def test_a_run_dir_inside_a_checkpoint_is_refused_with_what_replaces_that_checkpoint(tmp_path):
    """A run_dir inside an average (or any checkpoint outside a run's checkpoints/) was refused as in one
    "which its run's keep_last may delete": keep_last prunes checkpoints/ alone; another average replaces
    an average whole."""
    pruned = tmp_path / "run" / "checkpoints"
    pruned.mkdir(parents=True)
    numbers_checkpoint(tmp_path).rename(pruned / "step_000010")
    shutil.copytree(pruned / "step_000010", tmp_path / "run" / "average_last_1")
    average = "another average or save_checkpoint replaces whole"
    mine = tmp_path / "mymodels" / "checkpoints" / "wmt"  # a folder named checkpoints/ that no run prunes
    shutil.copytree(pruned / "step_000010", mine)
    for checkpoint, fate in ((pruned / "step_000010", "its run's keep_last may delete"),
                             (tmp_path / "run" / "average_last_1", average), (mine, average)):
        said = rf"train\.run_dir lies inside the checkpoint .*{checkpoint.name}, which {fate}; choose "
        with pytest.raises(UserError, match=said + "another run_dir$"):
            _check_outside_other_runs(checkpoint / "finetune")
