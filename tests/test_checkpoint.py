"""Checkpoints round-trip exactly, tie weights once, and reject what is not theirs with one clear line."""

import json

import pytest
import torch

from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.errors import UserError
from conftest import padded_batch, tiny_model


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


def test_errors_name_the_file(tmp_path, tokenizer):
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    with pytest.raises(UserError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(UserError, match="model.safetensors: corrupt weights"):
        load_checkpoint(tmp_path / "ck")
    save_checkpoint(tmp_path / "ck", model, tokenizer)  # replacing an existing one
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    meta["model"]["d_model"] = 64
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="do not fit this model: .*wrong shape"):
        load_checkpoint(tmp_path / "ck")
    meta["model"]["d_modle"] = 1
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="d_modle"):
        load_checkpoint(tmp_path / "ck")
