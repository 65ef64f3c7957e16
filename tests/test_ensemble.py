"""Ensemble decoding against the definition: the mean of the members' probabilities, each member's
computed by a full uncached forward pass; and the invariants an ensemble of one model must keep."""

from types import SimpleNamespace

import pytest
import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.decoding import DecodeConfig, generate
from aiayn.decoding import Ensemble
from aiayn.decoding.score import force_decode
from aiayn.errors import UserError
from aiayn.translate import Translator, check_ensemble
from conftest import padded_batch, tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


def two_models():
    torch.manual_seed(0)
    a = tiny_model()
    torch.manual_seed(1)
    b = tiny_model(d_model=16, d_ff=32, n_layers=3)  # members may differ in shape, not in vocabulary
    return a, b


def ensemble_log_prob(models, src, tokens, min_len=0):
    """log P(tokens | src) with P = the mean of the members' own step distributions, from one full
    float64 forward pass per member: each member's padding (and EOS before `min_len` tokens) removed
    and renormalized, as a single model's search removes them."""
    tgt_in = torch.tensor([[models[0].config.decoder_start_id] + tokens[:-1]])
    with torch.no_grad():
        probs = torch.stack([m(src[None], tgt_in)[0].double().softmax(-1) for m in models])  # (M, T, V)
    probs[:, :, models[0].config.pad_id] = 0.0
    probs[:, :min_len, models[0].config.eos_id] = 0.0
    probs = (probs / probs.sum(-1, keepdim=True)).mean(0)  # (T, V)
    return probs.gather(1, torch.tensor(tokens)[:, None]).log().sum().item()


def sure_of_the_end():
    """Two members, the first with much of its probability on padding and EOS (a logits bias): averaged
    before they are removed, the first member counted for less than the second."""
    torch.manual_seed(0)
    a = tiny_model(final_logits_bias=True)
    a.final_logits_bias[[a.config.pad_id, a.config.eos_id]] = torch.tensor([3.0, 4.0])
    torch.manual_seed(1)
    return a, tiny_model(d_model=16, d_ff=32, n_layers=3)


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("min_len", [0, 4])
def test_each_member_is_renormalized_before_the_mean(beam, min_len):
    """Pad (and EOS under min_len) were masked on the mean of the members' full distributions, which
    weighted each member by 1 - P_m(pad) - P_m(EOS): 0.04 nats off here, 1.2 with min_len 4. Forced
    decoding agrees."""
    models = sure_of_the_end()
    src = padded_batch([5, 3, 7], 50)
    config = DecodeConfig(beam=beam, n_best=beam, max_len_a=0.0, max_len_b=8, min_len=min_len)
    ensemble = Ensemble(models)
    results = generate(ensemble, src, config)
    rows = [i for i, hyps in enumerate(results) for _ in hyps]
    for i, hyps in enumerate(results):
        n = int((src[i] != 0).sum())
        for h in hyps:
            assert len(h.tokens) > min_len
            expected = ensemble_log_prob(models, src[i, :n], h.tokens, min_len)
            assert h.log_prob == pytest.approx(expected, abs=1e-4)
    if min_len == 0:  # forced decoding never forbids EOS
        scored = force_decode(ensemble, src[rows], [h.tokens for hyps in results for h in hyps])
        assert scored == pytest.approx([h.log_prob for hyps in results for h in hyps], abs=1e-4)


@pytest.mark.parametrize("beam", [1, 3])
def test_ensemble_scores_are_the_mean_of_the_members_probabilities(beam):
    models = two_models()
    src = padded_batch([5, 3, 7], 50)
    config = DecodeConfig(beam=beam, n_best=beam, max_len_a=0.0, max_len_b=8)
    results = generate(Ensemble(models), src, config)
    for i, hyps in enumerate(results):
        n = int((src[i] != 0).sum())
        for h in hyps:
            expected = ensemble_log_prob(models, src[i, :n], h.tokens)
            assert h.log_prob == pytest.approx(expected, abs=1e-4)
            for m in models:  # so the check would see an ensemble that followed one member only
                assert abs(ensemble_log_prob([m], src[i, :n], h.tokens) - expected) > 1e-2


def test_ensemble_of_one_model_or_of_a_model_with_itself_translates_as_the_model():
    model = two_models()[0]
    src = padded_batch([5, 2, 7], 50)
    config = DecodeConfig(beam=4, n_best=2, max_len_a=1.0, max_len_b=4)
    expected = generate(model, src, config)
    for ensemble in (Ensemble([model]), Ensemble([model, model])):
        got = generate(ensemble, src, config)
        assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in expected]
        assert [h.score for hs in got for h in hs] == pytest.approx([h.score for hs in expected for h in hs], abs=1e-5)


def test_what_is_no_list_of_transformers_is_refused_and_an_ensemble_has_no_forward():
    """Ensemble(model) was "'Transformer' object is not subscriptable", Ensemble([1, 2]) "'int' object has no
    attribute 'config'", and calling one torch's "missing the required forward function"."""
    model = tiny_model()
    with pytest.raises(TypeError, match=r"^Ensemble takes a list of Transformers, not one Transformer: pass "
                                        r"\[model_1, model_2, \.\.\.\]$"):
        Ensemble(model)
    with pytest.raises(TypeError, match=r"^ensemble member 1 is int: an Ensemble takes a list of Transformers$"):
        Ensemble([1, 2])
    assert len(Ensemble(m for m in (model, model)).members) == 2  # a generator is read once
    # torch's containers of Transformers and compiled members are lists of Transformers (a check refused
    # them); a lone compiled model or an Ensemble is not
    ensemble = Ensemble(torch.nn.ModuleList([model, model, model]))
    for models in (torch.nn.Sequential(model, model), ensemble.members, ensemble.members[:2],
                   [torch.compile(model), model]):  # wrapping compiles nothing: cheap
        assert len(Ensemble(models).members) == len(models)
    for lone, kind in ((torch.compile(model), "Transformer"), (ensemble, "Ensemble")):
        with pytest.raises(TypeError, match=f"^Ensemble takes a list of Transformers, not one {kind}: "):
            Ensemble(lone)
    src = padded_batch([3], 50)
    with pytest.raises(TypeError, match=r"^an Ensemble has no forward: it decodes only, through "
                                        r"aiayn\.decoding\.generate\(ensemble, src, config\)"):
        Ensemble([model, model])(src, torch.tensor([[1, 5]]))


def test_members_with_different_vocabularies_are_refused():
    with pytest.raises(ValueError, match="member 2 differs from member 1 in vocab_size"):
        Ensemble([tiny_model(), tiny_model(vocab_size=60)])


def test_python_ensemble_says_a_shared_and_a_separate_vocabulary_as_such():
    """Ensemble([...]) said a shared and a separate vocabulary "differs ... in tgt_vocab_size", as
    check_ensemble once did: None is no size."""
    shared = tiny_model()
    separate = tiny_model(tgt_vocab_size=shared.config.vocab_size, share_embeddings=False)
    with pytest.raises(ValueError, match="^ensemble member 2 has separate source and target vocabularies, "
                                         "member 1 one vocabulary shared by source and target; "):
        Ensemble([shared, separate])


def test_a_shared_and_a_separate_vocabulary_are_said_as_such():
    """A model of one shared vocabulary (tgt_vocab_size None) and one of separate source and target
    vocabularies of the same size were said to differ "in tgt_vocab_size"."""
    shared = tiny_model()
    separate = tiny_model(tgt_vocab_size=shared.config.vocab_size, share_embeddings=False)
    one, two = "one vocabulary shared by source and target", "separate source and target vocabularies"
    for paths, models, said in ((["a", "b"], [shared, separate], f"b: has {two}, a {one}"),
                                (["b", "a"], [separate, shared], f"a: has {one}, b {two}")):
        with pytest.raises(UserError, match=f"^{said}; an ensemble's models must agree on the vocabulary$"):
            check_ensemble(paths, [SimpleNamespace(model=m) for m in models])  # before any tokenizer


def test_translator_and_cli_load_several_checkpoints_as_an_ensemble(tmp_path, monkeypatch, capsys):
    lines = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(200)]
    tokenizer = Tokenizer(train_sentencepiece(lines, tmp_path / "spm", vocab_size=40))
    models = [tiny_model(vocab_size=tokenizer.src_vocab_size) for _ in range(2)]
    ckpts = [save_checkpoint(tmp_path / f"ck{i}", m, tokenizer) for i, m in enumerate(models)]
    options = dict(beam=2, max_len_a=0.0, max_len_b=5)
    translator = Translator.load(ckpts)
    src = torch.tensor([tokenizer.encode_src("the number 4")])
    best = generate(Ensemble(models), src, DecodeConfig(**options))[0][0]
    assert translator.translate(["the number 4"], **options) == [tokenizer.decode_tgt(best.tokens)]

    (tmp_path / "in.txt").write_text("the number 4\n\nthe number 5\n")
    assert main(["translate", *map(str, ckpts), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt"),
                 "--beam", "2", "--max-len-a", "0", "--max-len-b", "5", "-q"]) == 0
    out = (tmp_path / "out.txt").read_text().split("\n")
    assert out[0] == tokenizer.decode_tgt(best.tokens) and out[1] == "" and len(out) == 4

    other = Tokenizer(train_sentencepiece([s.replace("number", "count") for s in lines], tmp_path / "o", vocab_size=40))
    odd = save_checkpoint(tmp_path / "odd", tiny_model(vocab_size=other.src_vocab_size), other)
    with pytest.raises(UserError, match="odd: its tokenizer differs"):
        Translator.load([ckpts[0], odd])

    short = save_checkpoint(tmp_path / "short", tiny_model(vocab_size=tokenizer.src_vocab_size, max_len=4),
                            tokenizer)
    with pytest.raises(UserError, match=r"tokens \(with EOS\), more than the 4 positions of the ensemble's "
                                        r"shortest model$"):  # "of this model": which one?
        Translator.load([ckpts[0], short]).translate(["the number 4 is even"])
