"""Attention extraction: weights are distributions over keys, respect the masks, are the ones the output
was computed from, and asking for them leaves the logits bit-identical."""

import dataclasses
import logging
import os
import re
import signal
import warnings
from pathlib import Path

import matplotlib
import pytest
import torch

from aiayn import attention
from aiayn.attention import attention_modules, extract_attention, record_attention
from aiayn.checkpoint import load_checkpoint, save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.decoding import Ensemble
from aiayn.errors import UserError
from aiayn.model.attention import merge_heads, split_heads
from conftest import padded_batch, tiny_model
from reference import naive_attention


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    en = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(300)]
    de = [f"die Zahl {i} ist {'gerade' if i % 2 == 0 else 'ungerade'}" for i in range(300)]
    shared = Tokenizer(train_sentencepiece(en + de, d / "shared", vocab_size=60))
    separate = Tokenizer(train_sentencepiece(en, d / "en", vocab_size=40),
                         train_sentencepiece(de, d / "de", vocab_size=50))
    return shared, separate


def test_weights_are_distributions_that_respect_the_masks():
    model = tiny_model()
    src = padded_batch([5, 3], 50)  # the second sentence has 2 pad positions
    tgt = padded_batch([4, 4], 50)
    with record_attention(model) as records, torch.no_grad():
        model(src, tgt)
    for kind in ("encoder", "decoder", "cross"):
        for layer in records[kind]:
            assert len(layer) == 1  # one forward pass, one record per module
            w = layer[0]  # (B, H, T, L)
            assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-6)
            if kind != "decoder":
                assert torch.all(w[1, :, :, 3:] == 0)  # no weight on the source padding
            else:
                assert torch.all(w.triu(diagonal=1) == 0)  # no weight on the future
    assert all(m.recorder is None for mods in attention_modules(model).values() for m in mods)


def test_only_the_recording_threads_calls_are_recorded():
    """A Translator's model translating in another thread meanwhile: its calls were recorded too, and
    `extract_attention` drew them as the sentence's (wrong maps, silently)."""
    import threading

    model = tiny_model()
    src, tgt = padded_batch([5, 3], 50), padded_batch([4, 4], 50)
    with record_attention(model) as records, torch.no_grad():
        other = threading.Thread(target=model, args=(src, tgt))
        other.start()
        other.join()
        assert all(layer == [] for kind in records.values() for layer in kind)
        model(src, tgt)
        theirs = []  # another thread recording meanwhile: its recorder replaced, then removed, this one's

        def record_twice():
            with record_attention(model) as records:
                model(src, tgt)
                model(src, tgt)
            theirs.append(records)

        other = threading.Thread(target=record_twice)
        other.start()
        other.join()
        model(src, tgt)
    assert all(len(layer) == 2 for kind in records.values() for layer in kind)
    assert all(len(layer) == 2 for kind in theirs[0].values() for layer in kind)
    assert all(m.recorder is None for mods in attention_modules(model).values() for m in mods)


def test_nested_recordings_each_get_every_call_made_while_open(tokenizers):
    """`extract_attention` inside a recording: its record replaced the outer's, which missed every later
    call and raised an AttributeError on exit (the inner's exit had removed the recorders)."""
    tokenizer = tokenizers[0]
    model = tiny_model(vocab_size=tokenizer.src_vocab_size)
    src, tgt = padded_batch([5, 3], 50), padded_batch([4, 4], 50)
    with record_attention(model) as outer, torch.no_grad():
        model(src, tgt)
        maps = extract_attention(model, tokenizer, "the number 12", "die Zahl 12")
        with record_attention(model) as inner:
            model(src, tgt)
        model(src, tgt)
    assert maps.encoder.shape[0] == model.config.n_layers
    assert all(len(layer) == 1 for kind in inner.values() for layer in kind)
    assert all(len(layer) == 4 for kind in outer.values() for layer in kind)  # extract's forward too
    assert torch.equal(outer["cross"][0][2], inner["cross"][0][0])
    assert all(m.recorder is None for mods in attention_modules(model).values() for m in mods)


@pytest.mark.parametrize("closed_first", [0, 1])
def test_recordings_closed_in_either_order_keep_their_own_records(closed_first):
    """Generators may close them out of order; each record is found by identity: two empty ones are equal."""
    model = tiny_model()
    src, tgt = padded_batch([5, 3], 50), padded_batch([4, 4], 50)
    recordings = [record_attention(model), record_attention(model)]
    records = [r.__enter__() for r in recordings]
    recordings[closed_first].__exit__(None, None, None)
    with torch.no_grad():
        model(src, tgt)
    recordings[1 - closed_first].__exit__(None, None, None)
    assert all(layer == [] for kind in records[closed_first].values() for layer in kind)
    assert all(len(layer) == 1 for kind in records[1 - closed_first].values() for layer in kind)
    assert all(m.recorder is None for mods in attention_modules(model).values() for m in mods)


def test_a_translators_packed_or_int8_model_is_drawn(tmp_path, tokenizers):
    """Its output projection is packed for oneDNN (or quantized): no `.weight` tensor to find the device."""
    from aiayn.translate import Translator

    tokenizer = tokenizers[0]
    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    plain = extract_attention(load_checkpoint(tmp_path / "ck").model, tokenizer, "the number 12",
                              "die Zahl 12")
    for int8 in (False, True):
        model = Translator.load(tmp_path / "ck", int8=int8).model
        maps = extract_attention(model, tokenizer, "the number 12", "die Zahl 12")
        assert maps.cross.shape == plain.cross.shape
        assert torch.allclose(maps.cross, plain.cross, atol=1e-5 if not int8 else 0.1)


def test_extracting_leaves_the_model_in_its_mode_and_names_a_wrong_type(tokenizers):
    """A model inspected in the middle of training was left in eval mode: it trained on without dropout."""
    tokenizer = tokenizers[0]
    model = tiny_model(vocab_size=tokenizer.src_vocab_size, dropout=0.1).train()
    maps = extract_attention(model, tokenizer, "the number 12 is even", "die Zahl 12 ist gerade")
    assert model.training and torch.allclose(maps.encoder.sum(-1), torch.ones(maps.encoder.shape[:-1]))
    for src, tgt, problem in ((b"the number", None, "src is bytes"), ("the number", ["die"], "tgt is list")):
        with pytest.raises(TypeError, match=f"^{problem}: one sentence, as a str$"):
            extract_attention(model, tokenizer, src, tgt)  # an AttributeError from deep inside
    model.eval()
    extract_attention(model, tokenizer, "the number 12 is even")
    assert not model.training
    ensemble = Ensemble([model, model]).eval()  # a Translator of several checkpoints holds one
    with pytest.raises(TypeError, match=r"^attention maps are of one model, not an Ensemble: pass a member"):
        extract_attention(ensemble, tokenizer, "the number 12 is even")  # 'Ensemble' has no 'tgt_embed'


def test_logits_unchanged_and_weights_are_those_the_output_used():
    model = tiny_model()
    src, tgt = padded_batch([6, 4], 50), padded_batch([5, 5], 50)
    with torch.no_grad():
        plain = model(src, tgt)
    seen = {}

    def keep(module, args, kwargs, output):
        seen[module] = (args, kwargs, output)

    modules = [m for mods in attention_modules(model).values() for m in mods]
    hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in modules]
    with record_attention(model) as records, torch.no_grad():
        recorded = model(src, tgt)
    for h in hooks:
        h.remove()
    assert torch.equal(plain, recorded)  # bit-identical: the weights are a side computation
    for kind, mods in attention_modules(model).items():
        for module, record in zip(mods, records[kind]):
            (x, *memory), kwargs, output = seen[module]
            if module.self_attention:
                _, _, v = module.qkv_proj(x).chunk(3, dim=-1)  # (B, T, H*D)
                v = split_heads(v, module.n_heads)
            else:
                _, v = module.project_kv(memory[0])  # (B, H, S, D)
            # The output is W^O (weights V): the recorded weights reproduce what the model computed.
            rebuilt = module.out_proj(merge_heads((record[0].double() @ v.double()).float()))
            assert torch.allclose(rebuilt, output, atol=1e-5), kind


def test_encoder_weights_equal_the_float64_formula():
    model = tiny_model()
    src = padded_batch([6, 3], 50)
    with record_attention(model) as records, torch.no_grad():
        model.encode(src)
        x = model.src_embed(src)
        q, k, _ = model.encoder[0].self_attn.qkv_proj(x).chunk(3, dim=-1)
        q, k = split_heads(q, model.config.n_heads), split_heads(k, model.config.n_heads)  # (B, H, S, D)
    eye = torch.eye(src.shape[1]).expand(*q.shape[:2], -1, -1)  # V = I turns the formula into its weights
    expected = naive_attention(q, k, eye, model.src_mask(src))
    assert torch.allclose(records["encoder"][0][0].double(), expected, atol=1e-6)


@pytest.mark.parametrize("which", ["shared", "separate"])
def test_extract_from_a_checkpoint(tmp_path, tokenizers, which):
    tokenizer = tokenizers[0] if which == "shared" else tokenizers[1]
    overrides = dict(vocab_size=tokenizer.src_vocab_size, n_decoder_layers=1, n_heads=2)
    if which == "separate":
        overrides.update(tgt_vocab_size=tokenizer.tgt_vocab_size, share_embeddings=False)
    save_checkpoint(tmp_path / "ck", tiny_model(**overrides), tokenizer)
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the number 12 is even", "die Zahl 12 ist gerade")
    s, t = len(maps.src_tokens), len(maps.tgt_out_tokens)
    assert maps.src_tokens == tokenizer.src_pieces("the number 12 is even") and maps.src_tokens[-1] == "</s>"
    assert maps.tgt_out_tokens[-1] == "</s>" and maps.tgt_in_tokens[0] == "<s>"
    assert maps.tgt_in_tokens[1:] == maps.tgt_out_tokens[:-1]
    assert maps.encoder.shape == (2, 2, s, s)
    assert maps.decoder.shape == (1, 2, t, t) and maps.cross.shape == (1, 2, t, s)
    with torch.no_grad():
        tgt_in = torch.tensor([[1] + tokenizer.encode_tgt("die Zahl 12 ist gerade")])
        src = torch.tensor([tokenizer.encode_src("the number 12 is even")])
        assert torch.equal(maps.logits, ck.model(src, tgt_in)[0])
    greedy = extract_attention(ck.model, ck.tokenizer, "the number 12 is even")  # no target: decode one
    assert greedy.cross.shape[2] == len(greedy.tgt_out_tokens) >= 1


def test_cli_draws_pngs_and_one_self_contained_page(tmp_path, tokenizers, capsys):
    tokenizer = tokenizers[0]
    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size, n_heads=2), tokenizer)
    out = tmp_path / "maps"
    argv = ["attention", "--checkpoint", str(tmp_path / "ck"), "--src", "the number 7", "--tgt", "die Zahl 7"]
    assert main(argv + ["--out", str(out)]) == 0
    for kind in ("encoder", "decoder", "cross"):
        assert (out / f"attention_{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "attention.html").read_text(encoding="utf-8")
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 3
    assert "http" not in page.replace("<!doctype html>", "")  # self-contained: nothing to fetch
    assert "attention.html" in capsys.readouterr().out
    assert main(["attention", "--checkpoint", str(tmp_path / "nope"), "--src", "x", "--out", str(out)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    long = " ".join(["7"] * 1100)  # more tokens than the model's 1,024 positions, and than a drawing's 100
    for side, args in (("the source", ["--src", long]), ("the target", ["--src", "7", "--tgt", long])):
        assert main(["attention", "--checkpoint", str(tmp_path / "ck"), *args, "--out", str(out)]) == 2
        # the lower limit: told the model's 1,024 positions, a user who trimmed to 1,000 was then told 100
        drawing = f"more than {attention.MAX_TOKENS}; attention maps of more tokens are unreadable"
        assert re.fullmatch(f"aiayn: error: {side}: \\d+ tokens \\(with EOS\\), {drawing}, so they are not "
                            "drawn\n",
                            capsys.readouterr().err)
        ck = load_checkpoint(tmp_path / "ck")  # not drawn (max_tokens=None): the model's positions, the limit
        with pytest.raises(UserError, match=f"^{side}: .*, more than the 1024 positions of this model$"):
            extract_attention(ck.model, ck.tokenizer, *args[1::2], max_tokens=None)


@pytest.mark.parametrize("twice, said", [
    (["--checkpoint", "a", "--checkpoint", "b"],
     "--checkpoint given twice (a, b): one model's attention a drawing; an ensemble has none of its own"),
    (["--src", "x", "--src", "y"], "--src given twice (x, y): one sentence pair a drawing"),
    (["--tgt", "x", "--tgt", "y"], "--tgt given twice (x, y): one sentence pair a drawing"),
    (["--layers", "1", "--layers", "2"],
     "--layers given twice ((1,), (2,)): list them in one, e.g. --layers 1,6"),
])
def test_an_option_given_twice_is_refused_not_replaced(capsys, twice, said):
    """`--checkpoint a --checkpoint b` drew b's attention alone, silently (translate takes both, as an
    ensemble); so did a second --src."""
    with pytest.raises(SystemExit) as e:
        main(["attention", *twice, "--checkpoint", "ck", "--src", "x"])  # refused at the second
    last = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and last == f"aiayn attention: error: {said} (see aiayn attention --help)"


def _draw_args(tmp_path, tokenizers):
    """A saved tiny checkpoint and the `aiayn attention` arguments that name it."""
    tokenizer = tokenizers[0]
    save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size, n_heads=2), tokenizer)
    return ["attention", "--checkpoint", str(tmp_path / "ck"), "--src", "the number 7", "--tgt", "die Zahl 7"]


def test_a_long_sentence_is_refused_before_the_model_runs(tmp_path, tokenizers, capsys, monkeypatch):
    argv = _draw_args(tmp_path, tokenizers)
    ran = []
    monkeypatch.setattr(attention, "record_attention", lambda model: ran.append(1))
    n = attention.MAX_TOKENS  # "the" is one piece: with EOS, one token more than the limit
    for args in (["--src", " ".join(["the"] * n)], ["--src", "7", "--tgt", " ".join(["the"] * n)]):
        assert main(argv[:3] + args + ["--out", str(tmp_path / "maps")]) == 2
        err = capsys.readouterr().err
        assert f"{n + 1} tokens (with EOS), more than {n}; attention maps of more tokens are unreadable" in err
        assert err.count("\n") == 1
    assert not ran and not (tmp_path / "maps").exists()
    monkeypatch.undo()
    ck = load_checkpoint(tmp_path / "ck")
    at_limit = " ".join(["the"] * (n - 1))
    maps = extract_attention(ck.model, ck.tokenizer, at_limit, at_limit)
    assert len(maps.src_tokens) == len(maps.tgt_out_tokens) == n


def test_a_greedy_translation_cut_at_its_limit_is_not_counted_with_an_eos(tmp_path, tokenizers, monkeypatch):
    """A model that repeats itself runs to the length limit, with no EOS: "(with EOS)" was said anyway, and
    draw_attention called it "the target"."""
    from aiayn.decoding.search import Hypothesis

    _draw_args(tmp_path, tokenizers)
    ck = load_checkpoint(tmp_path / "ck")
    n, piece = attention.MAX_TOKENS, ck.tokenizer.eos_id + 1
    eos = ck.tokenizer.eos_id
    for tokens, said in (([piece] * (n + 5), "the greedy translation: 105 tokens, more than"),
                         ([piece] * n + [eos], "the greedy translation: 101 tokens (with EOS)")):
        hyp = Hypothesis(tokens=tokens, score=0.0, log_prob=0.0)
        monkeypatch.setattr(attention, "generate", lambda *a, hyp=hyp, **k: [[hyp]])
        with pytest.raises(UserError, match=re.escape(said)):
            extract_attention(ck.model, ck.tokenizer, "the number 7")
        maps = extract_attention(ck.model, ck.tokenizer, "the number 7", max_tokens=None)  # the Python API's
        with pytest.raises(UserError, match=re.escape(said)):  # draw said "the target: 105 tokens (with EOS)"
            attention.draw_attention(maps, tmp_path / "maps")


def test_a_greedy_translation_cut_at_its_limit_is_said_so(tmp_path, tokenizers, monkeypatch, caplog):
    """Drawn as "the model's greedy translation", with nothing said, it passed for the model's whole
    answer."""
    from aiayn.decoding.search import Hypothesis

    _draw_args(tmp_path, tokenizers)
    ck = load_checkpoint(tmp_path / "ck")
    cut = Hypothesis(tokens=[ck.tokenizer.eos_id + 1] * 5, score=0.0, log_prob=0.0)
    monkeypatch.setattr(attention, "generate", lambda *a, **k: [[cut]])
    with caplog.at_level("WARNING", logger="aiayn"):
        maps = extract_attention(ck.model, ck.tokenizer, "the number 7")
    assert maps.target == "greedy_cut" and len(maps.tgt_out_tokens) == 5 and "</s>" not in maps.tgt_out_tokens
    assert caplog.messages == [("the greedy translation reached the length limit (5 tokens) without </s>: "
                                "the maps show it cut there")]
    page = attention.draw_attention(maps, tmp_path / "maps")["html"].read_text(encoding="utf-8")
    assert "the model's greedy translation, cut at the length limit without reaching &lt;/s&gt;" in page


def test_figure_stays_bounded_and_keeps_full_cells_when_small():
    assert attention.figure_layout(2, 2, 10, 10) == (attention.CELL_INCHES, 7.0)  # a short sentence: as before
    n = attention.MAX_TOKENS
    for layers, heads in ((2, 4), (6, 8), (6, 16), (12, 16)):
        cell, font = attention.figure_layout(layers, heads, n, n)
        assert cell * n * heads <= attention.MAX_FIGURE_INCHES + 1e-9
        assert cell * n * layers <= attention.MAX_FIGURE_INCHES + 1e-9
        assert font == pytest.approx(7.0 * cell / attention.CELL_INCHES)


@pytest.mark.parametrize("bad", ["file", "file/sub", "/proc/x", "/sys/attn_probe"])  # "": test_files
def test_an_unusable_out_is_one_line(tmp_path, tokenizers, capsys, monkeypatch, bad):
    """/proc/x and /sys/attn_probe, where root's mkdir fails, were refused after the model ran and drew."""
    argv = _draw_args(tmp_path, tokenizers)
    (tmp_path / "file").write_text("mine")
    monkeypatch.chdir(tmp_path)  # where an accepted "" would write
    ran = []
    monkeypatch.setattr(attention, "extract_attention", lambda *args: ran.append(1))
    out = str(tmp_path / bad) if bad in ("file", "file/sub") else bad
    assert main(argv + ["--out", out]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and err.count("\n") == 1 and out in err
    assert (tmp_path / "file").read_text() == "mine" and not list(tmp_path.glob("attention*"))
    assert not ran and (bad == "file" or not Path(out).exists())


def test_an_out_in_a_folder_the_user_may_not_write_in_is_refused_first(tmp_path, tokenizers, capsys,
                                                                        monkeypatch):
    """`--out /usr/maps` (no write permission there, or a read-only mount) failed after the drawing."""
    argv = _draw_args(tmp_path, tokenizers)
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access  # as root every folder is writable: os.access is made to say what it says to a user
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real(path, mode))
    ran = []
    monkeypatch.setattr(attention, "extract_attention", lambda *args: ran.append(1))
    for out, said in ((locked / "new" / "maps", f"{locked}, where it would be made, is not writable"),
                      (locked, "is not writable")):
        assert main(argv + ["--out", str(out)]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {out}: {said}\n"
    assert not ran and not list(locked.iterdir())
    monkeypatch.undo()
    new = tmp_path / "new" / "maps"  # made before the work, and removed again when it fails
    assert main(["attention", "--checkpoint", str(tmp_path / "nope"), "--src", "x", "--out", str(new)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err and not (tmp_path / "new").exists()


@pytest.mark.parametrize("name", ["map.png", "maps/Map.PDF", "a.svg", "page.html", "m.htm", "m.jpg",
                                  "m.jpeg"])
def test_an_out_named_as_a_file_is_refused_before_a_folder_of_that_name_is_made(tmp_path, tokenizers,
                                                                                capsys, name):
    """`--out map.png` made a folder map.png/ of the maps, silently."""
    argv = _draw_args(tmp_path, tokenizers)
    out = tmp_path / name
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"aiayn: error: {out}: names a file; --out (out_dir in Python) is the folder that gets "
                   f"attention_*.png and attention.html, such as {out.with_suffix('')}\n")
    assert not out.exists() and not (tmp_path / "maps").exists()


def test_an_existing_folder_with_a_files_suffix_is_an_out_as_any(tmp_path):
    assert attention.check_out_dir(f"{tmp_path / 'maps.png'}/") == tmp_path / "maps.png"  # a folder by its /
    (tmp_path / "maps.png").mkdir()  # made on purpose, or by an earlier version: the user's choice
    assert attention.check_out_dir(tmp_path / "maps.png") == tmp_path / "maps.png"
    assert attention.check_out_dir(tmp_path / "maps.v2") == tmp_path / "maps.v2"


def test_an_empty_out_is_refused_by_the_library_too():
    with pytest.raises(UserError, match="^the output folder name is empty$"):  # "" is the current directory
        attention.check_out_dir("")


def test_an_interrupted_rerun_leaves_the_old_maps_and_the_users_files(tmp_path, tokenizers, monkeypatch):
    argv = _draw_args(tmp_path, tokenizers) + ["--out", str(tmp_path / "maps")]
    assert main(argv) == 0
    (tmp_path / "maps" / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in (tmp_path / "maps").iterdir()}
    savefig = matplotlib.figure.Figure.savefig
    calls = []

    def ctrl_c_mid_second_picture(fig, fname, **kwargs):
        calls.append(fname)
        if len(calls) == 2:  # half a picture written, then Ctrl-C
            if isinstance(fname, str) or hasattr(fname, "__fspath__"):
                Path(fname).write_bytes(b"\x89PNG")
            else:
                fname.write(b"\x89PNG")
            raise KeyboardInterrupt
        return savefig(fig, fname, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", ctrl_c_mid_second_picture)
    assert main(argv[:4] + ["the number 8"] + argv[5:]) == 130  # the CLI's answer to Ctrl-C
    assert {p.name: p.read_bytes() for p in (tmp_path / "maps").iterdir()} == before  # no temporaries either


@pytest.mark.parametrize("signum, status, said", [(signal.SIGTERM, 143, "aiayn: stopped by SIGTERM"),
                                                   (signal.SIGINT, 130, "aiayn: interrupted")])
def test_a_stop_python_dropped_while_drawing_still_stops_and_keeps_the_old_set(
        tmp_path, tokenizers, capsys, monkeypatch, signum, status, said):
    """A SIGTERM or Ctrl-C landing while the garbage collector ran matplotlib's weakref callbacks raised
    there, where Python drops an exception ("Exception ignored in: <function WeakKeyDictionary...remove>"):
    the drawing ran on, replaced the old set, printed its paths and exited 0. Here the signal's handler
    runs inside a weakref callback, as an object dies during the second picture."""
    import weakref

    argv = _draw_args(tmp_path, tokenizers) + ["--out", str(tmp_path / "maps")]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "maps").iterdir()}
    capsys.readouterr()
    savefig, calls = matplotlib.figure.Figure.savefig, []

    def signal_while_an_object_is_freed(fig, fname, **kwargs):
        calls.append(fname)
        if len(calls) == 2:
            freed = type("Freed", (), {})()
            ref = weakref.ref(freed, lambda _: signal.raise_signal(signum))  # the handler runs in there
            del freed
            assert ref() is None
        return savefig(fig, fname, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", signal_while_an_object_is_freed)
    assert main(argv[:4] + ["the number 8"] + argv[5:]) == status
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == said and captured.out == ""
    assert "Exception ignored" not in captured.err
    assert {p.name: p.read_bytes() for p in (tmp_path / "maps").iterdir()} == before  # no temporaries either


def test_a_full_disk_on_the_last_file_leaves_the_old_set(tmp_path, tokenizers, monkeypatch):
    """Each file was renamed into place as soon as it was written: a full disk on attention.html left the
    new drawing's PNGs beside the old drawing's page."""
    import errno

    import aiayn.files

    argv = _draw_args(tmp_path, tokenizers) + ["--out", str(tmp_path / "maps")]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "maps").iterdir()}
    fsync = aiayn.files.os.fsync
    synced = []

    def full_on_the_html(fd):
        synced.append(fd)
        if len(synced) == 4:  # three PNGs written, then the page
            raise OSError(errno.ENOSPC, "No space left on device")
        return fsync(fd)

    monkeypatch.setattr(aiayn.files.os, "fsync", full_on_the_html)
    monkeypatch.setattr(attention.os, "fsync", full_on_the_html)
    assert main(argv[:4] + ["the number 8"] + argv[5:]) == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "maps").iterdir()} == before  # no temporaries either
    synced.clear()  # a new folder: the folders made for it go too
    assert main(argv[:4] + ["the number 8"] + argv[5:-1] + [str(tmp_path / "new" / "maps")]) == 2
    assert not (tmp_path / "new").exists()


def test_empty_sentences_are_refused_and_unknown_pieces_labelled_unk(tmp_path, tokenizers, capsys):
    argv = _draw_args(tmp_path, tokenizers)
    for args, side in ((["--src", ""], "source"), (["--src", "   "], "source"), (["--src", "7", "--tgt", ""], "target")):
        assert main(argv[:3] + args + ["--out", str(tmp_path / "maps")]) == 2
        assert f"error: the {side} is empty" in (err := capsys.readouterr().err) and err.count("\n") == 1
    # Undecodable command-line bytes reach Python as lone surrogates (surrogateescape)
    for args, side in ((["--src", "7\udcff"], "source"), (["--src", "7", "--tgt", "\udcff"], "target")):
        assert main(argv[:3] + args + ["--out", str(tmp_path / "maps")]) == 2
        assert f"error: the {side}: not valid Unicode" in (err := capsys.readouterr().err) and err.count("\n") == 1
    assert not (tmp_path / "maps").exists()
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the 😀 number 中", "die Zahl")
    assert maps.src_tokens == ["▁the", "▁", "<unk>", "▁number", "▁", "<unk>", "</s>"]  # as the model read them
    known = dataclasses.replace(maps, src_tokens=["▁the", "▁", "😀", "▁number", "▁", "中", "</s>"])  # in a vocabulary
    with warnings.catch_warnings(record=True) as seen:  # no "Glyph missing" warning escapes the drawing
        warnings.simplefilter("always")
        attention.draw_attention(known, tmp_path / "maps")
    assert [str(w.message) for w in seen if "Glyph" in str(w.message)] == []


def test_label_characters_no_font_has_are_named_once(tmp_path, tokenizers, monkeypatch, caplog):
    """Boxes instead of Chinese labels, silently, sent users to the PNG with no hint that the HTML
    page has the pieces as text."""
    _draw_args(tmp_path, tokenizers)  # saves the checkpoint
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the number 12", "die Zahl")
    labels = ["▁中", "文"] + maps.src_tokens[2:]  # pieces of a vocabulary that has them
    known = dataclasses.replace(maps, src_tokens=labels)
    monkeypatch.setattr(attention, "label_fonts", lambda: ["DejaVu Sans"])  # whatever else is installed
    with caplog.at_level(logging.WARNING, logger="aiayn.attention"):
        attention.draw_attention(known, tmp_path / "maps")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("2 label character(s) (中文) are in no installed font")
    assert "▁中 文" in (tmp_path / "maps" / "attention.html").read_text(encoding="utf-8")


def test_labels_are_text_not_matplotlib_math(tmp_path, tokenizers):
    """A piece with dollar signs (LaTeX in the training text) made matplotlib parse math: "$$" raised
    in the middle of drawing, "$x$" was drawn as an italic x."""
    argv = _draw_args(tmp_path, tokenizers)
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the number 7", "die Zahl 7")
    pieces = ["$$", "$x$", r"$\frac$", "a_b$^$"][: len(maps.src_tokens)]
    dollars = dataclasses.replace(maps, src_tokens=pieces + maps.src_tokens[len(pieces):])
    files = attention.draw_attention(dollars, tmp_path / "maps")
    assert files["cross"].read_bytes()[:4] == b"\x89PNG"
    assert main(argv + ["--out", str(tmp_path / "cli")]) == 0


def test_layers_and_heads_can_be_chosen_and_keep_their_numbers(tmp_path, tokenizers, capsys, caplog):
    argv = _draw_args(tmp_path, tokenizers)
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the number 7", "die Zahl 7")
    some = maps.select(layers=[2], heads=[1, 2])
    for kind in ("encoder", "decoder", "cross"):
        assert torch.equal(some.weights(kind), maps.weights(kind)[[1]][:, [0, 1]])
        assert some.layer_numbers(kind) == (2,) and maps.layer_numbers(kind) == (1, 2)
    assert some.head_numbers() == (1, 2)
    twice = maps.select(layers=[2, 2], heads=[2, 1, 2])  # a number given twice is drawn once
    assert twice.layer_numbers("encoder") == (2,) and twice.head_numbers() == (2, 1)
    with pytest.raises(UserError, match="layer 3: choose layers from 1 to 2"):
        maps.select(layers=[3])
    with pytest.raises(UserError, match="head 9: choose heads from 1 to"):
        maps.select(heads=[9])
    with caplog.at_level(logging.INFO, logger="aiayn.attention"):
        assert main(argv + ["--layers", "2", "--heads", "1", "--out", str(tmp_path / "one")]) == 0
    assert "drawing the encoder self-attention (1 layer x 1 head)" in caplog.messages  # not "1 layers"
    with pytest.raises(SystemExit) as e:
        main(argv + ["--layers", "0", "--out", str(tmp_path / "none")])
    assert e.value.code == 2
    assert "invalid comma-separated list of positive integers value: '0'" in capsys.readouterr().err


def test_a_layer_or_head_the_model_lacks_is_refused_before_it_translates(tmp_path, tokenizers, capsys,
                                                                          monkeypatch):
    """--heads 5 on a 4-head model was refused only after the greedy translation had run (seconds on a big
    model): the counts are in the checkpoint's config."""
    argv = _draw_args(tmp_path, tokenizers)
    monkeypatch.setattr(attention, "extract_attention", lambda *a, **k: pytest.fail("the model ran"))
    for flag, said in (("--heads", "head 9: choose heads from 1 to"), ("--layers", "layer 3: choose layers")):
        assert main(argv + [flag, "3" if flag == "--layers" else "9", "--out", str(tmp_path / "maps")]) == 2
        assert said in capsys.readouterr().err


def test_the_page_says_which_target_the_decoder_read(tmp_path, tokenizers):
    _draw_args(tmp_path, tokenizers)
    ck = load_checkpoint(tmp_path / "ck")
    given = extract_attention(ck.model, ck.tokenizer, "the number 7", "die Zahl 7")
    greedy = extract_attention(ck.model, ck.tokenizer, "the number 7")
    assert given.target == "given"  # the untrained model's own can run to the limit: the page says so
    assert greedy.target == ("greedy" if greedy.tgt_out_tokens[-1] == "</s>" else "greedy_cut")
    page = attention.draw_attention(greedy, tmp_path / "maps")["html"].read_text(encoding="utf-8")
    assert "the model's greedy translation" in page


def test_a_source_of_no_pieces_and_a_directory_in_the_way_are_refused(tmp_path, tokenizers, capsys):
    argv = _draw_args(tmp_path, tokenizers)
    assert main(argv[:3] + ["--src", "\u200b", "--out", str(tmp_path / "maps")]) == 2  # was a 1 x 1 map of EOS
    assert "the source has no piece the tokenizer reads" in capsys.readouterr().err
    assert main(argv[:3] + ["--src", "the number 7", "--tgt", "\u200b", "--out", str(tmp_path / "maps")]) == 2
    assert "the target has no piece the tokenizer reads" in capsys.readouterr().err  # was a map of EOS alone
    for inside in ("ck", "ck/maps"):  # PNGs among the weights, which a run's keep_last deletes
        assert main(argv[:3] + ["--src", "the number 7", "--out", str(tmp_path / inside)]) == 2
        said = capsys.readouterr().err
        assert ("is an aiayn checkpoint;" if inside == "ck" else "lies inside the checkpoint") in said, said
        assert not (tmp_path / "ck" / "maps").exists()
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the number 7", "die Zahl 7")
    # draw_attention from Python drew there
    with pytest.raises(UserError, match="lies inside the checkpoint"):
        attention.draw_attention(maps, tmp_path / "ck" / "maps")
    assert not (tmp_path / "ck" / "maps").exists()
    (tmp_path / "maps" / "attention_cross.png").mkdir(parents=True)
    (tmp_path / "maps" / "attention_encoder.png").write_bytes(b"old")
    with pytest.raises(UserError, match="attention_cross.png: is a directory"):
        attention.draw_attention(maps, tmp_path / "maps")
    assert (tmp_path / "maps" / "attention_encoder.png").read_bytes() == b"old"  # nothing replaced


def test_a_layer_only_the_deeper_stack_has_is_drawn_there_alone(tmp_path, tokenizers, capsys):
    """A Marian-style student (3 encoder layers, 1 decoder layer): --layers 3 was refused ("choose layers
    from 1 to 1"), so its encoder's last layer could not be drawn on its own."""
    tokenizer = tokenizers[0]
    model = tiny_model(vocab_size=tokenizer.src_vocab_size, n_heads=2, n_layers=3, n_decoder_layers=1)
    save_checkpoint(tmp_path / "ck", model, tokenizer)
    ck = load_checkpoint(tmp_path / "ck")
    maps = extract_attention(ck.model, ck.tokenizer, "the number 7", "die Zahl 7")
    some = maps.select(layers=[1, 3])
    assert torch.equal(some.encoder, maps.encoder[[0, 2]]) and torch.equal(some.cross, maps.cross[[0]])
    assert (some.layer_numbers("encoder"), some.layer_numbers("decoder")) == ((1, 3), (1,))
    with pytest.raises(UserError, match="layer 4: choose layers from 1 to 3"):
        maps.select(layers=[4])
    out = tmp_path / "maps"
    attention.draw_attention(maps, out)  # all three kinds, then a drawing of encoder layer 3 alone
    files = attention.draw_attention(maps.select(layers=[3]), out)
    assert set(files) == {"encoder", "html"}
    assert sorted(p.name for p in out.iterdir()) == ["attention.html", "attention_encoder.png"]
    assert "this stack has no layer 3" in files["html"].read_text(encoding="utf-8")
    argv = ["attention", "--checkpoint", str(tmp_path / "ck"), "--src", "the number 7", "--layers", "3"]
    assert main(argv + ["--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "attention_encoder.png").exists()
    assert not (tmp_path / "cli" / "attention_cross.png").exists()
