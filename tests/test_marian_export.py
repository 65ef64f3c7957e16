"""MarianMT export: transformers' MarianMTModel, MarianTokenizer and generate, loading an exported aiayn
model offline, compute, tokenize and translate as aiayn does; `aiayn convert --from marian` reads it back."""

from __future__ import annotations

import json
import random
import re
import shutil

import export_helpers
import pytest
import torch
from export_helpers import SRC_LINES, TGT_LINES
from safetensors.torch import load_file

from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.cli import main
from aiayn.config import model_config
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.decoding import DecodeConfig, generate
from aiayn.errors import UserError
from aiayn.interop.marian_export import export_marian, residual_order
from aiayn.model import Transformer, sinusoidal_positions

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# the last two hold characters neither SentencePiece model knows: <unk> in the source
SENTENCES = ["the number 12 is even", "7 is odd and small", "the number 3", "odd", "12 and 7 and 3 is small",
             "the number 40 is even and 5 is small", "  7  is odd ", "中文 “quoted” odd",
             "é café … 3"]
MAX_NEW = 20

# Every option that changes the export: positions layout (a permutation of the residual features or
# none), activation, logits bias, decoder start, embedding scale, one or two vocabularies and matrices.
VARIANTS = {
    "paper": {},  # interleaved positions, ReLU, one vocabulary, tied output, start from BOS
    "marian-like": {"positions": "sin_cos", "activation": "silu", "final_logits_bias": True,
                    "scale_embedding": False,
                    "decoder_start_id": 0},  # the decoder starts from pad (id 0 in our SentencePiece models)
    "gelu-separate-untied": {"activation": "gelu", "share_embeddings": False, "tie_output": False},
    "shared-untied": {"tie_output": False},  # one matrix for both sides, an output projection of its own
    "separate-tied": {"share_embeddings": False},  # data.shared_vocab = false: lm_head is the decoder's table
    "unscaled": {"scale_embedding": False},
    "deeper-decoder": {"n_decoder_layers": 3},  # encoder_layers 2, decoder_layers 3
}


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    return train_sentencepiece(SRC_LINES, d / "src", 60), train_sentencepiece(TGT_LINES, d / "tgt", 50)


def random_model(tokenizer: Tokenizer, **overrides) -> Transformer:
    """test_ctranslate2.py's micro model with a likelier EOS where it has a logits bias (these random
    models' logits span about 20): some translations end early."""
    return export_helpers.random_model(tokenizer, likelier_eos=9.0, **overrides)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request, spm_models, tmp_path_factory):
    """(variant, aiayn checkpoint, MarianMTModel, MarianTokenizer, export directory), exported by the CLI."""
    root = tmp_path_factory.mktemp(request.param)
    export_helpers.variant_checkpoint(root / "ck", spm_models, likelier_eos=9.0, **VARIANTS[request.param])
    assert main(["export", "--to", "marian", str(root / "ck"), str(root / "hf")]) == 0
    hf = transformers.MarianMTModel.from_pretrained(root / "hf").eval()
    hf_tok = transformers.MarianTokenizer.from_pretrained(root / "hf")
    return request.param, load_checkpoint(root / "ck"), hf, hf_tok, root / "hf"


def source_batch(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    ids = [tokenizer.encode_src(t) for t in texts]
    out = torch.full((len(ids), max(map(len, ids))), tokenizer.pad_id)  # (B, S) right-padded
    for i, row in enumerate(ids):
        out[i, : len(row)] = torch.tensor(row)
    return out


def teacher_forced(ck, rows: int) -> torch.Tensor:
    """(rows, 9) random target ids, each row starting with the model's decoder start id."""
    gen = torch.Generator().manual_seed(1)
    tgt_in = torch.randint(0, ck.model.config.target_vocab_size, (rows, 9), generator=gen)
    tgt_in[:, 0] = ck.model.config.decoder_start_id
    return tgt_in


def test_permuted_interleaved_positions_are_marians_table():
    """The permutation the export applies to the residual features takes aiayn's table to the one
    MarianMTModel computes for itself (and leaves a sin_cos table as it is)."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for d in (8, 32, 64):
        theirs = MarianSinusoidalPositionalEmbedding(300, d).create_weight()
        for layout in ("interleaved", "sin_cos"):
            config = model_config("micro", vocab_size=10, d_model=d, n_heads=2, positions=layout)
            ours = sinusoidal_positions(300, d, layout)[:, residual_order(config)]
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
        # the permutation counts
        assert not torch.allclose(sinusoidal_positions(300, d, "interleaved"), theirs)


@torch.no_grad()
def test_logits_match_marian_mt_model(exported):
    """A padded source batch with its attention_mask, a teacher-forced target from the start id: the
    same float32 logits (largest difference 0 for sin_cos, which needs no permutation, to 8.6e-6)."""
    _, ck, hf, _, _ = exported
    src = source_batch(ck.tokenizer, SENTENCES)
    assert (src == ck.tokenizer.pad_id).any()  # padding that the mask must hide
    tgt_in = teacher_forced(ck, len(SENTENCES))
    ours = ck.model(src, tgt_in)
    theirs = hf(input_ids=src, attention_mask=src.ne(ck.tokenizer.pad_id), decoder_input_ids=tgt_in).logits
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert hf.config.decoder_start_token_id == ck.model.config.decoder_start_id


def test_tied_weights_stay_tied_as_marian_ties_them(exported):
    """One matrix of aiayn's is one tensor of MarianMTModel's (model.shared, stored once), so fine-tuning it
    there keeps it tied; what aiayn keeps apart stays apart."""
    _, ck, hf, _, out = exported
    c = ck.model.config
    stored = load_file(str(out / "model.safetensors"))
    m = hf.model
    modules = {"enc": m.encoder.embed_tokens, "dec": m.decoder.embed_tokens, "out": hf.lm_head}
    ptr = {k: module.weight.data_ptr() for k, module in modules.items()}
    assert (ptr["out"] == ptr["dec"]) is c.tie_output
    if c.share_embeddings and c.tie_output:
        assert len({*ptr.values(), m.shared.weight.data_ptr()}) == 1
        assert {k for k in stored if "embed_tokens" in k or "lm_head" in k} == set()  # model.shared alone
    if not c.share_embeddings:
        assert ptr["enc"] != ptr["dec"]
        assert stored["model.decoder.embed_tokens.weight"].shape[0] == c.tgt_vocab_size
    config = json.loads((out / "config.json").read_text())
    assert (config["share_encoder_decoder_embeddings"], config["tie_word_embeddings"]) == (
        c.share_embeddings, c.tie_output)


def hf_greedy(hf, src: torch.Tensor, pad_id: int, **options) -> list[list[int]]:
    """`generate` with the exported generation_config.json's settings: its output ids without the start
    token, cut after EOS."""
    out = hf.generate(input_ids=src, attention_mask=src.ne(pad_id), max_new_tokens=MAX_NEW, **options)
    eos = hf.generation_config.eos_token_id
    return [seq[: seq.index(eos) + 1] if eos in seq else seq[:MAX_NEW] for seq in out[:, 1:].tolist()]


def test_greedy_generate_is_aiayns_greedy_search(exported):
    """generate's defaults as exported (greedy, pad banned, no EOS forced at the limit) find aiayn's
    tokens."""
    _, ck, hf, _, _ = exported
    src = source_batch(ck.tokenizer, SENTENCES + SRC_LINES[:60:6])
    config = DecodeConfig(beam=1, max_len_a=0.0, max_len_b=MAX_NEW)
    ours = [h[0].tokens for h in generate(ck.model, src, config)]
    assert hf_greedy(hf, src, ck.tokenizer.pad_id) == ours
    assert len({tuple(row) for row in ours}) > 1  # not a constant model
    if ck.model.final_logits_bias is not None:  # its likelier EOS: some end before the limit, some at it
        lengths = {len(row) for row in ours}  # (where forced_eos_token_id would have written EOS)
        assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW


def test_generate_writes_as_many_tokens_as_aiayn_at_the_length_limit(spm_models, tmp_path):
    """The exported max_length lets `generate` write model.max_len tokens, as aiayn's default searches may
    (transformers counts the start token in max_length): a model whose EOS never wins fills the limit."""
    tokenizer = Tokenizer(spm_models[0])
    torch.manual_seed(0)
    model = random_model(tokenizer, max_len=12, final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias[tokenizer.eos_id] = -100.0  # EOS never wins: every output reaches the limit
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    export_marian(tmp_path / "ck", tmp_path / "hf")
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    src = source_batch(tokenizer, ["odd", "the number 3"])
    ours = [h[0].tokens for h in generate(model, src, DecodeConfig(beam=1))]  # limit min(src + 50, max_len)
    theirs = hf.generate(input_ids=src, attention_mask=src.ne(tokenizer.pad_id))[:, 1:].tolist()
    assert [len(row) for row in ours] == [12, 12]
    assert theirs == ours


@pytest.mark.parametrize("exported", ["paper", "marian-like"], indirect=True)  # the search, not the layout
@pytest.mark.parametrize("theirs_stop,ours_stop", [(True, True), ("never", False)])
def test_beam_generate_is_aiayns_beam_search_with_the_power_penalty(exported, theirs_stop, ours_stop):
    """num_beams=4 with length_penalty alpha equals aiayn's `lenpen_kind="power"` search (the stopping
    rules paired as the README says), scores too: the exported renormalize_logits bans pad before the
    log-softmax, as aiayn does."""
    _, ck, hf, _, _ = exported
    src = source_batch(ck.tokenizer, SENTENCES + SRC_LINES[:60:6])
    out = hf.generate(input_ids=src, attention_mask=src.ne(ck.tokenizer.pad_id), max_new_tokens=MAX_NEW,
                      num_beams=4, length_penalty=0.6, early_stopping=theirs_stop,
                      return_dict_in_generate=True, output_scores=True)
    eos = ck.tokenizer.eos_id
    theirs = [seq[: seq.index(eos) + 1] if eos in seq else seq[:MAX_NEW]
              for seq in out.sequences[:, 1:].tolist()]
    config = DecodeConfig(beam=4, lenpen=0.6, lenpen_kind="power", early_stopping=ours_stop, max_len_a=0.0,
                          max_len_b=MAX_NEW)
    hyps = generate(ck.model, src, config)
    assert theirs == [h[0].tokens for h in hyps]
    scores = torch.tensor([h[0].score for h in hyps])
    torch.testing.assert_close(out.sequences_scores, scores, atol=1e-4, rtol=0)


def test_marian_tokenizer_gives_aiayns_source_ids(exported):
    """MarianTokenizer(OUT) encodes as `encode_src`: the same pieces and ids, `</s>` last, <unk> for what
    the SentencePiece model does not know, spaces and all (MarianTokenizer normalizes nothing itself)."""
    _, ck, _, hf_tok, _ = exported
    theirs = hf_tok(SENTENCES)["input_ids"]
    assert theirs == [ck.tokenizer.encode_src(t) for t in SENTENCES]
    assert any(ck.tokenizer.unk_id in row for row in theirs)
    batch = hf_tok(SENTENCES, return_tensors="pt", padding=True)
    assert torch.equal(batch["input_ids"], source_batch(ck.tokenizer, SENTENCES))  # padded with aiayn's pad


def test_marian_tokenizer_decodes_aiayns_output_as_aiayn(exported):
    """Output ids decode to aiayn's text, but for <unk> (aiayn's SentencePiece writes ' ⁇ ', MarianTokenizer
    drops it) and spaces at the ends (MarianTokenizer strips them: a last lone '▁' piece)."""
    _, ck, hf, hf_tok, _ = exported
    src = source_batch(ck.tokenizer, SENTENCES)
    for ids in hf_greedy(hf, src, ck.tokenizer.pad_id):
        assert hf_tok.decode(ids, skip_special_tokens=True) == ck.tokenizer.decode_tgt(ids).strip()
    rng = random.Random(0)
    size, specials = ck.model.config.target_vocab_size, (ck.tokenizer.eos_id, ck.tokenizer.unk_id)
    choices = [i for i in range(size) if i != ck.tokenizer.eos_id]
    for _ in range(200):  # any ids without an EOS inside (decode_tgt stops there, MarianTokenizer does not)
        ids = [rng.choice(choices) for _ in range(rng.randrange(8))]
        theirs = hf_tok.decode(ids + [ck.tokenizer.eos_id], skip_special_tokens=True)
        assert theirs == ck.tokenizer.decode_tgt(ids).replace(" ⁇ ", "").strip(), ids
        if not any(i in specials for i in ids):
            assert theirs == ck.tokenizer.decode_tgt(ids).strip()


@pytest.mark.parametrize("exported", ["paper"], indirect=True)  # the parts are compared for each variant
def test_text_to_text_is_aiayns_translation(exported):
    """MarianTokenizer, generate and batch_decode, the user's few lines, give `Translator.translate`'s text
    (pipeline("translation") did that in one line; transformers 5 removed that task)."""
    _, ck, hf, hf_tok, _ = exported
    from aiayn.translate import Translator

    batch = hf_tok(SENTENCES, return_tensors="pt", padding=True)
    theirs = hf_tok.batch_decode(hf.generate(**batch, max_new_tokens=MAX_NEW), skip_special_tokens=True)
    ours = Translator.load(ck.path).translate(SENTENCES, beam=1, max_len_a=0.0, max_len_b=MAX_NEW)
    assert theirs == [t.strip() for t in ours] and len(set(theirs)) > 1


@torch.no_grad()
def test_convert_reads_the_export_back_to_the_same_logits(exported, tmp_path):
    """`aiayn convert --from marian OUT CKPT2`: CKPT2 computes the original's logits (a sin_cos model with
    the residual features permuted, where the original interleaves)."""
    _, ck, _, _, out = exported
    assert main(["convert", "--from", "marian", str(out), str(tmp_path / "back")]) == 0
    back = load_checkpoint(tmp_path / "back")
    src, tgt_in = source_batch(ck.tokenizer, SENTENCES), teacher_forced(ck, len(SENTENCES))
    torch.testing.assert_close(back.model(src, tgt_in), ck.model(src, tgt_in), atol=1e-5, rtol=0)
    assert back.model.config.decoder_start_id == ck.model.config.decoder_start_id
    assert [back.tokenizer.encode_src(t) for t in SENTENCES] == [ck.tokenizer.encode_src(t)
                                                                 for t in SENTENCES]
    # exported again, the converted model (its vocabulary now Marian's vocab.json) gives the same directory
    export_marian(tmp_path / "back", tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(p.name for p in out.iterdir())
    for name in (p.name for p in out.iterdir() if p.suffix in (".json", ".spm")):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    first = load_file(str(out / "model.safetensors"))
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("overrides,problem", [
    ({"norm_first": True}, ("norm_first=True (pre-norm) cannot be exported to MarianMT, which is post-norm "
                            "only (LayerNorm after each residual sum)")),
    ({"layer_norm_eps": 1e-6}, ("layer_norm_eps=1e-06 cannot be exported to MarianMT, whose LayerNorms all "
                                "use 1e-05 (no config field sets it)")),
])
def test_what_marian_cannot_compute_is_refused_in_one_line(tmp_path, spm_models, capsys, overrides, problem):
    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer, **overrides), tokenizer)
    capsys.readouterr()
    assert main(["export", "--to", "marian", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == f"aiayn: error: {tmp_path / 'ck' / 'meta.json'}: {problem}\n"  # one line, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_special_token_of_another_id_on_the_target_side_is_refused(tmp_path, spm_models):
    """MarianTokenizer names EOS once, for both vocabularies: a target vocabulary whose `</s>` is another
    id (a converted model's vocab.json / target_vocab.json can say so) would append and stop on the wrong
    id. Refused in one line, nothing written."""
    shared = Tokenizer(spm_models[0])
    source = {shared.src.id_to_piece(i): i for i in range(shared.src_vocab_size)}
    target = dict(source)
    target["</s>"], target["▁the"] = source["▁the"], source["</s>"]  # the target's </s> is another id
    two = Tokenizer(shared.src_path, shared.src_path, vocab=source, tgt_vocab=target,
                    specials={"pad": 0, "bos": 1, "eos": 2, "unk": 3})
    save_checkpoint(tmp_path / "ck", random_model(two, share_embeddings=False, tie_output=False), two)
    with pytest.raises(UserError) as refused:
        export_marian(tmp_path / "ck", tmp_path / "hf")
    assert str(refused.value) == (f"{tmp_path / 'ck' / 'meta.json'}: the eos id 2 is '</s>' in the source "
                                  "vocabulary but not in the target's; MarianTokenizer names each special "
                                  "token once")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("force", [False, True])
def test_an_export_that_lands_meanwhile_is_replaced_only_with_force(tmp_path, spm_models, monkeypatch, force):
    """force=False holds at the rename too: another export that finishes at OUT while this one writes its
    weights stays, and this one is refused; with force it is replaced."""
    from aiayn.interop import marian_export

    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    theirs, out = tmp_path / "theirs", tmp_path / "hf"
    export_marian(tmp_path / "ck", theirs)
    (theirs / "config.json").write_text('{"who": "another export"}')
    real = marian_export.save_file

    def save_file(tensors, path, *args, **kwargs):
        if not out.exists():
            shutil.copytree(theirs, out)
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(marian_export, "save_file", save_file)
    if force:
        export_marian(tmp_path / "ck", out, force=True)
        assert json.loads((out / "config.json").read_text())["model_type"] == "marian"
    else:
        with pytest.raises(UserError, match=re.escape(f"{out}: already exists (pass --force")):
            export_marian(tmp_path / "ck", out)
        assert (out / "config.json").read_text() == '{"who": "another export"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf", "theirs"]


def test_an_existing_output_is_replaced_only_with_force(tmp_path, spm_models, capsys, caplog):
    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    ck, out = str(tmp_path / "ck"), tmp_path / "hf"
    capsys.readouterr()
    with caplog.at_level("INFO", logger="aiayn"):
        assert main(["export", "--to", "marian", ck, str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"  # the CLI prints OUT, and logged what it did first
    assert f"exporting {ck} to {out} (HuggingFace MarianMT)" in caplog.messages
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["export", "--to", "marian", ck, str(out)]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: {out}: already exists (pass --force, force=True in "
                                       "Python, to replace it)\n")
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    (out / "config.json").write_text("{}")  # replaced whole, not merged
    assert main(["export", "--to", "marian", ck, str(out), "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "marian"
    (out / "README.md").write_text("mine")  # something of the user's beside an export: never deleted
    with pytest.raises(UserError, match=re.escape(f"{out}: holds README.md beside a MarianMT model")):
        export_marian(ck, out, force=True)
    assert (out / "README.md").read_text() == "mine"
    for bad, problem in ((ck, "is an aiayn checkpoint; write it elsewhere"),
                         (str(out / "sub"), f"lies inside {out}, a MarianMT model; export beside it")):
        with pytest.raises(UserError, match=re.escape(problem)):
            export_marian(ck, bad, force=True)
    assert main(["export", "--to", "marian", ck, str(tmp_path / "q"), "--quantization", "int8"]) == 2
    assert capsys.readouterr().err == ("aiayn: error: --quantization applies to --to ctranslate2 only (a "
                                       "MarianMT export is always float32)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]
