"""MarianMT import: an aiayn model converted from a MarianMT directory computes what `MarianMTModel` does.

The Marian models are built here, offline, with `transformers` and random weights (no hub access), laid
out like a real OPUS-MT directory: config.json, model.safetensors (or pytorch_model.bin), source.spm,
target.spm, vocab.json (and target_vocab.json), tokenizer_config.json.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.checkpoint import load_checkpoint
from aiayn.data.tokenizer import train_sentencepiece
from aiayn.decoding import DecodeConfig, generate
from aiayn.errors import UserError
from aiayn.interop.marian import convert_marian, model_config_from_marian

transformers = pytest.importorskip("transformers")

SRC_LINES = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'} and {i % 7} is small" for i in range(200)]
TGT_LINES = [f"die Zahl {i} ist {'gerade' if i % 2 == 0 else 'ungerade'} und {i % 7} ist klein" for i in range(200)]
SENTENCES = ["the number 12 is even", "7 is odd and small", "the number 3"]


def marian_vocab(pieces: list[str], pad_last: bool) -> dict[str, int]:
    """OPUS-MT's layout: </s>=0, <unk>=1, the pieces, <pad> last (or third, see `make_marian_dir`)."""
    specials = ["</s>", "<unk>"] if pad_last else ["</s>", "<unk>", "<pad>"]
    tokens = specials + pieces + (["<pad>"] if pad_last else [])
    return {t: i for i, t in enumerate(tokens)}


def spm_pieces(path: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    return [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]  # without spm's own specials


@torch.no_grad()
def randomize(model) -> None:
    """Make every tensor matter: LayerNorms, biases and the logits bias are 1 and 0 after init."""
    for name, p in model.named_parameters():
        if "embed_positions" in name:  # a frozen sinusoid table, not a weight
            continue
        p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3 if p.dim() == 1 else 0.15)
    model.final_logits_bias.normal_(0.0, 1.0)


def make_marian_dir(directory: Path, activation: str, shared: bool, bin_weights: bool = False,
                    tied: bool = True):
    """A tiny random MarianMTModel saved as an OPUS-MT directory; returns the HF model (eval mode).

    Shared: one vocabulary with <pad> last, as OPUS-MT. Separate: two vocabularies of different sizes
    (transformers needs the pad id inside both, so <pad> is id 2 in each). Not `tied`:
    tie_word_embeddings=false, an output projection of its own (and with transformers 5, encoder and
    decoder embeddings of their own over a shared vocabulary).
    """
    directory.mkdir(parents=True)
    src_spm = train_sentencepiece(SRC_LINES + ([] if not shared else TGT_LINES), directory / "s", 60)
    tgt_spm = src_spm if shared else train_sentencepiece(TGT_LINES, directory / "t", 48)
    shutil.copyfile(src_spm, directory / "source.spm")
    shutil.copyfile(tgt_spm, directory / "target.spm")
    vocab = marian_vocab(spm_pieces(src_spm) + [">>de<<"], pad_last=shared)  # a multilingual model's code
    (directory / "vocab.json").write_text(json.dumps(vocab))
    settings = {"separate_vocabs": not shared, "tokenizer_class": "MarianTokenizer"}
    tgt_vocab = vocab
    if not shared:
        tgt_vocab = marian_vocab(spm_pieces(tgt_spm), pad_last=False)
        (directory / "target_vocab.json").write_text(json.dumps(tgt_vocab))
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), decoder_vocab_size=len(tgt_vocab), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function=activation, pad_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        decoder_start_token_id=pad, max_position_embeddings=128, scale_embedding=True,
        share_encoder_decoder_embeddings=shared, tie_word_embeddings=tied,
    )
    torch.manual_seed(1 if shared else 2)
    model = transformers.MarianMTModel(config).eval()
    randomize(model)
    with torch.no_grad():  # a likelier EOS, so that searches end at different lengths, not all at the limit
        model.final_logits_bias[0, config.eos_token_id] += 2.3
    model.save_pretrained(directory)
    if bin_weights:  # the older layout: a pickled state dict of plain tensors
        (directory / "model.safetensors").unlink()
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return model


VARIANTS = [("swish", True), ("relu", False), ("swish", False), ("relu", True)]


IDS = [f"{a}-{'shared' if s else 'separate'}" for a, s in VARIANTS]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """variant -> (MarianMTModel, converted aiayn checkpoint, the OPUS-MT-like directory), built once."""
    built = {}

    def get(variant):
        if variant not in built:
            activation, shared = variant
            root = tmp_path_factory.mktemp("marian")
            hf = make_marian_dir(root / "opus", activation, shared, bin_weights=(activation == "relu" and shared))
            convert_marian(root / "opus", root / "aiayn")
            built[variant] = hf, load_checkpoint(root / "aiayn"), root / "opus"
        return built[variant]

    return get


@pytest.fixture(scope="module", params=VARIANTS, ids=IDS)
def converted(request, build):
    return build(request.param)


# Searches with transformers' `generate` are the slow part: two variants by default, all with -m slow.
SEARCH_VARIANTS = [pytest.param(v, id=i, marks=[] if v in VARIANTS[:2] else [pytest.mark.slow])
                   for v, i in zip(VARIANTS, IDS)]


def source_batch(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = [tokenizer.encode_src(t) for t in texts]
    out = torch.full((len(ids), max(map(len, ids))), tokenizer.pad_id)  # (B, S) right-padded
    for i, row in enumerate(ids):
        out[i, : len(row)] = torch.tensor(row)
    return out


def test_config_is_marians(converted):
    hf, ck, _ = converted
    c, h = ck.model.config, hf.config
    assert (c.activation == "silu") == (h.activation_function == "swish")
    assert c.positions == "sin_cos" and c.final_logits_bias and c.scale_embedding
    assert c.decoder_start_id == c.pad_id == h.pad_token_id and c.eos_id == h.eos_token_id
    assert c.share_embeddings == h.share_encoder_decoder_embeddings
    assert c.target_vocab_size == hf.lm_head.weight.shape[0]


def test_info_describes_the_converted_checkpoint(build, capsys):
    """`aiayn info` of a converted checkpoint: HF's parameter count (its tied, shared embeddings counted
    once, the frozen position table and the final_logits_bias buffer not at all), both vocabularies, and
    the OPUS-MT directory it came from."""
    from aiayn.cli import main

    hf, ckpt, opus = build(("relu", False))  # separate vocabularies
    assert main(["info", str(ckpt.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    counted = sum(p.numel() for name, p in hf.named_parameters() if "embed_positions" not in name)
    assert lines[2].startswith(f"parameters: {counted:,} (float32; model.safetensors ")
    sizes = ckpt.tokenizer.src_vocab_size, ckpt.tokenizer.tgt_vocab_size
    assert lines[3] == (f"tokenizer: SentencePiece (source.spm, target.spm), {sizes[0]:,} source and "
                        f"{sizes[1]:,} target pieces") and sizes[0] != sizes[1]
    assert lines[-1] == f"converted from: marian {opus.resolve()}"


def test_positions_are_marians_table(converted):
    hf, ck, _ = converted
    theirs = hf.model.encoder.embed_positions.weight  # MarianSinusoidalPositionalEmbedding.create_weight
    assert torch.allclose(ck.model.src_embed.pe[: theirs.shape[0]], theirs, atol=1e-6, rtol=0)


def test_tokenization_matches_marian_tokenizer(converted):
    _, ck, opus = converted
    theirs = transformers.MarianTokenizer.from_pretrained(str(opus))
    for text in SENTENCES + [">>de<< the number 12", ">>xx<< 7 is odd"]:  # a language code, an unknown one
        assert ck.tokenizer.encode_src(text) == theirs(text)["input_ids"]
    target = "die Zahl 12 ist gerade" if not ck.tokenizer.shared else "the number 12 is even"
    ids = theirs(text_target=target)["input_ids"]  # target side: target.spm and the target vocabulary
    assert ck.tokenizer.encode_tgt(target) + [ck.tokenizer.eos_id] == ids
    assert ck.tokenizer.decode_tgt(ids) == theirs.decode(ids, skip_special_tokens=True) == target
    # The README's one difference: a "</s>" written in a source is text here, the special token there
    eos = ck.tokenizer.eos_id
    text = "the number </s> 12"
    assert ck.tokenizer.encode_src(text).count(eos) == 1 < theirs(text)["input_ids"].count(eos)
    # A decoder that starts from an ordinary piece (decoder_start_token_id=5): the converted tokenizer's
    # bos_id is that piece, and decoding dropped it everywhere in the text
    ordinary = copy.copy(ck.tokenizer)
    ordinary.bos_id = ids[0]
    twice = ids[:-1] + ids  # the first piece, a start piece here, also inside the text
    assert ordinary.decode_tgt(twice) == theirs.decode(twice, skip_special_tokens=True)


def test_source_pieces_are_one_per_id_like_marian_tokenizer(converted):
    """Attention maps label each source id with its piece: a language code is one piece, as it is one id
    (an unknown code is one <unk>)."""
    from aiayn.attention import source_labels

    _, ck, opus = converted
    theirs = transformers.MarianTokenizer.from_pretrained(str(opus))
    piece = {i: p for p, i in json.loads((opus / "vocab.json").read_text()).items()}  # the source vocabulary
    for text in ["the number 12", ">>de<< the number 12", ">>xx<< 7 is odd"]:
        ids = theirs(text)["input_ids"]
        assert len(ck.tokenizer.src_pieces(text)) == len(ids)
        assert source_labels(ck.tokenizer, text, ids) == [piece[i] for i in ids]
    assert ck.tokenizer.src_pieces(">>de<< the number 12")[0] == ">>de<<"


@torch.no_grad()
def test_logits_match_marian_mt_model(converted):
    hf, ck, _ = converted
    src = source_batch(ck.tokenizer, SENTENCES)  # (B, S), padded with Marian's pad id
    gen = torch.Generator().manual_seed(0)
    tgt_in = torch.randint(3, ck.model.config.target_vocab_size, (src.shape[0], 9), generator=gen)  # (B, T)
    tgt_in[:, 0] = ck.model.config.decoder_start_id
    theirs = hf(input_ids=src, attention_mask=src.ne(ck.tokenizer.pad_id), decoder_input_ids=tgt_in).logits
    ours = ck.model(src, tgt_in)
    assert theirs.abs().max() > 1.0  # random weights large enough that the tolerance below means something
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_unsupported_fields_are_named(tmp_path):
    make_marian_dir(tmp_path / "opus", "swish", shared=True)
    config = json.loads((tmp_path / "opus" / "config.json").read_text())
    cases = {"normalize_embedding": True, "normalize_before": True, "static_position_embeddings": False,
             "activation_function": "gelu_new", "decoder_ffn_dim": 128, "eos_token_id": [0, 1]}
    for field, value in cases.items():
        (tmp_path / "opus" / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(UserError, match=field):
            convert_marian(tmp_path / "opus", tmp_path / "out")
    (tmp_path / "opus" / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "opus" / "model.safetensors"))
    weights["model.encoder.layernorm_embedding.weight"] = torch.ones(32)
    save_file(weights, str(tmp_path / "opus" / "model.safetensors"))
    with pytest.raises(UserError, match="layernorm_embedding"):
        convert_marian(tmp_path / "opus", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inconsistent_embeddings_and_a_misshapen_logits_bias_are_refused(tmp_path):
    """transformers keeps every stored embedding and ties the output to model.shared: a file whose
    encoder and decoder copies differ from it converted silently into another model (logits off by up
    to 5); a (2, V/2) final_logits_bias was flattened, where transformers refuses the file."""
    from safetensors.torch import load_file, save_file

    make_marian_dir(tmp_path / "opus", "swish", shared=True)
    path = tmp_path / "opus" / "model.safetensors"
    original = load_file(str(path))
    shared = original["model.shared.weight"]
    for side in ("encoder", "decoder"):
        weights = {**original, f"model.{side}.embed_tokens.weight": shared + 0.1}
        save_file(weights, str(path))
        with pytest.raises(UserError, match=rf"model\.{side}\.embed_tokens\.weight differs from "
                                            r"model\.shared\.weight"):
            convert_marian(tmp_path / "opus", tmp_path / "out")
    copies = {f"model.{side}.embed_tokens.weight": shared.clone() for side in ("encoder", "decoder")}
    save_file({**original, **copies}, str(path))  # the same values stored three times: fine
    convert_marian(tmp_path / "opus", tmp_path / "out")
    v = shared.shape[0]
    save_file({**original, "final_logits_bias": torch.zeros(2, v // 2)}, str(path))
    with pytest.raises(UserError, match=rf"final_logits_bias has shape \(2, {v // 2}\), not \(1, {v}\)"):
        convert_marian(tmp_path / "opus", tmp_path / "out2")


def test_an_untied_shared_vocabulary_saved_by_transformers_5_converts_as_it_reads(tmp_path):
    """transformers 5 with tie_word_embeddings=false embeds the encoder and decoder with their own stored
    copies over one vocabulary (model.shared.weight is read by nothing): such a file was refused as "two
    models". It is one model, converted with two embedding matrices and an output projection of its own,
    one tokenizer, and greedy decoding as `generate`'s."""
    from aiayn.translate import Translator

    hf = make_marian_dir(tmp_path / "opus", "swish", shared=True, tied=False)
    config = json.loads((tmp_path / "opus" / "config.json").read_text())
    assert config["transformers_version"].startswith("5.") and not config["tie_word_embeddings"]
    convert_marian(tmp_path / "opus", tmp_path / "aiayn")
    ck = load_checkpoint(tmp_path / "aiayn")
    c = ck.model.config
    assert (c.share_embeddings, c.tie_output, c.tgt_vocab_size) == (False, False, None)
    assert ck.tokenizer.tgt_vocab is ck.tokenizer.vocab  # vocab.json for both sides, as MarianTokenizer
    src = search_batch(ck)
    assert aiayn_search(ck, src, beam=1)[0] == hf_search(hf, src, ck.tokenizer.pad_id, num_beams=1)[0]
    theirs_tok = transformers.MarianTokenizer.from_pretrained(str(tmp_path / "opus"))
    out = hf.generate(**theirs_tok(SENTENCES, return_tensors="pt", padding=True), do_sample=False,
                      num_beams=1, max_new_tokens=MAX_NEW, bad_words_ids=[[ck.tokenizer.pad_id]])
    ours = Translator.load(ck.path).translate(SENTENCES, beam=1, max_len_a=0.0, max_len_b=MAX_NEW)
    assert ours == theirs_tok.batch_decode(out, skip_special_tokens=True) and any(ours)


@pytest.mark.parametrize("version", ["4.46.3", None])
def test_an_untied_shared_vocabulary_with_copies_that_differ_is_refused_before_transformers_5(
        tmp_path, capsys, version):
    """transformers 4 embeds both sides with model.shared.weight, 5 with each copy: a file that does not
    say transformers 5 saved it, whose copies differ, is refused, naming the config field to look at."""
    make_marian_dir(tmp_path / "opus", "swish", shared=True, tied=False)
    path = tmp_path / "opus" / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k != "transformers_version"}
    path.write_text(json.dumps({**config, **({"transformers_version": version} if version else {})}))
    assert convert_error(tmp_path / "opus", capsys) == (
        f"aiayn: error: {tmp_path / 'opus' / 'model.safetensors'}: model.encoder.embed_tokens.weight differs "
        "from model.shared.weight, which transformers 4 embeds with; transformers 5 "
        "(tie_word_embeddings=false) embeds with each copy, but config.json's transformers_version is not 5 "
        "or later (or is absent): if transformers 5 saved this file, set its transformers_version; else make "
        "the copies agree")


def test_an_untied_shared_vocabulary_missing_a_copy_is_refused(tmp_path, capsys):
    """transformers 5 initializes a missing copy at random: model.shared.weight does not stand in for it."""
    from safetensors.torch import load_file, save_file

    make_marian_dir(tmp_path / "opus", "swish", shared=True, tied=False)
    path = tmp_path / "opus" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(path)).items() if k != "model.decoder.embed_tokens.weight"},
              str(path))
    assert convert_error(tmp_path / "opus", capsys) == (
        f"aiayn: error: {path}: missing weight model.decoder.embed_tokens.weight, which transformers 5 "
        "embeds with (tie_word_embeddings=false; model.shared.weight is unused)")


@pytest.mark.parametrize("field, value, problem", [
    ("decoder_layers", 1, r"holds model\.decoder\.layers\.1\.\*, but config\.json's decoder_layers is 1"),
    ("d_model", 64, (r"model\.decoder\.layers\.0\.encoder_attn\.k_proj\.bias has shape \(32,\), not the "
                     r"\(64,\) of config\.json's d_model")),
    ("encoder_ffn_dim", 32, (r"model\.decoder\.layers\.0\.fc1\.bias has shape \(64,\), not the \(32,\) of "
                             r"config\.json's d_model and encoder_ffn_dim")),
])
def test_a_config_that_does_not_describe_the_weights_is_named(tmp_path, field, value, problem):
    """An edited config.json was blamed on the weights in aiayn's names ("src_embed.embed.weight (96, 32)
    vs (192, 64)", or "weights aiayn has no place for ... (a Marian variant it does not support)")."""
    make_marian_dir(tmp_path / "opus", "swish", shared=True)
    config = json.loads((tmp_path / "opus" / "config.json").read_text())
    config[field] = value
    if field == "encoder_ffn_dim":
        config["decoder_ffn_dim"] = value  # the two must agree
    (tmp_path / "opus" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=problem + r".*the config does not describe these weights$"):
        convert_marian(tmp_path / "opus", tmp_path / "out")


# A MarianConfig as config.json holds it, the fields the import reads (tiny, written by hand).
TINY_CONFIG = {"model_type": "marian", "architectures": ["MarianMTModel"], "vocab_size": 10, "d_model": 8,
               "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 16,
               "decoder_ffn_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0,
               "activation_function": "swish", "pad_token_id": 9, "eos_token_id": 0,
               "decoder_start_token_id": 9, "scale_embedding": True}


def test_config_fields_read_as_typed(tmp_path):
    """A complete config gives MarianConfig's values (ints as floats where a float is due, absent -> default)."""
    config = model_config_from_marian(TINY_CONFIG, "config.json")
    assert (config.d_model, config.n_heads, config.d_ff, config.n_layers, config.decoder_layers) == (8, 2, 16, 1, 1)
    assert config.dropout == 0.0 and isinstance(config.dropout, float)
    assert config.max_len == 1024 and config.share_embeddings and config.tie_output  # absent: MarianConfig's
    assert config.pad_id == config.decoder_start_id == 9


@pytest.mark.parametrize("field,value,problem", [
    ("d_model", None, "d_model is missing"),
    ("encoder_attention_heads", None, "encoder_attention_heads is missing"),
    ("decoder_attention_heads", None, "decoder_attention_heads is missing"),
    ("decoder_layers", None, "decoder_layers is missing"),
    ("dropout", "high", 'dropout="high" is not a number'),
    ("d_model", "big", 'd_model="big" is not an integer'),
    ("d_model", True, "d_model=true is not an integer"),
    ("encoder_ffn_dim", 16.5, "encoder_ffn_dim=16.5 is not an integer"),
    ("scale_embedding", "yes", 'scale_embedding="yes" is not true or false'),
    ("activation_function", ["swish"], 'activation_function=["swish"] is not a string'),
    ("eos_token_id", [0, 1], "eos_token_id=[0, 1] is not an integer"),
    ("architectures", 5, "architectures=5 is not supported (expected MarianMTModel)"),
    ("model_type", None, 'model_type is missing (expected "marian")'),  # was "model_type=None"
    ("model_type", "bart", 'model_type="bart" is not supported (expected "marian")'),
    ("activation_function", "gelu_new",
     'activation_function="gelu_new" is not supported; supported: "swish", "silu", "relu", "gelu"'),
])
def test_config_field_missing_or_mistyped_is_one_line(tmp_path, capsys, field, value, problem):
    """`None` removes the field. The config is read first: a directory with only config.json is enough."""
    from aiayn.cli import main

    config = {k: v for k, v in TINY_CONFIG.items() if k != field}
    if value is not None:
        config[field] = value
    (tmp_path / "opus").mkdir()
    (tmp_path / "opus" / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"aiayn: error: {tmp_path / 'opus' / 'config.json'}: {problem}"]


@pytest.mark.parametrize("changes,problem", [
    ({"encoder_attention_heads": 3, "decoder_attention_heads": 3},
     "d_model=8 is not divisible by encoder_attention_heads=3 and decoder_attention_heads=3"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be positive"),
    ({"eos_token_id": 9},
     "pad_token_id and eos_token_id are both 9: padding and the end of a sentence need two ids"),
    ({"encoder_layers": 0, "decoder_layers": -1},
     "encoder_layers=0 must be positive; decoder_layers=-1 must be positive"),
    ({"dropout": 1.5}, "dropout=1.5 is not in [0, 1)"),
    # absent, decoder_start_token_id is pad_token_id: the one wrong value is named once, as the file has it
    ({"pad_token_id": 12, "decoder_start_token_id": None}, "pad_token_id=12 is outside the vocabulary of 10"),
    ({"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 0},
     "decoder_vocab_size=0 must be positive"),
])
def test_a_value_the_model_refuses_is_named_by_its_config_json_key(tmp_path, capsys, changes, problem):
    """ModelConfig's problems named its own fields (`d_model=32 is not divisible by n_heads=5`, `max_len=0`,
    `pad_id and eos_id`), which config.json does not have."""
    from aiayn.cli import main

    config = {k: v for k, v in {**TINY_CONFIG, **changes}.items() if v is not None}
    (tmp_path / "opus").mkdir()
    (tmp_path / "opus" / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(tmp_path / "out")]) == 2
    where = tmp_path / "opus" / "config.json"
    assert capsys.readouterr().err.splitlines() == [f"aiayn: error: {where}: {problem}"]


def test_every_model_field_has_its_config_json_keys():
    """A ModelConfig field the import reads but `MARIAN_KEYS` lacks would be named as aiayn's in an error;
    the fields it lacks are the ones the import fixes."""
    from aiayn.config import ModelConfig
    from aiayn.interop.marian import MARIAN_KEYS

    fixed = {"norm_first", "positions", "final_logits_bias", "layer_norm_eps"}  # not read from config.json
    assert set(MARIAN_KEYS) == set(ModelConfig.__dataclass_fields__) - fixed


@pytest.fixture
def opus_bin(build, tmp_path):
    """A copy of a converted variant's directory without model.safetensors: pytorch_model.bin is read."""
    shutil.copytree(build(VARIANTS[0])[2], tmp_path / "opus")
    (tmp_path / "opus" / "model.safetensors").unlink()
    return tmp_path / "opus"


def convert_error(directory: Path, capsys) -> str:
    """The CLI's one-line error for converting `directory` (exit status 2)."""
    from aiayn.cli import main

    capsys.readouterr()
    assert main(["convert", "--from", "marian", str(directory), str(directory.parent / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and not (directory.parent / "out").exists()
    return err[0]


class RunsCode:
    """Unpickled the unsafe way, runs a shell command that leaves a witness file."""

    def __init__(self, witness: Path):
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


@pytest.mark.parametrize("container", ["torch.save", "pickle.dump"])
def test_pickle_with_code_is_refused_in_one_line(opus_bin, capsys, container):
    witness = opus_bin.parent / "PWNED"
    weights = {"x": RunsCode(witness), "model.shared.weight": torch.zeros(2)}  # the payload comes first
    if container == "torch.save":
        torch.save(weights, opus_bin / "pytorch_model.bin")
    else:  # protocol 2: the oldest torch files are plain pickles
        (opus_bin / "pytorch_model.bin").write_bytes(pickle.dumps(weights, protocol=2))
    err = convert_error(opus_bin, capsys)
    assert err == (f"aiayn: error: {opus_bin / 'pytorch_model.bin'}: refused: not plain tensors (the pickle asks "
                   f"for {os.system.__module__}.system); weights are never loaded with code execution")
    assert not witness.exists()
    pickle.loads(pickle.dumps(RunsCode(witness)))  # the witness works: unpickled unsafely, the code runs
    assert witness.exists()


@pytest.mark.parametrize("content,problem", [
    ([torch.zeros(2)], "holds type list, expected a dict of name -> tensor"),
    ({"model.shared.weight": 3}, "model.shared.weight is of type int, expected a tensor"),
    ({0: torch.zeros(2)}, "key 0 is of type int, expected a string"),
    (b"PK\x03\x04 cut short", "damaged or cut short ("),
    ("cut", "damaged or cut short ("),  # a real torch.save file cut short: a download interrupted
])
def test_bin_that_is_not_a_state_dict_is_named(opus_bin, capsys, content, problem):
    path = opus_bin / "pytorch_model.bin"
    if content == "cut":
        torch.save({"model.shared.weight": torch.zeros(1000)}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    err = convert_error(opus_bin, capsys)
    assert err.startswith(f"aiayn: error: {path}: {problem}")
    assert err.endswith("; download it again") == problem.startswith("damaged")


def test_a_safetensors_file_cut_short_is_said_as_a_bin_is(build, tmp_path, capsys):
    """model.safetensors cut short was 'corrupt weights (Error while deserializing header: incomplete
    metadata, file not fully covered)' where pytorch_model.bin cut short is 'damaged or cut short (...);
    download it again'. safetensors before 0.6 names the same thing MetadataIncompleteBuffer."""
    opus = tmp_path / "opus"
    shutil.copytree(build(VARIANTS[0])[2], opus)
    path = opus / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert convert_error(opus, capsys) in [
        f"aiayn: error: {path}: damaged or cut short (Error while deserializing header: {words}); download "
        "it again" for words in ("incomplete metadata, file not fully covered", "MetadataIncompleteBuffer")]


@pytest.mark.parametrize("content, problem", [
    (b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n", "it starts b'<!DOCTYPE html><html><bo'"),
    (b"hello\n", r"it starts b'hello\n'"),  # 'h' is a pickle opcode: a KeyError, not a refusal
    # HuggingFace's 401 page: "I" is INT, an opcode the weights-only unpickler refused ("Unsupported
    # operand 73"), and the file was called unsafe; so were "cannot ..." (it asked for "annot")
    (b"Invalid username or password.", "it starts b'Invalid username or pass'"),
    (b"cannot find the file\n", r"it starts b'cannot find the file\n'"),
    (b"config.json not found\nfoo\n", r"it starts b'config.json not found\nfo'"),  # "asks for onfig.json"
    (b"", "empty"),
    ("safetensors", "a safetensors file: name it model.safetensors"),
])
def test_a_bin_that_is_no_pickle_is_not_called_unsafe(opus_bin, capsys, content, problem):
    """An HTML error page saved as pytorch_model.bin (any bytes no pickle holds, a safetensors file) was
    'refused: not plain tensors; weights are never loaded with code execution': unsafe, where it is simply
    no weights file; the refusal is for a pickle that asks for code
    (`test_pickle_with_code_is_refused...`)."""
    from safetensors.torch import save_file

    path = opus_bin / "pytorch_model.bin"
    if content == "safetensors":
        save_file({"model.shared.weight": torch.zeros(2)}, str(path))
    else:
        path.write_bytes(content)
    assert convert_error(opus_bin, capsys) == f"aiayn: error: {path}: not a PyTorch weights file ({problem})"


def test_missing_weight_names_the_weights_file(build, opus_bin, capsys):
    weights = build(VARIANTS[0])[0].state_dict()
    del weights["model.encoder.layers.0.fc1.weight"]
    torch.save(weights, opus_bin / "pytorch_model.bin")
    assert convert_error(opus_bin, capsys) == (f"aiayn: error: {opus_bin / 'pytorch_model.bin'}: "
                                               f"missing weight model.encoder.layers.0.fc1.weight")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("container", ["model.safetensors", "pytorch_model.bin"])
def test_a_weight_that_is_not_a_float_tensor_is_refused_by_name(build, opus_bin, capsys, dtype, container):
    """`.float()` turned an integer, bool or complex weight into garbage (a complex one with a two-line
    warning) and the converted model translated nonsense, exit 0."""
    import safetensors
    from safetensors.torch import load_file, save_file

    weights = load_file(str(build(VARIANTS[0])[2] / "model.safetensors"))  # plain tensors, none shared
    weights["model.encoder.layers.0.fc1.weight"] = weights["model.encoder.layers.0.fc1.weight"].to(dtype)
    path = opus_bin / container
    if container == "pytorch_model.bin":
        torch.save(weights, path)
    else:
        try:
            save_file(weights, str(path))
        except KeyError:  # its table of dtypes lacks this one
            pytest.skip(f"safetensors {safetensors.__version__} cannot save {dtype} (0.7 and later can)")
    assert convert_error(opus_bin, capsys) == (f"aiayn: error: {path}: model.encoder.layers.0.fc1.weight is "
                                               f"{str(dtype).removeprefix('torch.')}, not a float tensor")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("container", ["model.safetensors", "pytorch_model.bin"])
@torch.no_grad()
def test_half_precision_weights_with_their_position_tables_convert(build, opus_bin, dtype, container):
    """A float16 or bfloat16 file that stores the sinusoid tables (older OPUS-MT files,
    model.half().save_pretrained()) was refused as 'learned positions': its tables were compared with
    float32's to 1e-4, and rounding puts them up to 2.4e-4 (float16) and 4e-3 (bfloat16) away."""
    from safetensors.torch import save_file

    hf = build(VARIANTS[0])[0]
    weights = {name: t.to(dtype) for name, t in hf.state_dict().items()}  # copies: none shared
    table = weights["model.encoder.embed_positions.weight"]
    assert (table.float() - hf.model.encoder.embed_positions.weight).abs().max() > 1e-4  # rounded
    path = opus_bin / container
    save_file(weights, str(path)) if container == "model.safetensors" else torch.save(weights, path)
    convert_marian(opus_bin, opus_bin.parent / "out")
    ck = load_checkpoint(opus_bin.parent / "out")
    rounded = copy.deepcopy(hf)  # what transformers computes with these weights in float32, the positions
    exact = {n: t for n, t in hf.state_dict().items() if "embed_positions" in n}  # exact, as aiayn's are
    rounded.load_state_dict({name: t.float() for name, t in weights.items()} | exact)
    src = source_batch(ck.tokenizer, SENTENCES)  # (B, S)
    tgt_in = src[:, :6].clone()  # (B, T): any ids
    tgt_in[:, 0] = ck.model.config.decoder_start_id
    mask = src.ne(ck.tokenizer.pad_id)
    theirs = rounded(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
    torch.testing.assert_close(ck.model(src, tgt_in), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype, change", [
    (torch.float32, 5e-4), (torch.float16, 0.01), (torch.bfloat16, 0.03), (torch.bfloat16, "learned")])
def test_a_position_table_off_the_sinusoid_is_refused_in_any_dtype(build, opus_bin, capsys, dtype, change):
    """The tolerance is the stored dtype's rounding, no more: a table changed by more, or a learned one,
    is still refused."""
    weights = {name: t.to(dtype) for name, t in build(VARIANTS[0])[0].state_dict().items()}
    name = "model.decoder.embed_positions.weight"
    if change == "learned":  # as transformers initializes a learned table
        weights[name] = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    else:
        weights[name][5, 3] += change
    torch.save(weights, opus_bin / "pytorch_model.bin")
    assert convert_error(opus_bin, capsys) == (
        f"aiayn: error: {opus_bin / 'pytorch_model.bin'}: {name} is not the sin-then-cos sinusoid table; "
        "learned positions are not supported")


@pytest.mark.parametrize("shard, problem", [
    ("../../../etc/passwd", "weight_map names a file outside"),  # read, then refused as "corrupt weights"
    ("model-00002-of-00002.safetensors", "names the shard model-00002-of-00002.safetensors, which is missing"),
])
def test_shard_index_names_only_files_beside_it(opus_bin, capsys, shard, problem):
    (opus_bin / "pytorch_model.bin").unlink(missing_ok=True)  # the index is read before it anyway
    index = {"weight_map": {"model.shared.weight": shard}}
    (opus_bin / "model.safetensors.index.json").write_text(json.dumps(index))
    assert convert_error(opus_bin, capsys) == (
        f"aiayn: error: {opus_bin / 'model.safetensors.index.json'}: {problem}"
        + (f" {opus_bin}" if "outside" in problem else ""))


LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"4d7a" * 16 + b"\nsize 1048576\n"


@pytest.mark.parametrize("stand_in", ["link", "lfs"])
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "vocab.json", "target_vocab.json",
                                  "source.spm", "target.spm", "model.safetensors", "pytorch_model.bin",
                                  "model-00001-of-00001.safetensors", "generation_config.json"])
def test_a_link_to_nothing_or_a_git_lfs_pointer_is_said_as_such(build, tmp_path, capsys, name, stand_in):
    """A partial download in the HuggingFace cache (each file a link into blobs/) was 'no model.safetensors
    or pytorch_model.bin', 'vocab.json: not found (is this a MarianMT directory?)', its tokenizer_config.json
    skipped as absent; a clone without git-lfs 'not valid JSON', 'not a SentencePiece model', or
    pytorch_model.bin's 'refused: not plain tensors', which called the file unsafe."""
    opus = tmp_path / "opus"
    shutil.copytree(build(VARIANTS[1])[2], opus)  # separate vocabularies: target_vocab.json too
    if name.endswith(("bin", "-of-00001.safetensors")):  # read where there is no model.safetensors
        (opus / "model.safetensors").unlink()
    if name.startswith("model-"):
        index = {"weight_map": {"model.shared.weight": name}}
        (opus / "model.safetensors.index.json").write_text(json.dumps(index))
    path = opus / name
    path.unlink(missing_ok=True)
    if stand_in == "link":
        path.symlink_to(tmp_path / "blobs" / "4d7a")
        problem = f"a symbolic link to {tmp_path / 'blobs' / '4d7a'}, which does not exist"
    else:
        path.write_bytes(LFS_POINTER)
        problem = "a Git LFS pointer, not the file itself (run `git lfs pull`)"
    assert convert_error(opus, capsys) == f"aiayn: error: {path}: {problem}"


def test_cli_convert(tmp_path, capsys):
    from aiayn.cli import main

    make_marian_dir(tmp_path / "opus", "swish", shared=True)
    assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(tmp_path / "out")]) == 0
    assert load_checkpoint(tmp_path / "out").meta["converted_from"]["format"] == "marian"
    (tmp_path / "opus" / "vocab.json").unlink()
    capsys.readouterr()  # transformers' progress bars from saving
    assert main(["convert", "--from", "marian", str(tmp_path / "opus"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab.json: not found" in err[0]
    for source, problem in (("nowhere", "not found"), ("opus/config.json", "not a directory")):  # was one
        assert main(["convert", "--from", "marian", str(tmp_path / source), str(tmp_path / "out3")]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {tmp_path / source}: {problem}\n"
    # a directory in a file's place was "not found"; an aiayn checkpoint "config.json: not found"
    make_marian_dir(tmp_path / "opus2", "swish", shared=True)
    capsys.readouterr()
    (tmp_path / "opus" / "vocab.json").mkdir()
    (tmp_path / "opus" / "model.safetensors").rename(tmp_path / "weights")
    (tmp_path / "opus" / "model.safetensors").mkdir()
    for name, given in (("vocab.json", "opus"), ("model.safetensors", "opus"), ("out", "out")):
        assert main(["convert", "--from", "marian", str(tmp_path / given), str(tmp_path / "out3")]) == 2
        problem = ("an aiayn checkpoint already; translate, score or fine-tune it as it is" if given == "out"
                   else "is a directory, not a file")
        where = tmp_path / given if given == "out" else tmp_path / given / name
        assert capsys.readouterr().err == f"aiayn: error: {where}: {problem}\n"
        if name == "vocab.json":
            (tmp_path / "opus" / "vocab.json").rmdir()
            (tmp_path / "opus" / "vocab.json").write_bytes((tmp_path / "opus2" / "vocab.json").read_bytes())
    assert not (tmp_path / "out3").exists()
    hint = r"a MarianMT \(OPUS-MT\) directory: import it with aiayn convert --from marian$"
    with pytest.raises(UserError, match=r"opus2: not an aiayn checkpoint \(no meta.json\); " + hint):
        load_checkpoint(tmp_path / "opus2")


def test_converted_is_said_only_once_written(tmp_path, monkeypatch, caplog):
    """"converted DIR: N parameters" came before the checkpoint was written, and then a full disk."""
    from aiayn.interop import marian

    make_marian_dir(tmp_path / "opus", "swish", shared=True)

    def full_disk(out, *args, **kwargs):
        raise UserError(f"{out}: could not write checkpoint (No space left on device)")

    monkeypatch.setattr(marian, "save_checkpoint", full_disk)
    with caplog.at_level("INFO", logger="aiayn"), pytest.raises(UserError, match="No space left"):
        convert_marian(tmp_path / "opus", tmp_path / "out")
    assert "converted" not in caplog.text
    monkeypatch.undo()
    with caplog.at_level("INFO", logger="aiayn"):
        convert_marian(tmp_path / "opus", tmp_path / "out")
    assert "converted" in caplog.text


@pytest.mark.parametrize("force", [False, True])
def test_an_output_that_comes_while_converting_is_replaced_only_with_force(tmp_path, monkeypatch, force):
    """As two `average -o OUT` at once: the check before the work refused an existing OUT, the write
    replaced one that came while the weights were read (another convert's, say), --force or not."""
    from aiayn.interop import marian

    make_marian_dir(tmp_path / "opus", "swish", shared=True)
    convert_marian(tmp_path / "opus", tmp_path / "other")
    out, real = tmp_path / "out", marian.load_marian_weights

    def load_marian_weights(directory):
        shutil.copytree(tmp_path / "other", out)
        return real(directory)

    monkeypatch.setattr(marian, "load_marian_weights", load_marian_weights)
    (tmp_path / "other" / "meta.json").write_text(
        (tmp_path / "other" / "meta.json").read_text().replace('"marian"', '"theirs"'))
    if force:
        convert_marian(tmp_path / "opus", out, force=True)
        assert load_checkpoint(out).meta["converted_from"]["format"] == "marian"
    else:
        with pytest.raises(UserError, match=rf"^{out}: already exists \(pass --force"):
            convert_marian(tmp_path / "opus", out)
        assert load_checkpoint(out).meta["converted_from"]["format"] == "theirs"


def test_convert_from_python_never_replaces_the_source_or_other_files(tmp_path):
    """`convert_marian("models/opus", "models")` deleted `models`, the source and its sibling models with it:
    only the CLI checked the output; the function is what a notebook calls. Without force, a directory that
    force would not replace either was "already exists (pass --force ...)", whose advice then failed."""
    models = tmp_path / "models"
    make_marian_dir(models / "opus", "swish", shared=True)
    (models / "other").mkdir()
    (models / "other" / "notes.txt").write_text("mine")
    not_replaced = "holds files that are not an aiayn checkpoint; will not replace it, even with --force"
    for out, force, problem in ((models, True, "contains the input"), (models / "opus", True, "is the input"),
                                (models / "other", False, not_replaced),
                                (models / "other", True, "holds files that are not an aiayn checkpoint")):
        with pytest.raises(UserError, match=problem):
            convert_marian(models / "opus", out, force=force)
    assert (models / "other" / "notes.txt").read_text() == "mine"
    assert (models / "opus" / "config.json").exists()
    convert_marian(models / "opus", models / "ck")
    convert_marian(models / "opus", models / "ck", force=True)  # an earlier checkpoint: replaced
    convert_marian(models / "opus", models / "opus" / "aiayn")  # new, inside: deletes nothing
    # and again: what it replaces is its own output, which was refused as "part of the input"
    convert_marian(models / "opus", models / "opus" / "aiayn", force=True)
    (models / "opus" / "mine").mkdir()
    (models / "opus" / "mine" / "notes.txt").write_text("mine")
    (models / "opus" / "weights").symlink_to("aiayn/model.safetensors")  # the input leads into the output
    for out in ("mine", "aiayn"):  # "would delete the input": it deletes what is inside it
        with pytest.raises(UserError, match=f"{out}: lies inside the input .*opus; writing it would delete "
                                            "part of the input$"):
            convert_marian(models / "opus", models / "opus" / out, force=True)
    (models / "opus" / "weights").unlink()
    (models / "opus" / "aiayn-link").symlink_to("aiayn", target_is_directory=True)  # a link to it too
    with pytest.raises(UserError, match="aiayn: lies inside the input"):
        convert_marian(models / "opus", models / "opus" / "aiayn", force=True)
    assert (models / "opus" / "mine" / "notes.txt").read_text() == "mine"
    odd = models / "opus\udcff"  # a name that is not UTF-8: its weights were "corrupt weights"; an output
    for source, out in ((models / "opus", models / "ck\udcff"), (odd, models / "ck2")):  # so named was
        if source == odd:  # written, then refused by every command that loads it
            (models / "opus").rename(odd)
        with pytest.raises(UserError, match="a path that is not valid UTF-8, which safetensors cannot open"):
            convert_marian(source, out)
    assert not (models / "ck\udcff").exists() and not (models / "ck2").exists()
    assert load_checkpoint(models / "ck").meta["converted_from"]["format"] == "marian"


MAX_NEW = 20


def search_batch(ck) -> torch.Tensor:
    """The test sentences and 16 random sources (B, S): enough that searches end at many lengths."""
    texts = source_batch(ck.tokenizer, SENTENCES)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 12, (16,), generator=gen).tolist()
    width = max(texts.shape[1], max(lengths) + 1)
    rand = torch.full((16, width), ck.tokenizer.pad_id)  # (16, S)
    for i, n in enumerate(lengths):
        rand[i, :n] = torch.randint(3, ck.model.config.vocab_size - 1, (n,), generator=gen)  # no pad, no EOS
        rand[i, n] = ck.tokenizer.eos_id
    texts = torch.nn.functional.pad(texts, (0, width - texts.shape[1]), value=ck.tokenizer.pad_id)  # (3, S)
    return torch.cat([texts, rand])


def hf_search(hf, src: torch.Tensor, pad_id: int, **options):
    """`generate` of transformers, sequences cut after EOS and without the start token, and their scores.

    Marian's `forced_eos_token_id` is switched off: it overwrites the last allowed token with EOS,
    where aiayn (like CTranslate2 and fairseq) returns the hypothesis cut at the limit as it is. Padding
    is banned as OPUS-MT's own generation configs do (`bad_words_ids=[[pad]]`) and aiayn's searches
    always do; aiayn bans it before the softmax, hence `renormalize_logits` (the log-softmax is taken
    again after the ban), else every beam's score is off by its own log(1 - P(pad)).
    """
    hf.generation_config.forced_eos_token_id = None
    out = hf.generate(input_ids=src, attention_mask=src.ne(pad_id), do_sample=False, max_new_tokens=MAX_NEW,
                      bad_words_ids=[[pad_id]], renormalize_logits=True, return_dict_in_generate=True,
                      output_scores=True, **options)
    rows = []
    for seq in out.sequences[:, 1:].tolist():
        eos = hf.config.eos_token_id
        rows.append(seq[: seq.index(eos) + 1] if eos in seq else seq[:MAX_NEW])
    return rows, getattr(out, "sequences_scores", None)  # beam search only


def aiayn_search(ck, src: torch.Tensor, **options):
    config = DecodeConfig(max_len_a=0.0, max_len_b=MAX_NEW, **options)  # MAX_NEW output tokens, as HF's
    hyps = generate(ck.model, src, config)
    return [h[0].tokens for h in hyps], torch.tensor([h[0].score for h in hyps])


@pytest.mark.parametrize("variant", SEARCH_VARIANTS)
def test_greedy_is_token_identical_to_generate(build, variant):
    hf, ck, _ = build(variant)
    src = search_batch(ck)
    theirs, _ = hf_search(hf, src, ck.tokenizer.pad_id, num_beams=1)
    ours, _ = aiayn_search(ck, src, beam=1)
    assert ours == theirs
    if variant == VARIANTS[0]:  # seeded so that some outputs end with EOS and others are cut at the limit
        lengths = {len(t) for t in ours}
        assert MAX_NEW in lengths and min(lengths) < MAX_NEW


@pytest.mark.parametrize("variant", [SEARCH_VARIANTS[0]] + [pytest.param(*v.values, id=v.id, marks=pytest.mark.slow)
                                     for v in SEARCH_VARIANTS[1:]])
@pytest.mark.parametrize("beam,alpha", [(4, 1.0), pytest.param(3, 0.6, marks=pytest.mark.slow)])
@pytest.mark.parametrize("theirs_stop,ours_stop", [(True, True), ("never", False)])
def test_beam_is_token_identical_to_generate(build, variant, beam, alpha, theirs_stop, ours_stop):
    """The same search: |Y|^alpha ('power', HuggingFace's formula, |Y| counting EOS, not the start
    token), the best 2K candidates per step, and a sentence stops once K hypotheses ended
    (`early_stopping=True` on both sides) or once none can beat them (HuggingFace's "never", aiayn's
    default, as the README says; HuggingFace's own default, False, is a heuristic bound that differs)."""
    hf, ck, _ = build(variant)
    src = search_batch(ck)
    theirs, their_scores = hf_search(hf, src, ck.tokenizer.pad_id, num_beams=beam, length_penalty=alpha,
                                     early_stopping=theirs_stop)
    ours, our_scores = aiayn_search(ck, src, beam=beam, lenpen=alpha, lenpen_kind="power",
                                    early_stopping=ours_stop)
    assert ours == theirs
    torch.testing.assert_close(our_scores, their_scores, atol=1e-4, rtol=0)
    if variant == VARIANTS[0]:  # seeded so that the beam finds something greedy search does not
        assert ours != aiayn_search(ck, src, beam=1)[0]


@pytest.mark.parametrize("variant", [VARIANTS[0], pytest.param(VARIANTS[1], marks=pytest.mark.slow)])
def test_beam_with_a_minimum_length_is_token_identical_to_generate(build, variant):
    """EOS banned for the first tokens before the softmax, as padding always is (HuggingFace's
    min_new_tokens with renormalize_logits, CTranslate2's min_decoding_length). Banned after it, each such
    step kept log(1 - P(EOS)) in the beams' scores, and beam search ranked them otherwise."""
    hf, ck, _ = build(variant)
    src = search_batch(ck)
    options = dict(num_beams=4, length_penalty=1.0, early_stopping=True, min_new_tokens=5)
    theirs, their_scores = hf_search(hf, src, ck.tokenizer.pad_id, **options)
    ours, our_scores = aiayn_search(ck, src, beam=4, lenpen=1.0, lenpen_kind="power", early_stopping=True,
                                    min_len=5)
    assert ours == theirs and min(map(len, ours)) >= 6  # 5 tokens, then EOS at the earliest
    torch.testing.assert_close(our_scores, their_scores, atol=1e-4, rtol=0)


# The converted model everywhere else in aiayn: translate, attention, fine-tuning.


def test_translator_text_equals_marian_pipeline(build):
    hf, ck, opus = build(VARIANTS[0])
    from aiayn.translate import Translator

    theirs_tok = transformers.MarianTokenizer.from_pretrained(str(opus))
    batch = theirs_tok(SENTENCES, return_tensors="pt", padding=True)
    hf.generation_config.forced_eos_token_id = None  # as in hf_search
    out = hf.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW,
                      bad_words_ids=[[ck.tokenizer.pad_id]])
    theirs = theirs_tok.batch_decode(out, skip_special_tokens=True)
    ours = Translator.load(ck.path).translate(SENTENCES, beam=1, max_len_a=0.0, max_len_b=MAX_NEW)
    assert ours == theirs and any(ours)


def test_separate_vocabs_without_tokenizer_config(build, tmp_path):
    """No tokenizer_config.json: config.json's share_encoder_decoder_embeddings=false says that the
    target side has its own vocabulary; greedy text is what generate's ids decode to with it."""
    hf, _, opus = build(VARIANTS[1])  # separate vocabularies of different sizes
    theirs_tok = transformers.MarianTokenizer.from_pretrained(str(opus))  # with separate_vocabs=true
    shutil.copytree(opus, tmp_path / "opus")
    (tmp_path / "opus" / "tokenizer_config.json").unlink()
    assert json.loads((tmp_path / "opus" / "config.json").read_text())["share_encoder_decoder_embeddings"] is False
    convert_marian(tmp_path / "opus", tmp_path / "out")
    from aiayn.translate import Translator

    translator = Translator.load(tmp_path / "out")
    assert translator.tokenizer.tgt_vocab == json.loads((opus / "target_vocab.json").read_text())
    texts = SENTENCES + ["7 is small", "the number 40 is even and 5 is small"]
    ids, _ = hf_search(hf, source_batch(translator.tokenizer, texts), translator.tokenizer.pad_id, num_beams=1)
    theirs = theirs_tok.batch_decode(ids, skip_special_tokens=True)
    ours = translator.translate(texts, beam=1, max_len_a=0.0, max_len_b=MAX_NEW)
    assert ours == theirs and any(ours)


@pytest.mark.parametrize("settings", [True, False], ids=["tokenizer_config", "config_json"])
def test_target_vocab_of_wrong_size_is_refused_in_one_line(build, tmp_path, capsys, settings):
    opus = tmp_path / "opus"
    shutil.copytree(build(VARIANTS[1])[2], opus)
    if not settings:
        (opus / "tokenizer_config.json").unlink()
    tgt_vocab = json.loads((opus / "target_vocab.json").read_text())
    size = len(tgt_vocab)
    tgt_vocab["extra"] = size  # one id more than the decoder has
    (opus / "target_vocab.json").write_text(json.dumps(tgt_vocab))
    assert convert_error(opus, capsys) == (
        f"aiayn: error: {opus / 'target_vocab.json'}: its {size + 1} ids are not exactly 0..{size - 1}, "
        f"the model's target vocabulary ({size} ids in {opus / 'config.json'})")


def test_one_vocabulary_for_two_sizes_is_refused_in_one_line(build, tmp_path, capsys):
    """tokenizer_config.json says one vocabulary, but the decoder's is another size: vocab.json is named."""
    opus = tmp_path / "opus"
    shutil.copytree(build(VARIANTS[1])[2], opus)
    (opus / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": False}))
    hf = json.loads((opus / "config.json").read_text())
    n_src, n_tgt = hf["vocab_size"], hf["decoder_vocab_size"]
    assert n_src != n_tgt
    assert convert_error(opus, capsys) == (
        f"aiayn: error: {opus / 'vocab.json'}: its {n_src} ids are not exactly 0..{n_tgt - 1}, "
        f"the model's target vocabulary ({n_tgt} ids in {opus / 'config.json'})")


@torch.no_grad()
def test_attention_maps_are_marians(build):
    """`aiayn attention`'s weights are those MarianMTModel reports (eager attention, output_attentions)."""
    hf, ck, _ = build(VARIANTS[1])  # separate vocabularies: the target side has its own pieces
    from aiayn.attention import extract_attention

    maps = extract_attention(ck.model, ck.tokenizer, SENTENCES[0], "die Zahl 12 ist gerade")
    tgt_in = torch.tensor([[ck.model.config.decoder_start_id] + ck.tokenizer.encode_tgt("die Zahl 12 ist gerade")])
    hf.config._attn_implementation = "eager"  # the implementation that returns its weights
    try:
        out = hf(input_ids=torch.tensor([ck.tokenizer.encode_src(SENTENCES[0])]), decoder_input_ids=tgt_in,
                 output_attentions=True)
    finally:
        hf.config._attn_implementation = "sdpa"
    torch.testing.assert_close(maps.encoder, torch.cat(out.encoder_attentions), atol=1e-5, rtol=0)  # (L, H, S, S)
    torch.testing.assert_close(maps.decoder, torch.cat(out.decoder_attentions), atol=1e-5, rtol=0)  # (L, H, T, T)
    torch.testing.assert_close(maps.cross, torch.cat(out.cross_attentions), atol=1e-5, rtol=0)  # (L, H, T, S)


def test_fine_tune_then_reload(build, tmp_path):
    """A few Adam steps with aiayn's loss move the imported weights (ties kept), and the result reloads."""
    ck = load_checkpoint(build(VARIANTS[0])[1].path)  # a fresh copy: the shared one stays as converted
    from aiayn.checkpoint import save_checkpoint
    from aiayn.train.loss import label_smoothed_nll

    model, tok = ck.model, ck.tokenizer
    src = source_batch(tok, ["the number 12 is even"])
    target = torch.tensor([tok.encode_tgt("the number 12 is even") + [tok.eos_id]])  # (1, T)
    tgt_in = torch.cat([torch.tensor([[model.config.decoder_start_id]]), target[:, :-1]], dim=1)  # (1, T)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for _ in range(5):
        loss, _ = label_smoothed_nll(model(src, tgt_in), target, eps=0.1, ignore_index=tok.pad_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    assert losses[-1] < losses[0]
    assert model.generator.weight is model.src_embed.embed.weight  # Marian's tied embeddings stay tied
    save_checkpoint(tmp_path / "tuned", model, tok, ck.meta)
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "tuned").model(src, tgt_in), model(src, tgt_in),
                                   atol=0, rtol=0)


def test_opus_mt_layout_decodes_as_marian_tokenizer(tmp_path):
    """OPUS-MT's usual layout: one vocab.json (both sides' pieces) with a source.spm and a target.spm of
    their own. A target id whose piece only the source side has (▁the) decoded with a literal U+2581
    ('▁the▁on'); <unk> decoded as ' ⁇ ' and a final lone '▁' left a trailing space."""
    import random

    from aiayn.data.tokenizer import Tokenizer

    src_spm = train_sentencepiece(SRC_LINES, tmp_path / "s", 60)
    tgt_spm = train_sentencepiece(TGT_LINES, tmp_path / "t", 48)
    shutil.copyfile(src_spm, tmp_path / "source.spm")
    shutil.copyfile(tgt_spm, tmp_path / "target.spm")
    pieces = list(dict.fromkeys(spm_pieces(src_spm) + spm_pieces(tgt_spm)))  # the union, in order
    vocab = marian_vocab(pieces, pad_last=True)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "MarianTokenizer"}))
    theirs = transformers.MarianTokenizer.from_pretrained(str(tmp_path))
    specials = {"pad": vocab["<pad>"], "eos": 0, "unk": 1, "bos": vocab["<pad>"]}
    ours = Tokenizer(tmp_path / "source.spm", tmp_path / "target.spm", vocab, specials)
    assert "▁the" in vocab and "▁the" not in spm_pieces(tgt_spm)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(1, len(vocab)) for _ in range(rng.randrange(1, 8))]  # no EOS (0) inside
        assert ours.decode_tgt(ids) == theirs.decode(ids, skip_special_tokens=True), ids
    assert ours.decode_tgt([vocab["▁the"], vocab["▁is"]]) == "the is"


def test_a_vocabulary_giving_one_id_twice_is_refused_at_conversion(build, tmp_path, capsys):
    """It converted, and the checkpoint then failed to load with 'not the tokenizer this model was
    trained with'."""
    opus = tmp_path / "opus"
    shutil.copytree(build(VARIANTS[0])[2], opus)
    vocab = json.loads((opus / "vocab.json").read_text())
    first = next(p for p, i in vocab.items() if i == 5)
    vocab["zzzdup"] = 5
    (opus / "vocab.json").write_text(json.dumps(vocab))
    assert convert_error(opus, capsys) == (
        f"aiayn: error: {opus / 'vocab.json'}: id 5 is given to both {first!r} and 'zzzdup'")


@pytest.mark.parametrize("pad", [{"__type": "AddedToken", "lstrip": False}, 5, None])
def test_a_special_token_without_its_text_is_refused_in_one_line(build, tmp_path, capsys, pad):
    opus = tmp_path / "opus"
    shutil.copytree(build(VARIANTS[0])[2], opus)
    settings = json.loads((opus / "tokenizer_config.json").read_text())
    settings["pad_token"] = pad
    (opus / "tokenizer_config.json").write_text(json.dumps(settings))
    assert convert_error(opus, capsys) == (
        f"aiayn: error: {opus / 'tokenizer_config.json'}: pad_token: expected a token string or a table "
        f"with its \"content\", not {pad!r}")


def test_an_ensemble_of_marian_models_with_other_start_ids_names_the_start_id(build, tmp_path):
    """The tokenizer's BOS is a Marian model's decoder start: two with one vocabulary and other start ids
    were refused as "its tokenizer differs ... an ensemble needs one vocabulary"."""
    from aiayn.translate import Translator

    _, _, opus = build(VARIANTS[0])
    other = tmp_path / "opus"
    shutil.copytree(opus, other)
    config = json.loads((other / "config.json").read_text())
    config["decoder_start_token_id"] = 1
    (other / "config.json").write_text(json.dumps(config))
    convert_marian(opus, tmp_path / "a")
    convert_marian(other, tmp_path / "b")
    with pytest.raises(UserError, match=f"{tmp_path / 'b'}: differs from {tmp_path / 'a'} in "
                                        "decoder_start_id;"):
        Translator.load([tmp_path / "a", tmp_path / "b"])
