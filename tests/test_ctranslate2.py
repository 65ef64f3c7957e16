"""CTranslate2 export: CTranslate2 runs an exported aiayn model to the same tokens and scores as aiayn."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from export_helpers import SRC_LINES, TGT_LINES, random_model, variant_checkpoint

from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.decoding import DecodeConfig, generate
from aiayn.errors import UserError

ctranslate2 = pytest.importorskip("ctranslate2")
# imported after the importorskip, since the module needs ctranslate2 (hence noqa E402)
from aiayn.interop.ct2 import export_ctranslate2, target_tokens, translate_tokens  # noqa: E402

SENTENCES = ["the number 12 is even", "7 is odd and small", "the number 3", "odd", "12 and 7 and 3 is small"]
MAX_LEN = 24

# Every architectural option that changes the exported spec: positions layout, activation, norm
# placement, logits bias, decoder start, separate vocabularies and untied output.
VARIANTS = {
    "paper": dict(),
    "marian-like": dict(positions="sin_cos", activation="silu", final_logits_bias=True, scale_embedding=False,
                        decoder_start_id=0),  # the decoder starts from pad (id 0 in our SentencePiece models)
    "prenorm-separate": dict(norm_first=True, activation="gelu", share_embeddings=False, tie_output=False),
}


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    return train_sentencepiece(SRC_LINES, d / "src", 60), train_sentencepiece(TGT_LINES, d / "tgt", 50)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request, spm_models, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    variant_checkpoint(root / "ck", spm_models, **VARIANTS[request.param])
    assert main(["export", "--to", "ctranslate2", str(root / "ck"), str(root / "ct2")]) == 0
    return load_checkpoint(root / "ck"), ctranslate2.Translator(str(root / "ct2"), device="cpu", intra_threads=1)


def aiayn_greedy(ck, texts: list[str]) -> list[list[int]]:
    """aiayn's own greedy search, one sentence at a time; output ids without the final EOS."""
    config = DecodeConfig(beam=1, max_len_a=0.0, max_len_b=MAX_LEN)
    out = []
    for text in texts:
        tokens = generate(ck.model, torch.tensor([ck.tokenizer.encode_src(text)]), config)[0][0].tokens
        out.append(tokens[:-1] if tokens[-1] == ck.tokenizer.eos_id else tokens)
    return out


def test_greedy_tokens_are_identical(exported):
    ck, translator = exported
    theirs = translate_tokens(translator, ck.tokenizer, SENTENCES, beam_size=1, max_len=MAX_LEN)
    ours = aiayn_greedy(ck, SENTENCES)
    assert theirs == ours
    assert len({tuple(row) for row in ours}) > 1  # different sources, different outputs: not a constant model


def test_a_source_past_1024_pieces_is_translated_whole(tmp_path, spm_models):
    """CTranslate2 cuts a source to its first 1024 pieces unless told otherwise (`max_input_length`), with
    no word: a model of longer positions translated the cut source, not aiayn's."""
    tokenizer = Tokenizer(spm_models[0])
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ck", random_model(tokenizer, max_len=2048), tokenizer)
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "ck"), str(tmp_path / "ct2")]) == 0
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    ck = load_checkpoint(tmp_path / "ck")
    long = [" ".join(SRC_LINES[:120]) + " " + text for text in SENTENCES[:2]]
    assert min(len(tokenizer.encode_src(text)) for text in long) > 1024
    ours = aiayn_greedy(ck, long)
    assert translate_tokens(translator, tokenizer, long, beam_size=1, max_len=MAX_LEN) == ours
    cut = translator.translate_batch([tokenizer.src_pieces(text)[:-1] for text in long], beam_size=1,
                                     max_decoding_length=MAX_LEN, min_decoding_length=0)  # the default 1024
    pieces = target_tokens(tokenizer, tokenizer.tgt_vocab_size)
    assert [r.hypotheses[0] for r in cut] != [[pieces[i] for i in ids] for ids in ours]


def aiayn_beam(ck, texts: list[str], **options) -> list[list[int]]:
    """aiayn's beam search (4), one sentence at a time; output ids without the final EOS."""
    config = DecodeConfig(beam=4, max_len_a=0.0, max_len_b=MAX_LEN, **options)
    out = []
    for text in texts:
        tokens = generate(ck.model, torch.tensor([ck.tokenizer.encode_src(text)]), config)[0][0].tokens
        out.append(tokens[:-1] if tokens[-1] == ck.tokenizer.eos_id else tokens)
    return out


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_beam_tokens_are_identical_with_power_lenpen_and_early_stopping(tmp_path, spm_models, alpha):
    """The README's settings for beams: aiayn's `lenpen_kind="power"` and `early_stopping=True` (a
    sentence ends once `beam` hypotheses ended, as in CTranslate2), CTranslate2's `length_penalty` the
    same alpha. A likelier EOS, so that hypotheses end at many lengths: at the length limit, as random
    models' all did, the length penalty and the stopping rule change nothing."""
    tokenizer = Tokenizer(spm_models[0])
    torch.manual_seed(0)
    model = random_model(tokenizer, **VARIANTS["marian-like"])
    with torch.no_grad():
        model.final_logits_bias[tokenizer.eos_id] += 8.0
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "ck"), str(tmp_path / "ct2")]) == 0
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    ck = load_checkpoint(tmp_path / "ck")
    texts = SENTENCES + SRC_LINES[:200:5]
    theirs = translate_tokens(translator, tokenizer, texts, beam_size=4, max_len=MAX_LEN,
                              length_penalty=alpha)
    assert theirs == aiayn_beam(ck, texts, lenpen=alpha, lenpen_kind="power", early_stopping=True)
    assert len({len(row) for row in theirs}) > 5  # ended at many lengths
    # the settings matter: aiayn's default stopping rule, or its default length penalty, finds others
    assert theirs != aiayn_beam(ck, texts, lenpen=alpha, lenpen_kind="power", early_stopping=False)
    assert theirs != aiayn_beam(ck, texts, lenpen=alpha, lenpen_kind="gnmt", early_stopping=True)


def test_an_empty_translation_is_kept(tmp_path, spm_models):
    """A model whose best output is EOS at once: CTranslate2's default min_decoding_length=1 forbade that
    and returned other tokens; translate_tokens asks for the search aiayn makes."""
    tokenizer = Tokenizer(spm_models[0])
    torch.manual_seed(0)
    model = random_model(tokenizer, **VARIANTS["marian-like"])
    with torch.no_grad():
        model.final_logits_bias[tokenizer.eos_id] = 30.0  # EOS first, whatever the source
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "ck"), str(tmp_path / "ct2")]) == 0
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    ck = load_checkpoint(tmp_path / "ck")
    assert aiayn_greedy(ck, SENTENCES) == [[]] * len(SENTENCES)
    assert translate_tokens(translator, tokenizer, SENTENCES, beam_size=1, max_len=MAX_LEN) == [[]] * len(SENTENCES)


@torch.no_grad()
def test_scores_match(exported):
    """CTranslate2's per-token log-probabilities of a forced target equal those aiayn's searches use:
    the model's, with padding excluded from the softmax."""
    ck, translator = exported
    tok = ck.tokenizer
    targets = [tok.encode_tgt(t) for t in ("die Zahl 12", "the number 3 is odd")]
    sources = [tok.src.encode(s, out_type=str) for s in SENTENCES[:2]]
    from aiayn.interop.ct2 import target_tokens

    names = target_tokens(tok, tok.tgt_vocab_size)
    results = translator.score_batch(sources, [[names[i] for i in t] for t in targets])
    for text, target, result in zip(SENTENCES, targets, results):
        src = torch.tensor([tok.encode_src(text)])
        tgt_in = torch.tensor([[ck.model.config.decoder_start_id] + target])  # (1, T + 1)
        logits = ck.model(src, tgt_in)[0]  # (T + 1, V)
        logp = logits.index_fill(1, torch.tensor([ck.model.config.pad_id]), float("-inf")).log_softmax(-1)
        ours = logp.gather(1, torch.tensor(target + [tok.eos_id])[:, None]).squeeze(1)  # tokens, then EOS
        torch.testing.assert_close(torch.tensor(result.log_probs), ours, atol=1e-4, rtol=0)


def test_an_export_from_python_is_never_written_inside_a_checkpoint(tmp_path, spm_models):
    """Only the CLI refused it: from Python an export went inside a run's checkpoint, and training's
    keep_last deleted it with that checkpoint, silently."""
    tokenizer = Tokenizer(spm_models[0])
    step = tmp_path / "run" / "checkpoints" / "step_000600"
    save_checkpoint(step, random_model(tokenizer), tokenizer)
    for out, said in ((step / "ct2", f"lies inside the checkpoint {step}"),
                      (step.parent / "ct2", "which training owns")):
        with pytest.raises(UserError, match=re.escape(said)):
            export_ctranslate2(step, out)
    assert sorted(p.name for p in step.parent.iterdir()) == ["step_000600"]
    (step.parent / "ct2").mkdir()  # there already: said as such, not "already exists (pass --force ...)"
    for force in (False, True):
        with pytest.raises(UserError, match="which training owns"):
            export_ctranslate2(step, step.parent / "ct2", force=force)


def test_existing_output_is_not_replaced(tmp_path, spm_models):
    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    (tmp_path / "ct2").mkdir()
    with pytest.raises(UserError, match="already exists"):
        export_ctranslate2(tmp_path / "ck", tmp_path / "ct2")
    with pytest.raises(UserError, match="quantization"):
        export_ctranslate2(tmp_path / "ck", tmp_path / "ct2", quantization="int3", force=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")  # --force replaced any directory, a run's too
    with pytest.raises(UserError, match="mine: holds files that are not a CTranslate2 model"):
        export_ctranslate2(tmp_path / "ck", tmp_path / "mine", force=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    export_ctranslate2(tmp_path / "ck", tmp_path / "ct2", force=True)  # an empty directory, then an export
    export_ctranslate2(tmp_path / "ck", tmp_path / "ct2", force=True)
    assert (tmp_path / "ct2" / "model.bin").is_file()
    # the SentencePiece model copied beside an export, as one deploys it, went with the export it replaced
    (tmp_path / "ct2" / "spm.model").write_bytes((tmp_path / "ck" / "spm.model").read_bytes())
    with pytest.raises(UserError, match="ct2: holds spm.model beside a CTranslate2 model; --force replaces "
                                        "the whole directory, so move them out first"):
        export_ctranslate2(tmp_path / "ck", tmp_path / "ct2", force=True)
    assert (tmp_path / "ct2" / "spm.model").is_file()
    (tmp_path / "link").symlink_to(tmp_path / "ct2")  # "exists and is not a directory": it points at one
    with pytest.raises(UserError, match="link: is a symbolic link; will not replace it"):
        export_ctranslate2(tmp_path / "ck", tmp_path / "link", force=True)


@pytest.mark.parametrize("force", [False, True])
def test_an_export_that_comes_while_exporting_is_replaced_only_with_force(tmp_path, spm_models, monkeypatch,
                                                                          force):
    """The check before the work refused an existing `out`; the write replaced one that came meanwhile
    (another export's), --force or not."""
    from aiayn.interop import ct2

    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    export_ctranslate2(tmp_path / "ck", tmp_path / "other")
    out, real = tmp_path / "ct2", ct2.AiaynConverter.convert

    def convert(self, *args, **kwargs):
        shutil.copytree(tmp_path / "other", out)
        (out / "theirs").write_text("")  # an export of their own, told apart by this mark
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ct2.AiaynConverter, "convert", convert)
    if force:
        export_ctranslate2(tmp_path / "ck", out, force=True)
        assert not (out / "theirs").exists() and (out / "model.bin").is_file()
    else:
        with pytest.raises(UserError, match=rf"^{out}: already exists \(pass --force"):
            export_ctranslate2(tmp_path / "ck", out)
        assert (out / "theirs").exists()


def test_export_says_it_put_back_a_killed_exports_output_and_leaves_a_users_dot_old(tmp_path, spm_models):
    """export set up no logging, so it never said what convert says (an output put back where a killed
    writer left it moved aside); and it took a user's '.ct2.old' backup for that, put back over ct2."""
    import subprocess
    import sys

    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    import aiayn

    command = [sys.executable, "-m", "aiayn", "export", "--to", "ctranslate2", "ck", "ct2"]
    env = {**os.environ, "PYTHONPATH": str(Path(aiayn.__file__).parents[1])}  # this aiayn, not another
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    # no notes but the one line said before the work (a `big` model's export took 12 s with no word)
    said = r"\d\d:\d\d:\d\d exporting ck to ct2 \(CTranslate2, float32 weights\)\n"
    assert first.returncode == 0 and re.fullmatch(said, first.stderr), first.stderr
    missing = subprocess.run(command[:-2] + ["missing", "out"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, check=False)  # its error alone, no "exporting" said before it
    assert missing.returncode == 2 and missing.stderr == "aiayn: error: missing: checkpoint not found\n"
    (tmp_path / "ct2").rename(tmp_path / ".ct2.aiayn-old")  # a kill between the renames of a --force
    (tmp_path / ".ct2.old").mkdir()
    (tmp_path / ".ct2.old" / "notes.txt").write_text("precious")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    note = r"\d\d:\d\d:\d\d ct2: put back, where a killed writer had left it as \.ct2\.aiayn-old\n"
    error = r"aiayn: error: ct2: already exists \(pass --force, force=True in Python, to replace it\)\n"
    assert re.fullmatch(note + error, proc.stderr), proc.stderr
    assert (tmp_path / ".ct2.old" / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ct2.old", "ck", "ct2"]


def files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_full_disk_keeps_the_old_export_and_leaves_nothing(tmp_path, spm_models, monkeypatch, capsys):
    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "ck"), str(tmp_path / "ct2")]) == 0
    before = files(tmp_path)

    def full(self, path):  # model.bin cut short, as on a full disk; config.json would come next
        with open(path, "wb") as f:
            f.write(b"\0" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ctranslate2.specs.model_spec.ModelSpec, "_serialize", full)
    for out, force in (("ct2", ["--force"]), ("new", [])):
        capsys.readouterr()
        assert main(["export", "--to", "ctranslate2", str(tmp_path / "ck"), str(tmp_path / out), *force]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"aiayn: error: {tmp_path / out}: could not write CTranslate2 model (No space left on device)"]
    assert files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ct2"]


def test_export_never_writes_over_its_checkpoint(tmp_path, spm_models):
    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "run" / "ck", random_model(tokenizer), tokenizer)
    before = files(tmp_path)
    for out, problem in (("run/ck", "is an aiayn checkpoint; write it elsewhere"),
                         ("run", "contains the input .*would delete the input")):
        with pytest.raises(UserError, match=f"{out}: {problem}"):
            export_ctranslate2(tmp_path / "run" / "ck", tmp_path / out, force=True)
    assert files(tmp_path) == before
    from aiayn.cli import main

    save_checkpoint(tmp_path / "other", random_model(tokenizer), tokenizer)  # training would prune it whole
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "run" / "ck"), str(tmp_path / "other" / "ct2")]) == 2
    assert not (tmp_path / "other" / "ct2").exists()
    export_ctranslate2(tmp_path / "run" / "ck", tmp_path / "ct2")  # and not inside an export, whose --force
    with pytest.raises(UserError, match=f"ct2/sub: lies inside {tmp_path / 'ct2'}, a CTranslate2 model; "):
        export_ctranslate2(tmp_path / "run" / "ck", tmp_path / "ct2" / "sub")  # it would then refuse
    (tmp_path / "ct2" / "sub").mkdir()  # existing: "already exists (pass --force ...)" came first
    with pytest.raises(UserError, match=f"ct2/sub: lies inside {tmp_path / 'ct2'}, a CTranslate2 model; "):
        export_ctranslate2(tmp_path / "run" / "ck", tmp_path / "ct2" / "sub")


def test_an_output_path_that_is_not_utf8_is_refused_before_any_work(tmp_path, spm_models, capsys):
    """ctranslate2.Translator cannot open such a path (a TypeError: a str with surrogates): it was written,
    exit 0, and then could not be served."""
    tokenizer = Tokenizer(spm_models[0])
    save_checkpoint(tmp_path / "ck", random_model(tokenizer), tokenizer)
    out = tmp_path / os.fsdecode(b"ct2_\xff")
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "ck"), str(out)]) == 2
    shown = str(tmp_path) + "/ct2_\\xff"  # the CLI writes an undecodable byte as an escape
    assert capsys.readouterr().err == (f"aiayn: error: {shown}: a path that is not valid UTF-8, which "
                                       "ctranslate2.Translator cannot open; rename it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_another_checkpoint_or_an_export_named_in_the_wrong_place_is_said_as_such(tmp_path, spm_models,
                                                                                capsys):
    """`export A B --force` of a checkpoint B said "B: is the checkpoint /abs/B", as if B were the input;
    an export given where a checkpoint is due was only "not an aiayn checkpoint (no meta.json)"."""
    tokenizer = Tokenizer(spm_models[0])
    for name in ("a", "b"):
        save_checkpoint(tmp_path / name, random_model(tokenizer), tokenizer)
    before = files(tmp_path)
    capsys.readouterr()
    assert main(["export", "--to", "ctranslate2", str(tmp_path / "a"), str(tmp_path / "b"), "--force"]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {tmp_path / 'b'}: is an aiayn checkpoint; write it " \
                                      "elsewhere\n"
    assert files(tmp_path) == before
    export_ctranslate2(tmp_path / "a", tmp_path / "ct2")
    (tmp_path / "ct2" / "spm.model").write_bytes((tmp_path / "a" / "spm.model").read_bytes())  # as deployed
    hint = ("not an aiayn checkpoint (no meta.json); a CTranslate2 model (what export writes): load it with "
            "ctranslate2.Translator, or name the aiayn checkpoint it was exported from")
    for argv in (["info", str(tmp_path / "ct2")],
                 ["export", "--to", "ctranslate2", str(tmp_path / "ct2"), str(tmp_path / "again")]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"aiayn: error: {tmp_path / 'ct2'}: {hint}\n"
    assert not (tmp_path / "again").exists()


def test_an_unknown_quantization_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    """It was found by CTranslate2's converter, after loading the checkpoint."""
    from aiayn.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["export", "--to", "ctranslate2", str(tmp_path / "none"), str(tmp_path / "out"),
              "--quantization", "int3"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int3'" in err and "checkpoint" not in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_the_cli_lists_ctranslate2s_own_weight_types():
    """`--quantization` choices are a copy (checked before ctranslate2 is imported): they must stay its list."""
    from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES

    from aiayn.cli import CT2_QUANTIZATIONS

    assert sorted(CT2_QUANTIZATIONS) == sorted(ACCEPTED_MODEL_TYPES)
