"""Checkpoints round-trip exactly, tie weights once, and reject what is not theirs with one clear line."""

import errno
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import aiayn.checkpoint
import aiayn.files
from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.errors import CorruptFile, UserError
from aiayn.train.average import average_last
from conftest import padded_batch, record_disk_events, tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    lines = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'} und die Zahl {i}" for i in range(300)]
    return Tokenizer(train_sentencepiece(lines, d / "spm", vocab_size=60))


def test_tokenizer_specials_and_round_trip(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    ids = tokenizer.encode_src("the number 12 is even")
    assert ids[-1] == tokenizer.eos_id
    assert tokenizer.decode_tgt(tokenizer.encode_tgt("the number 12 is even") + [2, 7, 7]) == "the number 12 is even"


def test_round_trip_is_exact(tmp_path, tokenizer):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size, final_logits_bias=True)
    save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 7})
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.meta["step"] == 7 and loaded.model.config == model.config
    src, tgt = padded_batch([4, 2], tokenizer.src_vocab_size), padded_batch([3, 3], tokenizer.src_vocab_size)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), loaded.model(src, tgt))
    m = loaded.model
    assert m.generator.weight is m.src_embed.embed.weight  # tying survives the round trip
    assert loaded.tokenizer.encode_src("the number 3") == tokenizer.encode_src("the number 3")


def test_save_replaces_an_earlier_checkpoint_only(tmp_path, tokenizer):
    """`save_checkpoint("models", ...)` replaced a folder of the user's files: only the CLI's outputs were
    checked. A checkpoint there is replaced (training re-saves a step), an empty folder filled."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    (tmp_path / "models" / "other").mkdir(parents=True)
    (tmp_path / "models" / "b.txt").write_text("mine")
    for exist_ok in (True, False):  # without exist_ok it was "already exists", which exist_ok did not mend
        with pytest.raises(UserError, match=r"models: holds files that are not an aiayn checkpoint; will not "
                                            r"replace it \(delete it first"):
            save_checkpoint(tmp_path / "models", model, tokenizer, exist_ok=exist_ok)
    assert (tmp_path / "models" / "b.txt").read_text() == "mine" and (tmp_path / "models" / "other").is_dir()
    (tmp_path / "empty").mkdir()
    for step in (1, 2):
        save_checkpoint(tmp_path / "empty", model, tokenizer, {"step": step})
        assert load_checkpoint(tmp_path / "empty").meta["step"] == step
    (tmp_path / "empty" / "eval.txt").write_text("mine")
    with pytest.raises(UserError, match="holds eval.txt beside an aiayn checkpoint; replacing it would "
                                        "delete them, so move them out first"):
        save_checkpoint(tmp_path / "empty", model, tokenizer, {"step": 3})
    assert load_checkpoint(tmp_path / "empty").meta["step"] == 2


def test_a_callers_meta_never_replaces_what_is_saved(tmp_path, tokenizer):
    """`meta=loaded.meta` kept the loaded model's configuration: the new weights were saved under the old
    one (dropout and max_len here), silently."""
    save_checkpoint(tmp_path / "old", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer, {"step": 7})
    old = load_checkpoint(tmp_path / "old")
    new = tiny_model(vocab_size=tokenizer.src_vocab_size, dropout=0.2, max_len=64)
    save_checkpoint(tmp_path / "new", new, tokenizer, meta={**old.meta, "format": "x", "tokenizer": {}})
    loaded = load_checkpoint(tmp_path / "new")
    assert loaded.model.config == new.config and loaded.meta["step"] == 7
    assert loaded.meta["format"] == "aiayn-1" and loaded.tokenizer.same_as(tokenizer)


def test_a_model_packed_or_quantized_for_decoding_is_not_saved(tmp_path, tokenizer):
    """The Translator's CPU packing keeps the Linear weights outside the state_dict: the file was saved
    without them and refused only on loading. An int8 model's state_dict holds packed parameters: an
    AttributeError traceback."""
    from aiayn.decoding.cpu import pack_for_cpu, packing_available
    from aiayn.translate import quantize_int8

    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    prepared = [quantize_int8(model)] + ([pack_for_cpu(model)] if packing_available() else [])
    for decoding in prepared:
        refused = r"/ck: not saved: the model does not hold a Transformer's weights \(missing \[.*\); a model"
        with pytest.raises(UserError, match=refused):
            save_checkpoint(tmp_path / "ck", decoding, tokenizer)
        assert not (tmp_path / "ck").exists()
    with pytest.raises(TypeError, match=r"^save_checkpoint saves a Transformer, not a Linear$"):
        save_checkpoint(tmp_path / "ck", torch.nn.Linear(2, 2), tokenizer)
    # None failed in the vocabulary's check: "'NoneType' object has no attribute 'src_vocab_size'"
    with pytest.raises(TypeError, match=r"^save_checkpoint saves the model's Tokenizer with it, not NoneType: "
                                        r"load_checkpoint\(path\)\.tokenizer"):
        save_checkpoint(tmp_path / "ck", model, None)
    assert not (tmp_path / "ck").exists()


def test_what_loading_would_refuse_is_not_saved(tmp_path, tokenizer):
    """A model whose embeddings do not fit the tokenizer, or with a NaN weight, was saved, and loading then
    blamed the file ("not the tokenizer this model was trained with", "the file is damaged")."""
    good = tiny_model(vocab_size=tokenizer.src_vocab_size)
    save_checkpoint(tmp_path / "ck", good, tokenizer, {"step": 1})
    broken = tiny_model(vocab_size=tokenizer.src_vocab_size)
    with torch.no_grad():
        broken.decoder[0].feed_forward.w_1.weight[0, 0] = float("nan")
    pieces = tokenizer.src_vocab_size
    other_vocabulary = rf"ck: not saved: the source tokenizer has {pieces} pieces but the model 50 embeddings"
    nan = r"ck: not saved: 1 tensor\(s\) of the model hold NaN or infinite values \(decoder.0.feed_forward"
    refusals = ((tiny_model(vocab_size=50), other_vocabulary), (broken, nan))
    for model, message in refusals:
        with pytest.raises(UserError, match=message):
            save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 2})
        assert load_checkpoint(tmp_path / "ck").meta["step"] == 1  # the checkpoint there is left as it was


def test_loading_skips_the_random_initialization_it_would_overwrite(tmp_path, tokenizer, monkeypatch):
    """A loaded model is built on the meta device and given memory (0.5 s of `base`'s initialization
    saved): no init function may touch a real tensor, and yet every weight and buffer, the position
    tables included, must be the saved model's."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size, final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias.normal_()
    save_checkpoint(tmp_path / "ck", model, tokenizer)

    def meta_only(tensor, *args, **kwargs):
        assert tensor.is_meta, "a loaded model was initialized in real memory"
        return tensor

    for name in ("xavier_uniform_", "normal_", "zeros_", "ones_", "uniform_"):
        monkeypatch.setattr(torch.nn.init, name, meta_only)
    loaded = load_checkpoint(tmp_path / "ck").model
    monkeypatch.undo()
    expected = dict(model.named_buffers()) | dict(model.named_parameters())
    got = dict(loaded.named_buffers()) | dict(loaded.named_parameters())
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert loaded.generator.weight is loaded.src_embed.embed.weight

def test_a_checkpoint_path_of_another_type_is_named_and_bytes_are_a_path(tmp_path, tokenizer):
    """load_checkpoint(None) failed in pathlib: "expected str, bytes or os.PathLike object, not NoneType";
    bytes, which os.fspath takes, failed there too ("argument should be a str or an os.PathLike object")."""
    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    with pytest.raises(TypeError, match=r"^checkpoint is NoneType: a checkpoint directory's path$"):
        load_checkpoint(None)
    assert load_checkpoint(os.fsencode(tmp_path / "ck")).meta == load_checkpoint(tmp_path / "ck").meta


def test_loading_a_checkpoint_leaves_torch_compile_unimported(tmp_path, tokenizer):
    """normal_ and arange on the meta device go through PyTorch's reference implementations, which import
    torch._dynamo: 1.3 s of every `aiayn translate`, `score` or `attention` (a third of a small one)."""
    import subprocess
    import sys

    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    code = ("import sys; from aiayn.checkpoint import load_checkpoint; load_checkpoint(sys.argv[1]); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], check=True)


def test_a_checkpoint_directory_has_the_permissions_of_any_new_directory(tmp_path, tokenizer):
    """Written through a private temporary directory (mkdtemp's 0700), and its tensors by safetensors
    (0600 whatever the umask), it must not stay private: files get what `open(path, "w")` gives."""
    old = os.umask(0o022)
    try:
        model = tiny_model(vocab_size=tokenizer.src_vocab_size)
        save_checkpoint(tmp_path / "ck", model, tokenizer, trainer_tensors={"x": torch.zeros(2)}, trainer_meta={})
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain.txt").write_text("")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ck").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o755
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "model.safetensors" in files and "trainer.safetensors" in files
    for name in files:
        assert stat.S_IMODE((tmp_path / "ck" / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644


@pytest.mark.parametrize("cut", ["half", "header", "empty", "bytes added"])
def test_weights_cut_short_are_said_so(tmp_path, tokenizer, capsys, cut):
    """A model.safetensors cut short (a copy or download interrupted) was 'corrupt weights (Error while
    deserializing header: incomplete metadata, file not fully covered)', which did not say so."""
    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    path = tmp_path / "ck" / "model.safetensors"
    data = path.read_bytes()
    cuts = {"half": data[: len(data) // 2], "header": data[:20], "empty": b"", "bytes added": data + b"\0"}
    path.write_bytes(cuts[cut])
    with pytest.raises(CorruptFile, match=rf"^{re.escape(str(path))}: damaged or cut short \(Error while "):
        load_checkpoint(tmp_path / "ck")
    capsys.readouterr()
    assert main(["info", str(tmp_path / "ck")]) == 2  # the header alone is read there
    assert capsys.readouterr().err.startswith(f"aiayn: error: {path}: damaged or cut short (")


@pytest.mark.parametrize("words", [
    "incomplete metadata, file not fully covered", "invalid header length", "header too small",  # 0.6+
    "MetadataIncompleteBuffer", "InvalidHeaderLength", "HeaderTooSmall",  # 0.4 and 0.5
])
def test_safetensors_words_for_a_file_cut_short_are_known_from_every_version_admitted(words):
    """safetensors 0.4 and 0.5 (which pyproject admits) named a file cut short by its error variant
    ('Error while deserializing header: MetadataIncompleteBuffer'), which was called corrupt weights rather
    than damaged or cut short; the other words of a refusal are not."""
    assert aiayn.checkpoint.cut_short(SafetensorError(f"Error while deserializing header: {words}"))
    assert not aiayn.checkpoint.cut_short(SafetensorError("Error while deserializing header: HeaderTooLarge"))
    assert not aiayn.checkpoint.cut_short(ValueError(f"Error while deserializing header: {words}"))


def test_errors_name_the_file(tmp_path, tokenizer):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    with pytest.raises(UserError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(UserError, match="model.safetensors: corrupt weights"):
        load_checkpoint(tmp_path / "ck")
    if Path("/proc/self/mem").exists():  # a file that cannot be mapped (a FUSE mount) is not corrupt
        (tmp_path / "ck" / "model.safetensors").unlink()
        (tmp_path / "ck" / "model.safetensors").symlink_to("/proc/self/mem")
        with pytest.raises(UserError, match=r"model.safetensors: cannot read \(No such device\)$") as e:
            load_checkpoint(tmp_path / "ck")
        assert not isinstance(e.value, CorruptFile)  # for which --resume advises an earlier checkpoint
    save_checkpoint(tmp_path / "ck", model, tokenizer)  # replacing an existing one
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    meta["model"]["d_model"] = 64
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="do not fit this model: .*wrong shape"):
        load_checkpoint(tmp_path / "ck")
    meta["model"]["max_len"] = 10**8  # a 200 GB position table: was a MemoryError traceback
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="meta.json: bad model configuration .*max_len=100000000"):
        load_checkpoint(tmp_path / "ck")
    meta["model"]["max_len"] = 1024
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "ck" / "model.safetensors").unlink()
    (tmp_path / "ck" / "model.safetensors").mkdir()
    with pytest.raises(UserError, match="no model.safetensors .*model.safetensors is not a file"):
        load_checkpoint(tmp_path / "ck")
    meta["model"]["d_modle"] = 1
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="d_modle"):
        load_checkpoint(tmp_path / "ck")


def test_a_saved_shared_model_that_names_its_target_vocabulary_still_loads_as_one(tmp_path, tokenizer):
    """ModelConfig took tgt_vocab_size == vocab_size with share_embeddings=True as one shared vocabulary
    (one matrix) and now refuses it: a checkpoint saved so through the API loads as the model it was."""
    model = tiny_model(vocab_size=60)
    ck = save_checkpoint(tmp_path / "ck", model, tokenizer)
    meta = json.loads((ck / "meta.json").read_text())
    meta["model"]["tgt_vocab_size"] = 60
    (ck / "meta.json").write_text(json.dumps(meta))
    loaded = load_checkpoint(ck).model
    assert loaded.config == model.config and loaded.src_embed.embed.weight is loaded.tgt_embed.embed.weight
    src, tgt = padded_batch([4], 60), padded_batch([3], 60)
    torch.testing.assert_close(loaded(src, tgt), model(src, tgt), rtol=0, atol=0)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones too) and its bytes: what must survive a refused or failed write."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_meta(directory: Path, **changes) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    meta.update(changes)
    (directory / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))


@pytest.mark.parametrize("tokenizer_entry", [None, {"model_type": "bpe"}, {"files": "spm.model"}])
def test_meta_without_tokenizer_files_names_meta_json(tmp_path, tokenizer, tokenizer_entry):
    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    write_meta(tmp_path / "ck", tokenizer=tokenizer_entry)
    with pytest.raises(UserError, match=f'^{tmp_path / "ck" / "meta.json"}: missing or malformed "tokenizer"'):
        load_checkpoint(tmp_path / "ck")


def test_integer_weights_are_refused_float16_ones_load(tmp_path, tokenizer):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    path = tmp_path / "ck" / "model.safetensors"
    weights = copied(load_file(str(path)))
    save_file({k: v.half() for k, v in weights.items()}, str(path))  # float16 keeps its values in float32
    loaded = load_checkpoint(tmp_path / "ck").model.state_dict()
    assert all(torch.equal(loaded[k], v.half().float()) for k, v in weights.items())
    save_file({**weights, "encoder.0.feed_forward.w_1.weight": weights["encoder.0.feed_forward.w_1.weight"].long()},
              str(path))
    with pytest.raises(UserError, match=f"^{path}: .*wrong dtype .*encoder.0.feed_forward.w_1.weight torch.int64"):
        load_checkpoint(tmp_path / "ck")


def copied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """load_file's tensors as copies: safetensors before 0.8 maps the file, so that writing over it changed
    them (or killed the process with SIGBUS where the file shrank)."""
    return {name: tensor.clone() for name, tensor in weights.items()}


def test_float8_weights_load_though_float8_has_no_isfinite(tmp_path, tokenizer):
    """The check for NaN in the weights was a NotImplementedError traceback on float8, which has no
    isfinite."""
    ck = save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    path = ck / "model.safetensors"
    weights = copied(load_file(str(path)))
    try:
        save_file({k: v.to(torch.float8_e4m3fn) for k, v in weights.items()}, str(path))
    except KeyError:  # its table of dtypes has no float8
        pytest.skip(f"safetensors {safetensors.__version__} cannot save float8 (0.4.2 and later can)")
    assert load_checkpoint(ck).model.config == tiny_model(vocab_size=tokenizer.src_vocab_size).config


def test_damaged_weights_and_tokenizers_are_refused_in_one_line(tmp_path, tokenizer):
    """A NaN in model.safetensors translated empty lines with exit 0; a swapped spm.model with more pieces
    failed in the embedding lookup; a hand-edited tokenizer entry gave KeyError or reached outside."""
    ck = save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    meta = json.loads((ck / "meta.json").read_text())
    path = ck / "model.safetensors"
    weights = copied(load_file(str(path)))
    broken = dict(weights)
    broken["encoder.0.feed_forward.w_1.weight"] = broken["encoder.0.feed_forward.w_1.weight"].clone()
    broken["encoder.0.feed_forward.w_1.weight"][0, 0] = float("nan")
    save_file(broken, str(path))
    with pytest.raises(UserError, match=rf"^{path}: 1 tensor\(s\) hold NaN or infinite values "
                                        r"\(encoder.0.feed_forward.w_1.weight\); the file is damaged$"):
        load_checkpoint(ck)
    save_file(weights, str(path))
    lines = [f"ein {w} und noch ein {w}" for w in ("Hund", "Baum", "Haus", "Zug", "Weg")] * 40
    bigger = train_sentencepiece(lines, tmp_path / "other", vocab_size=80)
    assert Tokenizer(bigger).src_vocab_size > tokenizer.src_vocab_size
    (ck / "spm.model").write_bytes(bigger.read_bytes())
    with pytest.raises(UserError, match=rf"^{ck / 'spm.model'}: the source tokenizer has \d+ pieces but the "
                                        r"model 60 embeddings: a damaged file, or not the tokenizer"):
        load_checkpoint(ck)
    (ck / "spm.model").write_bytes(b"")  # SentencePiece's ValueError was blamed on meta.json
    with pytest.raises(UserError, match=rf"^{ck / 'spm.model'}: empty, not a SentencePiece model$"):
        load_checkpoint(ck)
    (ck / "spm.model").write_bytes(Path(tokenizer.src_path).read_bytes())
    for entry, message in [({**meta["tokenizer"], "specials": {"pad": 0, "bos": 1, "eos": 2}}, "KeyError"),
                           ({**meta["tokenizer"], "vocab": ["a", "b"]}, "AttributeError"),
                           ({**meta["tokenizer"], "files": {"source": "../spm.model"}}, "not a file name inside"),
                           ({**meta["tokenizer"], "specials": {"pad": 0, "bos": 1, "eos": 9999, "unk": 3}},
                            "special ids eos=9999 outside"),
                           ({**meta["tokenizer"], "specials": {"pad": 0, "bos": 1, "eos": 2, "unk": 60}},
                            "special ids unk=60 outside the model's 60 target embeddings")]:  # one past it
        write_meta(ck, tokenizer=entry)
        with pytest.raises(UserError, match=f"^{ck / 'meta.json'}: .*{message}"):
            load_checkpoint(ck)
    write_meta(ck, tokenizer=meta["tokenizer"])
    assert load_checkpoint(ck).tokenizer.same_as(tokenizer)


class RunsCode:
    """Unpickled, it makes a directory: a pickle can run any code as it loads."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize("zipped", [True, False])
def test_a_pytorch_pickle_in_place_of_the_weights_is_named_never_read(tmp_path, tokenizer, zipped, capsys):
    """torch.save's file renamed model.safetensors was "corrupt weights (Error while deserializing header:
    header too large)", as if damaged."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    ck = save_checkpoint(tmp_path / "ck", model, tokenizer)
    torch.save({"w": torch.zeros(2), "x": RunsCode(tmp_path / "ran")}, ck / "model.safetensors",
               _use_new_zipfile_serialization=zipped)
    kind = "torch.save's zip archive" if zipped else "a raw pickle, torch.save's legacy format"
    said = (f"{ck / 'model.safetensors'}: a PyTorch pickle ({kind}), not safetensors; aiayn never reads "
            "pickles (loading one can run any code): save the model with aiayn.checkpoint.save_checkpoint("
            "directory, model, tokenizer), or its weights with safetensors.torch.save_file(aiayn.checkpoint."
            "state_dict_for_saving(model), path)")
    with pytest.raises(UserError, match=f"^{re.escape(said)}$") as e:
        load_checkpoint(ck)
    assert not isinstance(e.value, CorruptFile)  # not damaged: another format
    assert main(["info", str(ck)]) == 2 and capsys.readouterr().err == f"aiayn: error: {said}\n"
    assert not (tmp_path / "ran").exists()
    # the advice works (it said save_file, which refuses a tied model's shared memory)
    save_file(aiayn.checkpoint.state_dict_for_saving(model), ck / "model.safetensors")
    loaded = load_checkpoint(ck).model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())


def test_only_what_torch_wrote_is_called_a_pytorch_pickle(tmp_path, tokenizer):
    """Any zip was "torch.save's zip archive", any file starting 0x80 "a raw pickle": a safetensors file
    cut to its first bytes, its header's length starting 0x80, was a UserError "a PyTorch pickle", not a
    CorruptFile "damaged or cut short" (--resume's advice to resume from the one before)."""
    import zipfile

    ck = save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    weights = ck / "model.safetensors"
    weights.write_bytes((0x80).to_bytes(8, "little")[:6])
    with pytest.raises(CorruptFile, match=rf"^{re.escape(str(weights))}: damaged or cut short \("):
        load_checkpoint(ck)
    weights.write_bytes(b"\x80" + bytes(range(100)))  # damage: no pickle of torch's
    with pytest.raises(CorruptFile, match=rf"^{re.escape(str(weights))}: corrupt weights \("):
        load_checkpoint(ck)
    with zipfile.ZipFile(weights, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(UserError, match=rf"^{re.escape(str(weights))}: a zip archive, not safetensors$"):
        load_checkpoint(ck)
    long_name = tmp_path / f"{'x' * 200}.bin"  # torch names its archive's entries after the file
    torch.save({"w": torch.zeros(2)}, long_name)
    shutil.copyfile(long_name, weights)
    with pytest.raises(UserError, match=r"a PyTorch pickle \(torch\.save's zip archive\)"):
        load_checkpoint(ck)


def pieces_only(model: Path, pieces: int) -> bytes:
    """The first bytes of a SentencePiece model, up to the end of its first `pieces` pieces: the messages
    (field 1, key byte 0x0A) that open the file, each here shorter than 128 bytes (a one-byte length)."""
    data, at = model.read_bytes(), 0
    for _ in range(pieces):
        assert data[at] == 0x0A and data[at + 1] < 0x80
        at += 2 + data[at + 1]
    return data[:at]


@pytest.mark.parametrize("separate", [False, True])
def test_a_truncated_sentencepiece_model_is_named_truncated(tmp_path, tokenizer, separate):
    """A spm.model cut between two pieces parses, with fewer pieces: it was blamed on meta.json ("the source
    tokenizer has 40 pieces but the model 60 embeddings"). With separate vocabularies, the side's file."""
    tok = Tokenizer(tokenizer.src_path, tokenizer.src_path) if separate else tokenizer
    model = tiny_model(vocab_size=60, tgt_vocab_size=60 if separate else None, share_embeddings=not separate)
    ck = save_checkpoint(tmp_path / "ck", model, tok)
    cut = ck / ("target.spm" if separate else "spm.model")
    cut.write_bytes(pieces_only(cut, 40))
    with pytest.raises(UserError, match=rf"^{cut}: truncated: it ends after 40 pieces, without the training "
                                        "settings and normalization rules that follow them in a "
                                        "SentencePiece model$"):
        load_checkpoint(ck)
    if separate:  # a whole model of other pieces is named as the side's file too, not as meta.json
        lines = [f"ein {w} und noch ein {w}" for w in ("Hund", "Baum", "Haus", "Zug", "Weg")] * 40
        cut.write_bytes(train_sentencepiece(lines, tmp_path / "other", vocab_size=50).read_bytes())
        with pytest.raises(UserError, match=rf"^{cut}: the target tokenizer has 50 pieces but the model 60"):
            load_checkpoint(ck)


def test_a_sentencepiece_model_without_its_normalization_rules_is_not_called_truncated(tmp_path, tokenizer):
    """One of the two fields after the pieces is enough: SentencePiece loads and encodes a model built without
    normalizer_spec, which the truncation check first refused."""
    data = tokenizer.src_path.read_bytes()
    at = len(pieces_only(tokenizer.src_path, tokenizer.src_vocab_size))
    assert data[at] == 0x12  # field 2 (trainer_spec), a length-delimited message, then field 3 (0x1A)
    length, start = data[at + 1] & 0x7F, at + 2
    if data[at + 1] >= 0x80:
        length, start = length | data[at + 2] << 7, at + 3
    assert data[start + length] == 0x1A
    (tmp_path / "no_rules.model").write_bytes(data[:start + length])  # pieces and trainer_spec only
    assert Tokenizer(tmp_path / "no_rules.model").encode_src("ein Hund") == tokenizer.encode_src("ein Hund")


FULL_DISK = [OSError(errno.ENOSPC, "No space left on device"),
             SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                             '"No space left on device" })')]


@pytest.mark.parametrize("error", FULL_DISK, ids=["OSError", "SafetensorError"])
def test_full_disk_keeps_the_old_checkpoint_and_leaves_nothing(tmp_path, tokenizer, monkeypatch, error):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 1})
    before = tree(tmp_path)

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(aiayn.checkpoint, "save_file", full)
    with pytest.raises(UserError, match=r"^\S*ck: could not write checkpoint \(.*No space left on device.*\)$"):
        save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 2})
    with pytest.raises(UserError, match="No space left on device"):
        save_checkpoint(tmp_path / "new" / "deeper" / "ck", model, tokenizer)
    assert tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary, no parents


def test_a_full_disk_while_the_tokenizer_is_written_names_the_checkpoint(tmp_path, tokenizer, monkeypatch):
    """The tokenizer's file goes through `atomic_output` inside the temporary directory: its error named
    `.ck.aiayn-PID...tmp/spm.model`, a hidden directory already removed."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)

    def full(fd):  # the first file flushed is the tokenizer's, inside the checkpoint's temporary
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aiayn.files.os, "fsync", full)
    with pytest.raises(UserError) as e:
        save_checkpoint(tmp_path / "ck", model, tokenizer)
    assert str(e.value) == f"{tmp_path / 'ck' / 'spm.model'}: cannot write (No space left on device)"
    assert os.listdir(tmp_path) == []


def test_unwritable_places_are_one_line_errors(tmp_path, tokenizer, monkeypatch):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(UserError, match=f"^{tmp_path / 'afile' / 'ck'}: could not write checkpoint "
                                        f"\\({tmp_path / 'afile'} is not a directory\\)$"):
        save_checkpoint(tmp_path / "afile" / "ck", model, tokenizer)
    with pytest.raises(UserError, match="afile: exists and is not a directory; will not replace it"):
        save_checkpoint(tmp_path / "afile", model, tokenizer)  # write_atomically deletes what it replaces
    assert (tmp_path / "afile").read_text() == "mine"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(aiayn.files.tempfile, "mkdtemp", read_only)
    with pytest.raises(UserError, match=r"ro/ck: could not write checkpoint \(Read-only file system\)$"):
        save_checkpoint(tmp_path / "ro" / "ck", model, tokenizer)
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_failed_rename_puts_the_old_checkpoint_back(tmp_path, tokenizer, monkeypatch):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 1})
    before, real = tree(tmp_path), os.rename

    def rename(src, dst):  # the old one moves aside; the new one cannot follow
        if Path(src).name.startswith(".ck.") and not str(src).endswith(".aiayn-old"):
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(aiayn.files.os, "rename", rename)
    with pytest.raises(UserError, match="Input/output error"):
        save_checkpoint(tmp_path / "ck", model, tokenizer, {"step": 2})
    assert tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["ck"]


def test_save_keeps_a_training_state_and_writes_inside_no_checkpoint(tmp_path, tokenizer):
    """Resaving a loaded step_N in place (`meta=ck.meta`, after a cast, say) deleted its trainer.json and
    trainer.safetensors, so --resume from it failed; a save inside a checkpoint made that one unsavable."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    step = save_checkpoint(tmp_path / "step_000002", model, tokenizer, {"step": 2},
                           {"adam.exp_avg": torch.zeros(2)}, {"step": 2}, owned=True)  # as training saves
    ck = load_checkpoint(step)
    refused = (f"{step}: a training checkpoint, whose state (trainer.json, trainer.safetensors) resuming "
               "needs; saving over it would delete that, so save elsewhere")
    with pytest.raises(UserError, match=re.escape(refused)):
        save_checkpoint(step, ck.model, ck.tokenizer, meta=ck.meta)
    assert {p.name for p in step.iterdir() if p.name.startswith("trainer")} == {"trainer.json",
                                                                              "trainer.safetensors"}
    with pytest.raises(UserError, match=re.escape(f"{step / 'inner'}: lies inside the checkpoint {step}; "
                                                  "save it elsewhere")):
        save_checkpoint(step / "inner", ck.model, ck.tokenizer)
    assert not (step / "inner").exists()


@pytest.fixture
def run(tmp_path, tokenizer):
    """A run directory with three checkpoints of one tiny model (different weights) and a metrics file."""
    torch.manual_seed(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{step:06d}",
                        tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer, {"step": step})
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3}\n')
    return tmp_path / "run"


def test_a_checkpoint_loads_straight_into_another_dtype(run):
    """`Translator.load(dtype="bfloat16")` built the float32 model, then cast it: both copies at once. The
    model is now given bfloat16 memory and takes the float32 file's values rounded, as `.to()` rounds."""
    ck = run / "checkpoints" / "step_000003"
    wide, narrow = load_checkpoint(ck).model, load_checkpoint(ck, dtype=torch.bfloat16).model
    assert {p.dtype for p in narrow.state_dict().values()} == {torch.bfloat16}
    cast = wide.to(torch.bfloat16).state_dict()
    for name, tensor in narrow.state_dict().items():
        if name.endswith(".pe"):  # computed again: float64 rounded once, not through float32
            torch.testing.assert_close(tensor, cast[name], atol=2**-8, rtol=0)
        else:
            assert torch.equal(tensor, cast[name]), name


def test_a_dtype_is_taken_by_its_name_too(run):
    """load_checkpoint(dtype="bfloat16"), the name `Translator.load` takes, failed with "Invalid device
    string: 'bfloat16'" (`Module.to` reads a str as a device); what names no floating dtype is said so."""
    ck = run / "checkpoints" / "step_000003"
    narrow = load_checkpoint(ck, dtype="bfloat16").model
    assert {p.dtype for p in narrow.state_dict().values()} == {torch.bfloat16}
    for bad in ("bf16", torch.int8, "float8_e4m3fn"):  # float8 loaded, then failed to translate: no kernels
        said = f"dtype {bad!r} is not one a model computes in: float32, float64, bfloat16 or float16, as a "
        with pytest.raises(ValueError, match=f"^{re.escape(said)}torch dtype or by name$"):
            load_checkpoint(ck, dtype=bad)
    with pytest.raises(TypeError, match=r"^dtype must be a torch dtype or its name, not int \(16\)$"):
        load_checkpoint(ck, dtype=16)


def test_a_device_that_cannot_hold_the_model_is_one_line(run, tmp_path):
    """load_checkpoint(device=...) passed the name straight to torch: "cuda" on a CPU-only torch was an
    AssertionError, a misspelt name torch's list of 20 device types, "meta" a model without weights (after
    40 warnings). Each is now the line Translator.load says, before any reading."""
    ck = run / "checkpoints" / "step_000003"
    with pytest.raises(UserError, match=r"^device 'bogus' is not a device name: cpu, cuda, cuda:1, \.\.\.$"):
        load_checkpoint(ck, device="bogus")
    for where in (ck, tmp_path / "nowhere"):  # the device first: not "checkpoint not found"
        with pytest.raises(UserError, match=r"^device 'meta': aiayn runs models on cpu or cuda only$"):
            load_checkpoint(where, device="meta")
    beyond = f"cuda:{torch.cuda.device_count()}"  # one past the last; cuda:0 on a machine without CUDA
    refused = rf"^device '{beyond}': (no CUDA device is available|this machine has)"
    with pytest.raises(UserError, match=refused):
        load_checkpoint(ck, device=beyond)
    assert load_checkpoint(ck, device=torch.device("cpu")).model.generator.weight.device.type == "cpu"


def test_a_checkpoint_that_cannot_be_pruned_is_a_warning(run, monkeypatch, caplog):
    """Pruning runs right after a save that holds everything: a failed rename (a full disk's directory
    block, EIO) ended a healthy run with a traceback."""
    from aiayn.train import state

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state.os, "rename", full)
    with caplog.at_level(logging.WARNING):
        state.prune(run, keep_last=1)
    assert [p.name for p in state.checkpoint_dirs(run)] == ["step_000001", "step_000002", "step_000003"]
    assert f"{run / 'checkpoints' / 'step_000001'}: could not delete this old checkpoint (No space left on " \
           "device); training goes on" in caplog.text


@pytest.mark.parametrize("out", ["run", "run/checkpoints", "run/checkpoints/step_000003",
                                 "run/checkpoints/step_000001", "run/checkpoints/new", "."])
def test_average_never_writes_over_the_run(run, out, monkeypatch, capsys):
    monkeypatch.chdir(run.parent)
    before = tree(run)
    assert main(["average", "run", "--last", "2", "-o", out, "--force"]) == 2
    assert tree(run) == before
    said = {"run": "run: is the input run; writing it would delete the input",  # the run, not "other files"
            ".": ".: names no directory of its own (the current one or a parent); give the output a new name"}
    if out in said:
        assert capsys.readouterr().err == f"aiayn: error: {said[out]}\n"


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/avg"])
def test_average_never_writes_into_its_own_runs_checkpoints(run, where):
    """Training resumes from and prunes what its checkpoints/ holds: an average there is refused, with or
    without --force, before any checkpoint is listed."""
    before = tree(run / "checkpoints")
    relation = "is" if where == "checkpoints" else "lies inside"
    said = f"{run / where}: {relation} {run / 'checkpoints'}, which training owns (it resumes from and prunes"
    for force in (False, True):
        with pytest.raises(UserError, match=re.escape(said)):
            average_last(run, 2, run / where, force=force)
    assert tree(run / "checkpoints") == before


def test_average_never_writes_inside_another_checkpoint(run, tmp_path, capsys):
    """Another run's checkpoint: its keep_last deletes the directory whole, the average with it."""
    other = tmp_path / "other" / "checkpoints" / "step_000009"
    shutil.copytree(run / "checkpoints" / "step_000001", other)
    before = tree(other)
    assert main(["average", str(run), "--last", "2", "-o", str(other / "avg")]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {other / 'avg'}: lies inside the checkpoint {other}; " \
                                      "write it elsewhere\n"
    assert tree(other) == before
    with pytest.raises(UserError, match="lies inside the checkpoint"):  # from Python too (the CLI alone was)
        average_last(run, 2, other / "avg")
    assert tree(other) == before
    assert main(["average", str(run), "--last", "2", "-o", str(tmp_path / "avg")]) == 0  # replaced with --force:
    assert main(["average", str(run), "--last", "2", "-o", str(tmp_path / "avg"), "--force"]) == 0  # is one
    (other / "avg").mkdir()  # there already: said as such, not "already exists (pass --force ...)"
    with pytest.raises(UserError, match="lies inside the checkpoint"):
        average_last(run, 2, other / "avg")


def test_existing_outputs_need_force_and_must_be_directories(run, tmp_path, capsys):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("mine")
    for out in ("precious", "afile"):
        capsys.readouterr()
        assert main(["average", str(run), "-o", str(tmp_path / out)]) == 2
        assert capsys.readouterr().err.splitlines() == [  # no "pass --force", which would not replace it
            f"aiayn: error: {tmp_path / out}: "
            + ("holds files that are not an aiayn checkpoint; will not replace it, even with --force (delete "
               "it first if it should go)" if out == "precious" else
               "exists and is not a directory; will not replace it")]
    assert main(["average", str(run), "-o", str(tmp_path / "afile"), "--force"]) == 2
    # --force replaces an earlier checkpoint or an empty directory, never other files (a whole training
    # run, a live one too, went that way; and "$PWD" --force took the user's files with it)
    capsys.readouterr()
    other_run = tmp_path / "run2"  # another training run
    (other_run / "checkpoints").mkdir(parents=True)
    (other_run / "metrics.jsonl").write_text("")
    for out in (tmp_path / "precious", other_run):
        assert main(["average", str(run), "-o", str(out), "--force"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"aiayn: error: {out}: holds files that are not an aiayn checkpoint; will not replace it, even "
            "with --force (delete it first if it should go)"]
    assert (other_run / "metrics.jsonl").exists()
    assert (tmp_path / "precious" / "notes.txt").read_text() == (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    for out in ("empty", "empty"):  # an empty directory, then the checkpoint written there the first time
        assert main(["average", str(run), "-o", str(tmp_path / out), "--force"]) == 0
        assert load_checkpoint(tmp_path / out).meta["step"] == 3
    (tmp_path / "empty" / "trainer.json").write_text("{}")  # a copied training checkpoint is one too:
    assert main(["average", str(run), "-o", str(tmp_path / "empty"), "--force"]) == 0  # save_checkpoint's
    assert not (tmp_path / "empty" / "trainer.json").exists()  # refusal of a resave in place refused it
    # a checkpoint with the user's files beside it: --force deleted them with the checkpoint it replaced
    for name in ("NOTES.txt", "eval", "b", "c"):
        (tmp_path / "empty" / name).write_text("mine")
        capsys.readouterr()
        assert main(["average", str(run), "-o", str(tmp_path / "empty"), "--force"]) == 2
        named = "NOTES.txt, b, c and 1 more" if name == "c" else "NOTES.txt" if name == "NOTES.txt" else None
        if named:
            assert capsys.readouterr().err.splitlines() == [(
                f"aiayn: error: {tmp_path / 'empty'}: holds {named} beside an aiayn checkpoint; --force "
                "replaces the whole directory, so move them out first")]
    assert (tmp_path / "empty" / "NOTES.txt").read_text() == "mine"
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    cwd = os.getcwd()
    try:
        os.chdir(here)  # the current directory by its full name: "." was refused, this was not
        assert main(["average", str(run), "-o", str(here), "--force"]) == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.endswith(f"{here}: is the current directory; will not replace it")
    finally:
        os.chdir(cwd)
    assert (here / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("force", [False, True])
def test_files_that_come_into_the_output_while_averaging_are_kept(run, tmp_path, monkeypatch, force):
    """Checked before the work and again at the write: a fix that skipped the second check replaced the
    notes a user put into the new folder while the weights were averaged (refused as any existing
    output: without force too, as one that force would not replace either, where "pass --force" misled)."""
    from aiayn.train import average

    out, real = tmp_path / "avg", average.mean_weights

    def slow_mean(paths):
        out.mkdir()
        (out / "NOTES.txt").write_text("mine")
        return real(paths)

    monkeypatch.setattr(average, "mean_weights", slow_mean)
    with pytest.raises(UserError, match="holds files that are not an aiayn checkpoint"):
        average.average_checkpoints(sorted((run / "checkpoints").iterdir()), out, force)
    assert (out / "NOTES.txt").read_text() == "mine"


@pytest.mark.parametrize("force", [False, True])
def test_an_output_that_comes_while_averaging_is_replaced_only_with_force(run, tmp_path, monkeypatch, capsys,
                                                                          force):
    """Two `average -o OUT` at once both said they had averaged, and OUT held the second's: without --force
    only the check before the work refused an existing OUT, save_checkpoint's at the write let any
    checkpoint go. Here another checkpoint lands in OUT as the first checkpoint is read."""
    from aiayn.train import average

    out, real = tmp_path / "avg", average.load_weights

    def load_weights(path):
        if not out.exists():
            shutil.copytree(run / "checkpoints" / "step_000001", out)
        return real(path)

    monkeypatch.setattr(average, "load_weights", load_weights)
    assert main(["average", str(run), "--last", "2", "-o", str(out), *["--force"] * force]) == 2 * (not force)
    err = capsys.readouterr().err.splitlines()
    if force:
        assert load_checkpoint(out).meta["averaged"][-1].endswith("step_000003")
    else:
        assert err == [f"aiayn: error: {out}: already exists (pass --force, force=True in Python, to replace it)"]
        assert load_checkpoint(out).meta == load_checkpoint(run / "checkpoints" / "step_000001").meta
        assert sorted(os.listdir(tmp_path)) == ["avg", "run"]


def test_save_without_exist_ok_refuses_a_checkpoint_that_lands_during_the_write(run, tmp_path, monkeypatch):
    """exist_ok=False holds at the rename too, not only in the look before the work: a checkpoint that
    another writer puts at OUT while this one writes its weights stays, and this one is refused."""
    from aiayn import checkpoint

    out, real = tmp_path / "out", checkpoint.save_file
    theirs = run / "checkpoints" / "step_000001"

    def save_file(tensors, path, *args, **kwargs):
        if not out.exists():
            shutil.copytree(theirs, out)
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    ck = load_checkpoint(run / "checkpoints" / "step_000003")
    with pytest.raises(UserError, match=re.escape(f"{out}: already exists (pass --force")):
        save_checkpoint(out, ck.model, ck.tokenizer, {"step": 3}, exist_ok=False)
    assert load_checkpoint(out).meta == load_checkpoint(theirs).meta
    assert sorted(os.listdir(tmp_path)) == ["out", "run"]


def test_a_checkpoints_files_are_on_disk_before_its_name(run, tmp_path, monkeypatch):
    """Every file of a checkpoint is flushed before the rename that makes the checkpoint visible, and the
    parent directory after it: a power loss cannot leave the name on empty or partial files (as
    test_tokenizer's spm.model test for one file)."""
    ck = load_checkpoint(run / "checkpoints" / "step_000003")
    events = record_disk_events(monkeypatch)
    out = save_checkpoint(tmp_path / "ck", ck.model, ck.tokenizer, {"step": 3})
    renames = [e for e in events if e[0] == "rename" and e[2] == out]
    assert len(renames) == 1
    at, tmp = events.index(renames[0]), renames[0][1]
    flushed = {e[1] for e in events[:at] if e[0] == "fsync"}
    assert {tmp / name for name in os.listdir(out)} <= flushed
    assert {"meta.json", "model.safetensors", "spm.model"} <= set(os.listdir(out))
    assert ("fsync", tmp_path) in events[at:]


def test_default_output_replaces_an_earlier_average_only(run, tokenizer):
    first = average_last(run, 10)
    assert first == run / "average_last_3"  # named after what it holds: there are only 3
    assert load_checkpoint(first).meta["averaged"][-1].endswith("step_000003")
    save_checkpoint(run / "checkpoints" / "step_000004", tiny_model(vocab_size=tokenizer.src_vocab_size),
                    tokenizer, {"step": 4})
    assert average_last(run, 3) == first  # more training, then averaging again: the old average goes
    assert load_checkpoint(first).meta["averaged"][-1].endswith("step_000004")
    (first / "NOTES.txt").write_text("mine")  # no --force was given: "--force replaces the whole directory"
    with pytest.raises(UserError, match=r"^\S+average_last_3: holds NOTES.txt beside an aiayn checkpoint; "
                                        "replacing it would delete them, so move them out first$"):
        average_last(run, 3)
    assert (first / "NOTES.txt").read_text() == "mine"
    (run / "average_last_2").mkdir()  # not an average: somebody's directory
    with pytest.raises(UserError, match="average_last_2: already exists"):
        average_last(run, 2)
    for k in (0, -1, 2.0):  # found[-0:] averaged every checkpoint, found[-1:] dropped the first ones
        with pytest.raises(UserError, match=f"average the last {k!r} checkpoints: give a whole number >= 1"):
            average_last(run, k)


def test_two_default_averages_at_once_replace_as_a_rerun_would(run, monkeypatch):
    """Two `aiayn average RUN --last 3` at once: the one finishing second said "already exists (pass
    --force...)", though a rerun without --force replaces the other's average, as the default output does.
    Here the other average lands as this one reads its checkpoints, then as this one writes."""
    from aiayn.train import average

    real_mean, real_save = average.mean_weights, average.save_checkpoint
    target = run / "average_last_3"

    def other_first(paths):
        if not target.exists():
            monkeypatch.setattr(average, "mean_weights", real_mean)
            average_last(run, 3)
        return real_mean(paths)

    monkeypatch.setattr(average, "mean_weights", other_first)
    assert average_last(run, 3) == target and "averaged" in load_checkpoint(target).meta

    def other_at_the_write(out, *args, **kwargs):
        real_save(out, *args, **{**kwargs, "exist_ok": True})  # the other's, at the same moment
        return real_save(out, *args, **kwargs)

    shutil.rmtree(target)
    monkeypatch.setattr(average, "save_checkpoint", other_at_the_write)
    with pytest.raises(UserError, match=rf"^{re.escape(str(target))}: another average was written there "
                                        "meanwhile; run again$"):
        average_last(run, 3)
    shutil.rmtree(target)
    monkeypatch.setattr(average, "save_checkpoint", real_save)
    monkeypatch.setattr(average, "mean_weights", lambda paths: target.mkdir() or real_mean(paths))
    with pytest.raises(UserError, match=r"average_last_3: already exists \(pass --force"):
        average_last(run, 3)  # somebody's directory, not an average: still refused
    assert os.listdir(target) == []


def test_average_checks_shapes_not_only_meta(run, tokenizer):
    wider = tiny_model(vocab_size=tokenizer.src_vocab_size, d_ff=128)  # meta.json still says d_ff=64
    save_file(aiayn.checkpoint.state_dict_for_saving(wider), str(run / "checkpoints" / "step_000002" /
                                                                   "model.safetensors"))
    said = (r"step_000002/model\.safetensors: weights do not fit this model: "
            r"wrong shape \['\S+w_1.weight \(128, 32\) vs \(64, 32\)")
    with pytest.raises(UserError, match=said):
        average_last(run, 2, run.parent / "avg")
    assert not (run.parent / "avg").exists()


def test_failed_average_reports_no_success(run, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise FULL_DISK[1]

    monkeypatch.setattr(aiayn.checkpoint, "save_file", full)
    with caplog.at_level(logging.INFO), pytest.raises(UserError, match="avg: could not write checkpoint"):
        average_last(run, 2, run.parent / "avg")
    assert "averaged" not in caplog.text and not (run.parent / "avg").exists()


def test_convert_never_writes_over_its_source(tmp_path, capsys):
    """The check comes before any reading: an empty SOURCE directory is enough."""
    (tmp_path / "opus").mkdir()
    (tmp_path / "opus" / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "afile").write_text("mine")
    for out, problem in (("opus", "is the input"), (".", "contains the input"), ("out", "already exists"),
                         ("afile/x", f"{tmp_path / 'afile'} is not a directory")):  # was a traceback, late
        capsys.readouterr()
        force = ["--force"] if out != "out" else []
        assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(tmp_path / out), *force]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"{tmp_path / out}: {problem}" in err[0]
    assert tree(tmp_path) == {"opus/config.json": b"{}", "afile": b"mine"}


def test_a_tokenizer_saves_after_its_files_are_gone(tmp_path, tokenizer):
    """A resumed fine-tuning run takes its tokenizer from its newest checkpoint, which keep_last later
    deletes: the next save copied from there and failed ("could not write checkpoint"). A tokenizer
    writes its models from memory, byte for byte the files it was loaded from."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    first = save_checkpoint(tmp_path / "step_1", model, tokenizer)
    loaded = load_checkpoint(first).tokenizer
    original = (first / "spm.model").read_bytes()
    shutil.rmtree(first)
    second = save_checkpoint(tmp_path / "step_2", model, loaded)
    assert (second / "spm.model").read_bytes() == original
    assert load_checkpoint(second).tokenizer.same_as(tokenizer)


def test_a_symlink_loop_is_one_line_where_a_path_is_read_or_written(run, tmp_path, capsys):
    """Path.resolve() raises RuntimeError for a loop before Python 3.13: a traceback from every command
    that checked its output against its inputs."""
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    (tmp_path / "in.txt").write_text("hello\n")
    ck = run / "checkpoints" / "step_000003"
    for args in (["average", str(run), "--last", "2", "-o", str(loop)],
                 ["average", str(run), "--last", "2", "-o", str(loop / "x")],
                 ["translate", str(ck), "-i", str(tmp_path / "in.txt"), "-o", str(loop), "-q"]):
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].endswith(": too many levels of symbolic links"), (args, err)
    with pytest.raises(UserError, match="loop: too many levels of symbolic links"), \
            aiayn.files.atomic_output(loop) as f:
        f.write("x")
    assert loop.is_symlink()  # not replaced by a file


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["tokenizer"]["specials"].update(eos=None), r"special id 'eos' is None, not an integer"),
    (lambda m: m["tokenizer"]["specials"].update(pad="0"), r"special id 'pad' is '0', not an integer"),
])
def test_special_ids_of_the_wrong_type_are_a_malformed_tokenizer(run, edit, message):
    """A null eos failed in check_vocabulary's comparison, as a TypeError traceback."""
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    edit(meta)
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r'meta\.json: malformed "tokenizer" entry \(ValueError: ' + message):
        load_checkpoint(ck)


def test_metadata_nested_past_the_stack_is_corrupt_not_a_recursion_error(run):
    ck = run / "checkpoints" / "step_000003"
    (ck / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match=r"meta\.json: corrupt checkpoint metadata \(maximum recursion depth"):
        load_checkpoint(ck)


def test_a_number_of_more_digits_than_python_reads_is_corrupt_metadata(run, tmp_path):
    """A 5,001-digit integer is valid JSON, which int() refuses with a plain ValueError: a traceback from
    info, translate, average and a resume alike (metrics.jsonl and trainer.json were already caught)."""
    from aiayn.interop.marian import read_json

    ck = run / "checkpoints" / "step_000003"
    text = (ck / "meta.json").read_text()
    (ck / "meta.json").write_text(text.replace('"step": 3', '"step": ' + "9" * 5001, 1))
    with pytest.raises(UserError, match=r"meta\.json: corrupt checkpoint metadata \(Exceeds the limit"):
        load_checkpoint(ck)
    (tmp_path / "config.json").write_text('{"d_model": ' + "1" * 5001 + "}")
    with pytest.raises(UserError, match=r"config\.json: not valid JSON \(Exceeds the limit"):
        read_json(tmp_path / "config.json")


def test_metadata_with_a_lone_surrogate_is_saved_as_it_was_read(tmp_path, tokenizer):
    """`"\\udcff"` is valid JSON, read as a lone surrogate, which UTF-8 cannot encode: `aiayn average` over a
    meta.json holding one (a hand's edit, a path of another encoding) stopped with a UnicodeEncodeError."""
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    meta = {"step": 1, "note": "/data/x\udcff.de", "de": "Straße"}
    save_checkpoint(tmp_path / "ck", model, tokenizer, meta)
    meta = load_checkpoint(tmp_path / "ck").meta
    assert meta["note"] == "/data/x\udcff.de" and meta["de"] == "Straße"


def test_an_unreadable_meta_json_is_one_line(run, monkeypatch, capsys):
    """EACCES (for a user other than root) or EIO reading meta.json was a PermissionError traceback."""
    ck = run / "checkpoints" / "step_000003"
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self.name == "meta.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    message = rf"^{re.escape(str(ck / 'meta.json'))}: cannot read \(Permission denied\)$"
    with pytest.raises(UserError, match=message):
        load_checkpoint(ck)
    assert main(["translate", str(ck)]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {ck / 'meta.json'}: cannot read (Permission denied)\n"


def test_average_lists_again_when_training_prunes_a_checkpoint_it_reads(run, monkeypatch):
    """A run training in run_dir prunes old checkpoints after each save: `average` read a listed one
    after it was gone and failed with 'checkpoint has no model.safetensors'."""
    from aiayn.train import average

    real, calls = average.average_checkpoints, []

    def pruned_first(paths, out, force=False, **kwargs):  # training prunes the oldest as the first try reads
        calls.append([p.name for p in paths])
        if len(calls) == 1:
            shutil.rmtree(paths[0])
        return real(paths, out, force, **kwargs)

    monkeypatch.setattr(average, "average_checkpoints", pruned_first)
    assert average_last(run, 3, run.parent / "avg") == run.parent / "avg"
    assert calls == [["step_000001", "step_000002", "step_000003"], ["step_000002", "step_000003"]]
    assert len(load_checkpoint(run.parent / "avg").meta["averaged"]) == 2

    def always_pruned(paths, out, force=False, **kwargs):
        shutil.rmtree(paths[0])
        return real(paths, out, force, **kwargs)

    for step in (4, 5, 6, 7):  # enough checkpoints for every try to lose one
        shutil.copytree(run / "checkpoints" / "step_000003", run / "checkpoints" / f"step_{step:06d}")
    monkeypatch.setattr(average, "average_checkpoints", always_pruned)
    with pytest.raises(UserError, match=r"pruned the last 2 checkpoints while they were read, 4 times; average "
                                        r"after it stops, or raise its train\.keep_last"):
        average_last(run, 2, run.parent / "avg2")
    assert not (run.parent / "avg2").exists()
    monkeypatch.setattr(average, "average_checkpoints", real)
    (run / "checkpoints" / "step_000007" / "model.safetensors").unlink()  # damaged, not pruned: no retry
    with pytest.raises(UserError, match=r"step_000007: checkpoint has no model\.safetensors"):
        average_last(run, 2, run.parent / "avg3")


@pytest.mark.parametrize("model", ["micro", None, [1, 2]])
def test_a_model_entry_that_is_no_table_is_corrupt_metadata(run, model):
    """A string was read as its characters: 'unknown ModelConfig key(s): c, i, m, o, r'."""
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    meta["model"] = model
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"meta\.json: corrupt checkpoint metadata \('model' is not a table\)"):
        load_checkpoint(ck)


@pytest.mark.parametrize("format_, message", [
    ("aiayn-2", (r"written by a newer aiayn \(format 'aiayn-2'; this one reads aiayn-1\); upgrade aiayn "
                 r"to read it$")),
    ("aiayn-0", r"not an aiayn-1 checkpoint \(format='aiayn-0'\)$"),
    ("fairseq", r"not an aiayn-1 checkpoint \(format='fairseq'\)$")])
def test_a_checkpoint_of_a_newer_format_says_to_upgrade(run, format_, message):
    """format "aiayn-2" was "not an aiayn-1 checkpoint", as if it were no aiayn checkpoint at all."""
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    (ck / "meta.json").write_text(json.dumps({**meta, "format": format_}))
    with pytest.raises(UserError, match=rf"^{re.escape(str(ck / 'meta.json'))}: {message}"):
        load_checkpoint(ck)


@pytest.mark.parametrize("ids, example", [(lambda i: 2 * i, "e.g. 1, 3, 5"),  # up to 118: past the embeddings
                                          (lambda i: i + (i >= 5), "e.g. 5, 60"),  # a gap
                                          (lambda i: min(i, 58), "e.g. 59")])  # an id twice
def test_a_vocabulary_whose_ids_are_not_0_to_n_is_corrupt(run, tokenizer, ids, example):
    """Ids past the embeddings were an IndexError traceback in the lookup; a gap, a KeyError in decoding."""
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    meta["tokenizer"]["vocab"] = {tokenizer.src.id_to_piece(i): ids(i) for i in range(tokenizer.src_vocab_size)}
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=rf"meta\.json: the source vocabulary's ids are not 0 to 59, each once "
                                        rf"\({example}"):
        load_checkpoint(ck)


def test_a_vocabulary_of_fewer_pieces_than_the_embeddings_is_refused(run, tokenizer):
    """A vocabulary cut by hand (ids 0..9 of 60 rows) passed every check: translate then decoded an id
    without a piece (a KeyError traceback) and score printed garbage. convert keeps exactly the model's
    ids."""
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    meta["tokenizer"]["vocab"] = {tokenizer.src.id_to_piece(i): i for i in range(10)}
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"the source tokenizer has 10 pieces but the model 60 embeddings: "
                                        r"not the tokenizer this model was trained with"):
        load_checkpoint(ck)


def test_a_model_in_meta_json_that_the_weights_do_not_fit_is_named_before_memory_is_asked(run, monkeypatch):
    """A damaged d_ff of 16,777,216 asked for a terabyte before the weights were looked at: a RuntimeError
    traceback. The weights' shapes are compared with meta.json's model on the meta device first."""
    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    meta["model"]["d_ff"] = 16_777_216
    (ck / "meta.json").write_text(json.dumps(meta))

    def no_memory(*args, **kwargs):
        raise AssertionError("memory asked for a model the weights do not fit")

    monkeypatch.setattr(torch.nn.Module, "to_empty", no_memory)
    with pytest.raises(UserError, match=r"model\.safetensors: weights do not fit this model: wrong shape"):
        load_checkpoint(ck)


def test_a_vocab_size_in_meta_json_that_neither_weights_nor_tokenizer_have_is_blamed_on_meta_json(run, capsys):
    """The weights and spm.model agree, meta.json is the odd one: loading blamed the weights ("do not fit
    this model"), info the tokenizer ("a damaged file, or not the tokenizer this model was trained with")
    and average called it another model."""
    from aiayn.checkpoint import describe_checkpoint

    ck = run / "checkpoints" / "step_000003"
    meta = json.loads((ck / "meta.json").read_text())
    meta["model"]["vocab_size"] += 10
    (ck / "meta.json").write_text(json.dumps(meta))
    said = (rf"^{re.escape(str(ck / 'meta.json'))}: not the model its model\.safetensors holds \(wrong shape "
            r"\[.*\]\); damaged, or copied from another checkpoint$")
    for read in (load_checkpoint, describe_checkpoint, lambda ck: average_last(run, 3, run.parent / "avg")):
        with pytest.raises(CorruptFile, match=said):
            read(ck)
    assert main(["translate", str(ck), "-i", os.devnull]) == 2
    assert re.match(said.replace("^", "^aiayn: error: "), capsys.readouterr().err.strip())


def test_weights_behind_a_looping_or_dangling_link_are_named_as_such(tmp_path):
    """A link that leads nowhere (to itself, or to a deleted file) is not "missing": the message says what
    the user will find with ls."""
    from aiayn.checkpoint import load_weights

    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "model.safetensors").symlink_to("model.safetensors")  # points at itself
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "model.safetensors").symlink_to(tmp_path / "deleted.safetensors")
    for name in ("loop", "gone"):
        with pytest.raises(UserError, match=r"model\.safetensors is a link that leads to no file\)$"):
            load_weights(tmp_path / name)
    (tmp_path / "none").mkdir()
    with pytest.raises(UserError, match=r"model\.safetensors is missing\)$"):
        load_weights(tmp_path / "none")


def test_a_run_dir_inside_a_checkpoint_or_another_runs_checkpoints_is_refused(tmp_path):
    """Another run's keep_last deletes its checkpoints whole: a run_dir that was one of them (the one
    init_from read, say) or lay inside one lost this run's checkpoints with it. A folder merely called
    `checkpoints` that holds no run's checkpoints is an ordinary place."""
    from aiayn.train.loop import _check_run_dir

    step = tmp_path / "P" / "checkpoints" / "step_000020"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (step / "model.safetensors").write_bytes(b"")
    for run_dir, message in ((step, "is the checkpoint"), (step / "child", "lies inside the checkpoint"),
                             (step / ".." / "mine", "lies inside .*P/checkpoints, the checkpoints of the run"),
                             (tmp_path / "P" / "checkpoints", "is .*, the checkpoints of the run")):
        with pytest.raises(UserError, match=f"^{re.escape(str(run_dir))}: train.run_dir {message}"):
            _check_run_dir(run_dir)
    assert not (step / "child").exists() and not (step.parent / "mine").exists()  # refused before mkdir
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # mkdir said "File exists"
    with pytest.raises(UserError, match=r"dangling: train.run_dir is a link that leads to no directory"):
        _check_run_dir(tmp_path / "dangling")
    _check_run_dir(tmp_path / "checkpoints" / "run1")  # no run's checkpoints there: fine
    assert (tmp_path / "checkpoints" / "run1").is_dir()


def test_convert_and_export_refuse_a_runs_checkpoints_folder(tmp_path, capsys):
    """`convert ... run/checkpoints/step_000099` was accepted: the next --resume took it for the run's
    newest checkpoint, and keep_last deleted an export there."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (tmp_path / "opus").mkdir()
    (tmp_path / "opus" / "config.json").write_text("{}")
    out = run / "checkpoints" / "step_000099"
    assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith(f"{out}: lies inside {run / 'checkpoints'}, which training owns "
                                             "(it resumes from and prunes what is there); write it elsewhere")
    assert not out.exists()
    out.mkdir()  # existing: convert said "already exists (pass --force ...)" first, which --force cannot mend
    assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(out)]) == 2
    assert capsys.readouterr().err.endswith("which training owns (it resumes from and prunes what is there); "
                                            "write it elsewhere\n")


def test_a_link_to_a_runs_checkpoints_folder_is_that_folder(tmp_path, capsys):
    """`--out cpl/x`, cpl a link to run/checkpoints, was accepted (only the path as written was looked at)
    while `--out run/checkpoints/x` was refused."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (tmp_path / "cpl").symlink_to(run / "checkpoints")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert main(["plot", str(run), "-o", str(tmp_path / "cpl" / "c.png")]) == 2
    assert capsys.readouterr().err.endswith(f"lies inside {run / 'checkpoints'}, which training owns (it "
                                            "resumes from and prunes what is there); write it elsewhere\n")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000010"]


def test_averaging_past_keep_last_says_the_old_best_is_mixed_in(tmp_path, tokenizer, caplog):
    """keep_last=2 keeps step 5 (the best validation) beside 35 and 40: `--last 3` averaged 5, 35 and 40
    without a word, as if they were three consecutive checkpoints."""
    torch.manual_seed(0)
    for step in (5, 35, 40):
        save_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{step:06d}",
                        tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer,
                        {"step": step, "config": {"train": {"keep_last": 2}}})
    with caplog.at_level(logging.WARNING):
        average_last(tmp_path / "run", 3)
    assert ("step_000005: kept beyond train.keep_last=2 (the run's best validation, or an earlier "
            "keep_last), averaged with step_000035 to step_000040") in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        average_last(tmp_path / "run", 2, tmp_path / "avg2")  # within the window: nothing to say
    assert not caplog.messages


def test_average_of_a_file_or_a_missing_directory_says_so(tmp_path):
    """Both were "no checkpoints found", as if they were runs that had saved none."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"afile: is not a directory$"):
        average_last(tmp_path / "afile", 2)
    with pytest.raises(UserError, match=r"nowhere: no such run directory$"):
        average_last(tmp_path / "nowhere", 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: no checkpoints found$"):
        average_last(tmp_path / "empty", 2)
