"""Scores are sacreBLEU's (checked against a BLEU computed by hand), with signatures and clear labels."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.evaluate import LOWERCASE_LABEL, corpus_scores, evaluate_files, ter_metric


def test_bleu_equals_the_hand_computed_value():
    # 13a tokens: The cat sat on the mat . | The cat sat on a mat . -> n-gram precisions 6/7, 4/6, 2/5, 1/4,
    # equal lengths so no brevity penalty: BLEU = (6/7 * 4/6 * 2/5 * 1/4) ** (1/4).
    bleu, chrf, lowercased = corpus_scores(["The cat sat on the mat."], [["The cat sat on a mat."]])
    assert bleu.name == "BLEU"
    assert bleu.score == pytest.approx(100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25, abs=1e-6)
    assert "case:mixed" in bleu.signature and "tok:13a" in bleu.signature and "version:" in bleu.signature
    assert chrf.name == "chrF2" and "nc:6" in chrf.signature and 0 < chrf.score < 100
    assert lowercased.name == LOWERCASE_LABEL.format("13a") and "case:lc" in lowercased.signature


def test_chrf_plus_plus_ter_and_confidence_intervals_are_sacrebleus(tmp_path, capsys):
    from sacrebleu.metrics import BLEU, CHRF

    # TER by hand: tercom lowercases and splits on spaces, "the" -> "a" is 1 edit for 6 reference words
    hyp, ref = ["The cat sat on the mat."], [["The cat sat on a mat."]]
    bleu, chrf, _, ter = corpus_scores(hyp, ref, chrf_word_order=2, ter=True)
    assert ter.name == "TER" and ter.score == pytest.approx(100 / 6) and "tok:tercom" in ter.signature
    assert chrf.name == "chrF2++" and "nw:2" in chrf.signature
    assert chrf.score == pytest.approx(CHRF(word_order=2).corpus_score(hyp, ref).score) != corpus_scores(hyp, ref)[1].score
    hyps = [f"the number {i} is {'even' if i % 3 else 'odd'}" for i in range(60)]
    refs = [[f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(60)]]
    scored = corpus_scores(hyps, refs, confidence=200)
    theirs = BLEU().corpus_score(hyps, refs, n_bootstrap=200)  # sacreBLEU's fixed seed: the same resamples
    assert scored[0].score == pytest.approx(theirs.score) and scored[0].ci == pytest.approx(theirs._ci)
    assert theirs._ci > 0
    assert "bs:200" in scored[0].signature and all(s.ci is not None for s in scored)
    assert corpus_scores(hyps, refs)[0].ci is None
    (tmp_path / "hyp").write_text("\n".join(hyps) + "\n")
    (tmp_path / "ref").write_text("\n".join(refs[0]) + "\n")
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--ter", "--confidence", "200",
                 "--chrf-word-order", "2"]) == 0
    out = capsys.readouterr().out
    assert f"BLEU: {theirs.score:.2f} (95% CI +/- {theirs._ci:.2f})" in out and "chrF2++: " in out and "TER: " in out
    with pytest.raises(SystemExit):  # the optional N took HYP: "invalid int value: 'HYP'"
        main(["evaluate", "--confidence", str(tmp_path / "hyp"), str(tmp_path / "ref")])
    assert capsys.readouterr().err == (
        f"aiayn evaluate: error: argument --confidence: '{tmp_path / 'hyp'}' is not a number of resamples "
        "(N); put --confidence after HYP and REF, or give N (see aiayn evaluate --help)\n")
    argv = ["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--confidence", "200", "--json"]
    assert main(argv) == 0
    scores = json.loads(capsys.readouterr().out)  # sacreBLEU's numpy float32 was a TypeError traceback
    assert scores[0]["ci"] == pytest.approx(float(theirs._ci)) and type(scored[0].ci) is float


def test_lowercased_bleu_ignores_case_and_is_labelled():
    hyps, refs = ["The Cat Sat On The Mat Today"], [["the cat sat on the mat today"]]
    bleu, _, lowercased = corpus_scores(hyps, refs)
    assert lowercased.score == pytest.approx(100.0) and bleu.score < 50
    assert "older papers" in LOWERCASE_LABEL and "not comparable" in LOWERCASE_LABEL


def test_a_chinese_target_is_scored_on_characters_with_lang_zh(tmp_path, capsys):
    """13a splits no unspaced Chinese: each line is one "word", so one different character scores 0.
    sacreBLEU's zh tokenizer splits the characters: 8/9, 6/8, 4/7 and 3/6 n-gram precisions, equal lengths."""
    hyp, ref = ["我们今天去公园散步"], [["我们明天去公园散步"]]
    assert corpus_scores(hyp, ref)[0].score == 0.0
    bleu, _, lowercased = corpus_scores(hyp, ref, lang="zh")
    assert bleu.score == pytest.approx(100 * (8 / 9 * 6 / 8 * 4 / 7 * 3 / 6) ** 0.25, abs=1e-6)
    assert "tok:zh" in bleu.signature and lowercased.name == LOWERCASE_LABEL.format("zh")
    assert corpus_scores(hyp, ref, tokenize="char")[0].score == pytest.approx(bleu.score)
    (tmp_path / "hyp").write_text(hyp[0] + "\n", encoding="utf-8")
    (tmp_path / "ref").write_text(ref[0][0] + "\n", encoding="utf-8")
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "-l", "zh"]) == 0
    assert f"BLEU: {bleu.score:.2f}" in capsys.readouterr().out
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--tokenize", "nope"]) == 2
    assert "aiayn: error: --tokenize nope is not one of sacreBLEU's: none, zh, 13a" in capsys.readouterr().err
    if importlib.util.find_spec("MeCab") is None:  # sacreBLEU's ja tokenizer needs sacrebleu[ja]
        assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "-l", "ja"]) == 2
        err = capsys.readouterr().err
        assert err == ("aiayn: error: sacreBLEU's ja-mecab tokenizer needs packages missing here: pip "
                       "install 'sacrebleu[ja]'\n")


@pytest.mark.parametrize("args, tokenizer", [(["-l", "ja"], "ja-mecab"), (["-l", "kor"], "ko-mecab"),
                                             (["--tokenize", "ja-mecab"], "ja-mecab")])
def test_a_tokenizer_missing_its_packages_is_named_as_sacrebleu_names_it(tmp_path, capsys, monkeypatch, args,
                                                                         tokenizer):
    """-l ja said "sacreBLEU's ja tokenizer needs ...: pip install sacrebleu[ja]": -l ja picks ja-mecab,
    and a shell globs the unquoted brackets. sacreBLEU's error where MeCab is missing, made here too."""
    from sacrebleu.metrics import bleu

    def missing(name):
        language = "Japanese" if name == "ja-mecab" else "Korean"
        raise RuntimeError(f"\n{language} tokenization requires extra dependencies, but you do not have "
                           "them installed.\nPlease install them like so.\n\n    pip install "
                           f"sacrebleu[{name[:2]}]\n")

    monkeypatch.setattr(bleu, "_get_tokenizer", missing)
    (tmp_path / "hyp").write_text("今日は\n", encoding="utf-8")
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "hyp"), *args]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: sacreBLEU's {tokenizer} tokenizer needs packages "
                                       f"missing here: pip install 'sacrebleu[{tokenizer[:2]}]'\n")


def test_several_references_and_line_counts(tmp_path):
    hyp, ref1, ref2 = tmp_path / "hyp", tmp_path / "ref1", tmp_path / "ref2"
    hyp.write_text("a b c d e\nf g h i j\n")
    ref1.write_text("a b c d e\nx y z w v\n")
    ref2.write_text("q q q q q\nf g h i j\n")
    assert evaluate_files(hyp, [ref1, ref2])[0].score == pytest.approx(100.0)  # each line matches a reference
    assert evaluate_files(hyp, [ref1])[0].score < 100
    ref1.write_text("a b c d e\n")
    with pytest.raises(UserError, match="hyp:2: line counts differ: .*ref1 has 1 line, .*hyp has 2$"):
        evaluate_files(hyp, [ref1])
    with pytest.raises(UserError, match=r"^-: only the translations \(HYP\) may come from standard input"):
        evaluate_files(hyp, [ref1, "-"])  # was "-: file not found"
    hyp.write_text("")
    ref1.write_text("")
    with pytest.raises(UserError, match="hyp: empty, nothing to score"):
        evaluate_files(hyp, [ref1])


def test_cli_prints_scores_and_signatures(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("The cat sat on the mat.\n")
    ref.write_text("The cat sat on a mat.\n")
    assert main(["evaluate", str(hyp), str(ref)]) == 0
    out = capsys.readouterr().out
    assert "BLEU: 48.89" in out and "signature: nrefs:1|case:mixed" in out
    assert "chrF2:" in out and "BLEU-lc" in out
    assert main(["evaluate", str(hyp), str(ref), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert math.isclose(scores[0]["score"], 48.892302, abs_tol=1e-4)
    assert "note" not in capsys.readouterr().err
    (tmp_path / "link").symlink_to(hyp)  # the same file under another name: a note, and the scores
    assert main(["evaluate", str(hyp), str(ref), str(tmp_path / "link")]) == 0
    out, err = capsys.readouterr()
    note = f"aiayn: note: {tmp_path / 'link'} is the hypotheses' file itself: it is scored against itself\n"
    assert "BLEU: 100.00" in out and err == note
    (tmp_path / "ref-link").symlink_to(ref)  # a reference given twice was signed nrefs:3 silently
    assert main(["evaluate", str(hyp), str(ref), str(tmp_path / "ref-link"), str(ref)]) == 0
    out, err = capsys.readouterr()
    assert "BLEU: 48.89" in out and "signature: nrefs:3|" in out
    assert err == "".join(f"aiayn: note: {again} is {ref} again: one reference counted twice (the signatures "
                          "say nrefs:3)\n" for again in (tmp_path / "ref-link", ref))
    hyp.write_bytes(b"\xff\n")
    assert main(["evaluate", str(hyp), str(ref)]) == 2
    assert f"{hyp}:1: invalid UTF-8" in capsys.readouterr().err


def test_scoring_imports_no_torch(tmp_path):
    """`aiayn evaluate` took 2.2 s (sacreBLEU's own 0.14 s), importing torch, SentencePiece and safetensors
    through the dataset module for reading its files: only `aiayn.data.lines` is imported now."""
    (tmp_path / "ref").write_text("Ein Hund.\n")
    code = ("import sys, aiayn.evaluate; assert 'torch' not in sys.modules, 'torch imported'; "
            "from aiayn.cli import main; assert main(['evaluate', 'ref', 'ref']) == 0; "
            "assert 'torch' not in sys.modules and 'sentencepiece' not in sys.modules, 'torch imported'")
    # check=False: the assertion's message (stderr) is the failure's, not CalledProcessError's
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_a_leading_byte_order_mark_is_not_text(tmp_path):
    """Notepad's BOM on either file: the same lines score 100 (the BOM glued to the first word lost 0.16)."""
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    lines = "Der erste Dezember.\nZwei und drei.\n"
    hyp.write_text("\ufeff" + lines, encoding="utf-8")
    ref.write_text(lines, encoding="utf-8")
    assert evaluate_files(hyp, [ref])[0].score == pytest.approx(100.0)
    assert evaluate_files(ref, [hyp])[0].score == pytest.approx(100.0)
    hyp.write_text("\ufeff\ufeff" + lines, encoding="utf-8")  # only one is a byte order mark
    assert evaluate_files(hyp, [ref])[0].score < 100


def test_a_nul_byte_names_its_line(tmp_path):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_bytes(b"one\ntwo\nth\0ree\n")
    ref.write_text("one\ntwo\nthree\n")
    with pytest.raises(UserError, match=r"hyp:3: NUL byte \(binary or corrupt input\?\)"):
        evaluate_files(hyp, [ref])


def test_a_tokenizer_whose_model_download_fails_is_one_line(tmp_path, monkeypatch, capsys):
    """flores200 (flores101, spm) fetches a SentencePiece model while BLEU is built: offline that was a
    URLError traceback. No network here: the download is made to fail as it does offline."""
    import urllib.error

    from sacrebleu.tokenizers import tokenizer_spm

    def offline(url, path, *args, **kwargs):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(tokenizer_spm, "SACREBLEU_DIR", str(tmp_path / "sacrebleu"))  # no cached model
    monkeypatch.setattr(tokenizer_spm, "download_file", offline)
    (tmp_path / "hyp").write_text("Der erste Dezember.\n", encoding="utf-8")
    (tmp_path / "ref").write_text("Der erste Dezember.\n", encoding="utf-8")
    for tok in ("flores200", "flores101", "spm"):
        assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--tokenize", tok]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"aiayn: error: sacreBLEU's {tok} tokenizer downloads its SentencePiece model")
        assert "download failed: [Errno -2] Name or service not known" in err and err.count("\n") == 1


def test_a_language_tag_is_reduced_to_its_code_and_a_pair_is_refused(tmp_path, capsys):
    hyp, ref = ["我们今天去公园散步"], [["我们明天去公园散步"]]
    expected = corpus_scores(hyp, ref, lang="zh")[0].score
    for lang in ("zh-CN", "ZH", "zh_TW", "zh-Hant", "zho"):
        bleu = corpus_scores(hyp, ref, lang=lang)[0]
        assert "tok:zh" in bleu.signature and bleu.score == pytest.approx(expected), lang
    (tmp_path / "hyp").write_text(hyp[0] + "\n", encoding="utf-8")
    (tmp_path / "ref").write_text(ref[0][0] + "\n", encoding="utf-8")
    for lang, message in (
        ("en-zh", "-l 'en-zh': -l takes the target language's code (e.g. zh), not a pair"),
        ("zh-cn", "-l 'zh-cn': -l takes the target language's code (e.g. zh), not a pair"),
        ("123", "-l '123' is not a language code"),
        ("chinese", "-l 'chinese' is not a language code"),
    ):
        assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "-l", lang]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"aiayn: error: {message}") and err.count("\n") == 1, err


def test_sacrebleus_lowercase_flag_is_refused_as_itself(tmp_path, capsys):
    """`-lc`, sacreBLEU's lowercase flag, was read as `-l c`: "-l 'c' is not a language code"."""
    (tmp_path / "hyp").write_text("The cat.\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit:
        main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "hyp"), "-lc"])
    assert exit.value.code == 2 and capsys.readouterr().err == (
        "aiayn evaluate: error: -lc: aiayn evaluate has no lowercase option; its BLEU-lc line is always "
        "printed (see aiayn evaluate --help)\n")
    with pytest.raises(SystemExit):  # its long form: argparse's bare "unrecognized arguments" before
        main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "hyp"), "--lowercase"])
    assert "--lowercase: aiayn evaluate has no lowercase option" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "hyp"), "-lcmn"]) == 0  # -l cmn: zh
    assert "tok:zh" in capsys.readouterr().out


def test_thai_and_other_unspaced_scripts_without_a_tokenizer_are_scored_on_characters():
    """13a leaves a Thai line one "word": the right translation with one syllable off scored 0."""
    hyp, ref = ["วันนี้อากาศดีมาก"], [["วันนี้อากาศดีมาก"]]
    bleu, _, lowercased = corpus_scores(hyp, ref, lang="th")
    assert bleu.score == pytest.approx(100.0) and "tok:char" in bleu.signature
    assert lowercased.name == LOWERCASE_LABEL.format("char")
    close = ["พรุ่งนี้อากาศดีมาก"]
    assert corpus_scores(close, ref)[0].score == 0.0
    for lang in ("th", "TH", "th-TH", "lo", "km", "my"):
        bleu = corpus_scores(close, ref, lang=lang)[0]
        assert "tok:char" in bleu.signature and 0 < bleu.score < 100, lang
    assert "tok:13a" in corpus_scores(close, ref, lang="th", tokenize="13a")[0].signature  # --tokenize wins


def test_a_note_suggests_lang_for_unspaced_text_scored_with_13a(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("我们今天去公园散步。\n他说这本书很有意思。\n\n", encoding="utf-8")
    ref.write_text("我们明天去公园散步。\n他说这本书非常有意思。\n\n", encoding="utf-8")
    assert main(["evaluate", str(hyp), str(ref)]) == 0
    captured = capsys.readouterr()
    note = ("aiayn: note: BLEU's 13a tokenizer found words of 10.0 characters on average: for Chinese, "
            "Japanese, Thai, Lao, ")
    assert captured.err.startswith(note) and captured.err.count("\n") == 1 and "BLEU: 0.00" in captured.out
    assert "Khmer or Burmese pass -l LANG (or --tokenize char)" in captured.err
    for extra in (["-l", "zh"], ["--tokenize", "char"], ["--json"]):
        assert main(["evaluate", str(hyp), str(ref), *extra]) == 0
        assert ("note:" in capsys.readouterr().err) == (extra == ["--json"])  # stdout stays JSON
    hyp.write_text("The cat sat on the mat.\nShort.\n", encoding="utf-8")
    ref.write_text("The cat sat on a mat.\nShort.\n", encoding="utf-8")
    assert main(["evaluate", str(hyp), str(ref)]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("lines, unspaced", [
    (["achthunderteinundvierzigtausendfünfhundertzwölf", "Donaudampfschifffahrtsgesellschaft"], False),
    (["Здравствуйте", "Достопримечательности"], False),  # Cyrillic, one word a line
    (["대한민국헌법재판소", "국립중앙박물관에서"], False),  # Korean spaces its words: one a line is one word
    (["我们今天去公园散步。", "他用iPhone拍照片了"], True),
    (["วันนี้อากาศดีมาก", "ขอบคุณมากครับผม"], True),
    (["今日はとても良い天気ですね", "ありがとうございました"], True),
    # Thai spaces clauses, not words: two 13a words a line, of 20 characters (no note, BLEU 0.00)
    (["ฉันไปตลาดเมื่อวานนี้ และซื้อผลไม้มากมาย", "วันนี้อากาศดีมาก เราจึงไปเดินเล่นที่สวน"], True),
    (["我们 今天 去 公园 散步 。", "他 说 这 本 书 很 有 意思 。"], False),  # segmented: 13a scores its words
    # short unsegmented lines, one 13a word of 6 characters each: BLEU 0.00 and no note (8 was the bound)
    (["我爱吃苹果。", "今天天气好。", "他是我朋友。"], True),
    # the same with ASCII punctuation (NFKC's, as aiayn's models write it), which 13a splits off: 5 + 1
    # characters in two words, 3 on average, and no note
    (["我爱吃苹果!", "他是好学生!", "你今天好吗?", "我们明天见!"], True),
    (["コンピューター を 使っ て プログラミング する", "インターネット で ニュース を 読む"], False),  # loanwords
    (["ฉัน ไป ตลาด เมื่อวานนี้", "วันนี้ อากาศ ดี มาก"], False),  # segmented Thai: 4.5 characters a word
])
def test_the_unspaced_note_looks_at_the_script(tmp_path, capsys, lines, unspaced):
    """Word and character counts alone called single-word lines of German, a spaced language, unspaced:
    the note said to pass -l for Chinese, Japanese, Korean or Thai."""
    hyp = tmp_path / "hyp"
    hyp.write_text("\n".join(lines * 25) + "\n", encoding="utf-8")
    assert main(["evaluate", str(hyp), str(hyp)]) == 0
    assert ("note: BLEU's 13a tokenizer found words of" in capsys.readouterr().err) == unspaced


def test_hypotheses_from_standard_input(tmp_path, capsys, monkeypatch):
    """`aiayn translate ... | aiayn evaluate - REF`: "-" was "file not found", /dev/stdin "not a regular file"."""
    import io
    import sys

    ref = tmp_path / "ref"
    ref.write_text("The cat sat on a mat.\nA dog ran.\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The cat sat on the mat.\nA dog ran.\n")))
    assert main(["evaluate", "-", str(ref), "--json"]) == 0  # read once: the unspaced-text check reads the same lines
    scores = json.loads(capsys.readouterr().out)
    assert all("ci" not in s for s in scores)  # the default JSON as before --confidence existed
    assert scores[0]["score"] == pytest.approx(corpus_scores(["The cat sat on the mat.", "A dog ran."],
                                                             [["The cat sat on a mat.", "A dog ran."]])[0].score)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    assert main(["evaluate", "-", str(ref)]) == 2
    assert capsys.readouterr().err.strip() == "aiayn: error: <stdin>:2: invalid UTF-8 (byte 0xff)"
    monkeypatch.setattr(sys, "stdin", None)  # started with stdin closed: an AttributeError traceback
    assert main(["evaluate", "-", str(ref)]) == 2
    assert capsys.readouterr().err.strip() == "aiayn: error: <stdin>: closed; give the translations as a file"


def test_the_api_refuses_one_string_where_it_takes_a_list(tmp_path):
    """A str is iterable: it was scored character by character, and a path read as one file per character."""
    with pytest.raises(TypeError, match="hypotheses must be a list of lines"):
        corpus_scores("a cat", [["a cat"]])
    with pytest.raises(TypeError, match="list of reference streams"):
        corpus_scores(["a cat"], ["a cat"])
    with pytest.raises(UserError, match="no references"):
        corpus_scores(["a cat"], [])
    assert corpus_scores((h for h in ["a cat sat here"]), [("a cat sat here",)])[0].score == pytest.approx(100)
    (tmp_path / "h").write_text("a cat sat here\n", encoding="utf-8")
    with pytest.raises(TypeError, match=r"pass \[.*h'\]"):
        evaluate_files(tmp_path / "h", tmp_path / "h")


def test_references_from_a_pipe(tmp_path, capsys):
    """`aiayn evaluate out.de <(head ref.de)`: a FIFO, read once, was refused as not a regular file."""
    hyp, fifo = tmp_path / "hyp", tmp_path / "fifo"
    hyp.write_text("a cat sat here\n", encoding="utf-8")
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w", encoding="utf-8") as f:
            f.write("a cat sat here\n")

    import threading

    writer = threading.Thread(target=feed)
    writer.start()
    assert main(["evaluate", str(hyp), str(fifo), "--json"]) == 0
    writer.join()
    assert json.loads(capsys.readouterr().out)[0]["score"] == pytest.approx(100)


def test_bootstrap_resamples_past_memory_are_one_line(monkeypatch):
    import sacrebleu.significance

    def no_memory(*args, **kwargs):  # numpy's error for 1e9 resamples of 12 lines: 89.4 GiB
        raise MemoryError("Unable to allocate 89.4 GiB")

    monkeypatch.setattr(sacrebleu.significance, "_bootstrap_resample", no_memory)  # imported per call
    with pytest.raises(UserError, match=r"^confidence=1000000000: out of memory for that many bootstrap "
                                        r"resamples of 2 lines; give fewer"):
        corpus_scores(["a b c", "d e f"], [["a b c", "d e f"]], confidence=1_000_000_000)


def test_corpus_scores_checks_confidence_and_ter_types():
    """confidence=2.5 failed inside sacreBLEU ("'float' object cannot be interpreted as an integer");
    ter="no" was taken as True."""
    for confidence in (2.5, 1, -3, True):
        with pytest.raises(UserError, match=rf"^confidence={confidence!r}: give a whole number of bootstrap"):
            corpus_scores(["a b c"], [["a b c"]], confidence=confidence)
    with pytest.raises(TypeError, match=r"^ter='no' must be True or False$"):
        corpus_scores(["a b c"], [["a b c"]], ter="no")


@pytest.mark.parametrize("args, said", [
    (["--tokenize", "nope"], "--tokenize nope is not one of sacreBLEU's: none, zh, 13a"),
    (["--tokenize", "no pe"], "--tokenize 'no pe' is not one of sacreBLEU's"),
    (["--confidence", "1"], "--confidence 1: give a whole number of bootstrap resamples, at least 2 (0: off"),
    (["--confidence", "-3"], "--confidence -3: give a whole number of bootstrap resamples"),
    (["--confidence", str(10**20)], f"--confidence {10**20}: out of memory for that many bootstrap"),
])
def test_the_cli_names_a_refused_setting_by_its_flag(tmp_path, capsys, args, said):
    """`evaluate --confidence 1` said `confidence=1: ...` and `--tokenize foo` `tokenize='foo' ...`: the
    library's parameters, where translate says `--lenpen nan`. The library keeps its names (above)."""
    (tmp_path / "hyp").write_text("a b c\n")
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "hyp"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn: error: {said}") and err.count("\n") == 1


def sacrebleus_own_bootstrap(metric, hyps: list[str], refs: list[list[str]]):
    """sacreBLEU's own score of 1,000 resamples, or None where it crashes (statistics.mean's TypeError
    "don't know how to coerce float and float32"): under numpy 2, whose float32 stays float32 beside a
    Python float (NEP 50), 2.4 and 2.6 alike; under numpy 1 neither does."""
    try:
        return metric.corpus_score(hyps, refs, n_bootstrap=1000)
    except TypeError as e:
        assert "coerce" in str(e)  # sacreBLEU's own bug, not another
        return None


def test_confidence_on_a_few_lines_with_an_empty_hypothesis_is_scored():
    """sacreBLEU's chrF gave 0.0 for a resample without matches and float32 otherwise (numpy 2); its
    bootstrap's `statistics.mean` refused the mix (a TypeError traceback, `sacrebleu --confidence` too)."""
    from sacrebleu.metrics import CHRF

    hyps, refs = ["the cat sat on the mat", ""], [["the cat sat on the mat", "it rained"]]
    theirs = sacrebleus_own_bootstrap(CHRF(), hyps, refs)
    bleu, chrf, _ = corpus_scores(hyps, refs, confidence=1000)
    assert chrf.score == pytest.approx(CHRF().corpus_score(hyps, refs).score)
    assert type(chrf.ci) is float and 0 < chrf.ci <= 50 and "bs:1000" in chrf.signature
    assert bleu.ci is not None
    if theirs is not None:  # where sacreBLEU does not crash the interval is its own
        assert chrf.ci == pytest.approx(float(theirs._ci))


def test_ter_confidence_on_a_few_lines_with_an_empty_reference_is_sacrebleus_interval(tmp_path, capsys):
    """sacreBLEU 2.6's TER gave a plain 100.0 or 0.0 for a resample whose references were all empty and
    float32 otherwise: `evaluate --ter --confidence` on a small set with an empty reference line was the
    TypeError traceback chrF's was. Where sacreBLEU does not crash the interval is its own."""
    from sacrebleu.metrics import TER

    hyps = ["Ein Mann fährt ein Fahrrad.", "Zwei Hunde spielen im Schnee.", ""]
    refs = [["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", ""]]
    theirs = sacrebleus_own_bootstrap(TER(), hyps, refs)
    ter = corpus_scores(hyps, refs, ter=True, confidence=1000)[-1]
    assert ter.score == pytest.approx(100 / 9) and type(ter.ci) is float and 0 < ter.ci <= 50
    if theirs is not None:
        assert ter.ci == pytest.approx(float(theirs._ci))
    for n in (2, 60):  # no empty reference: sacreBLEU's fixed seed draws the same resamples
        hyps = [f"Zwei Hunde spielen {i} im {'Schnee' if i % 3 else 'Park'}." for i in range(n)]
        refs = [[f"Zwei Hunde spielen {i} im Schnee." for i in range(n)]]
        theirs = TER().corpus_score(hyps, refs, n_bootstrap=1000)
        ter = corpus_scores(hyps, refs, ter=True, confidence=1000)[-1]
        assert (ter.score, ter.ci) == (pytest.approx(theirs.score), pytest.approx(float(theirs._ci)))
        assert theirs._ci > 0
    (tmp_path / "hyp").write_text("Ein Mann fährt ein Fahrrad.\nZwei Hunde spielen im Schnee.\n\n")
    (tmp_path / "ref").write_text("Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n\n")
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--ter", "--confidence"]) == 0
    assert "TER: 11.11 (95% CI +/- " in capsys.readouterr().out


def test_resamples_past_any_memory_are_refused_before_numpy_sees_them():
    """numpy raised OverflowError for 1e20 resamples and ValueError ("array is too big") for 1e16 of
    200 lines, both tracebacks; MemoryError alone was caught."""
    for confidence, lines in ((10**20, 2), (10**16, 200)):
        with pytest.raises(UserError, match=rf"^confidence={confidence}: out of memory for that many "):
            corpus_scores(["a b"] * lines, [["a b"] * lines], confidence=confidence)


def test_ter_of_chinese_and_japanese_counts_characters_as_words():
    """Plain TER read an unspaced line as one word (100 for any sentence not exactly right); with -l zh or
    ja it is sacreBLEU's TER with asian_support, and Thai-like scripts, which it cannot split, are refused."""
    from sacrebleu.metrics import TER

    hyp, ref = ["我们今天去公园散步。", "他喜欢吃苹果"], [["我们今天去公园。", "他喜欢吃香蕉"]]
    assert corpus_scores(hyp, ref, ter=True)[-1].score == 100.0
    asian = TER(normalized=True, asian_support=True).corpus_score(hyp, ref)
    for lang in ("zh", "zh-TW"):
        ter = corpus_scores(hyp, ref, lang=lang, ter=True)[-1]
        assert ter.score == pytest.approx(asian.score) and 0 < ter.score < 50 and "asian:yes" in ter.signature
    assert ter_metric("ja").asian_support and ter_metric("ja").normalized  # its BLEU needs MeCab here
    assert not ter_metric("ko").asian_support and not ter_metric("").asian_support  # Korean is spaced
    with pytest.raises(UserError, match=r"^TER counts word edits, and sacreBLEU cannot split Thai text"):
        corpus_scores(["วันนี้อากาศดีมาก"], [["วันนี้อากาศดีมาก"]], lang="th", ter=True)


def test_chrf_word_ngrams_are_refused_for_unspaced_languages_and_must_be_whole_numbers():
    for lang, name in (("zh", "Chinese"), ("ja", "Japanese"), ("th", "Thai")):
        with pytest.raises(UserError, match=rf"^chrF's word n-grams \(word order 2\) are split at spaces, "
                                            rf"which {name} text has few of"):
            corpus_scores(["今天天气很好"], [["今天天气很好"]], lang=lang, chrf_word_order=2)
    assert corpus_scores(["今天天气很好"], [["今天天气很好"]], lang="zh")[1].score == 100.0  # chrF: fine
    for order in (2.0, True):  # 2.0 failed inside sacreBLEU; True signed itself nw:yes
        with pytest.raises(UserError, match=rf"^chrF's word order {order!r} is not 0, 1 or 2"):
            corpus_scores(["a b"], [["a b"]], chrf_word_order=order)


def test_a_tokenizer_made_for_one_language_says_it_for_ter_and_chrf(tmp_path, capsys):
    """--tokenize zh --ter scored plain TER, each unspaced line one word (100.00, asian:no), and --tokenize
    zh or ja-mecab with --chrf-word-order 2 split Chinese or Japanese at spaces: -l zh did neither."""
    hyp, ref = ["我喜欢吃苹果。", "今天天气很好。"], [["我爱吃苹果。", "今天天气非常好。"]]
    by_lang = corpus_scores(hyp, ref, lang="zh", ter=True)[-1]
    ter = corpus_scores(hyp, ref, tokenize="zh", ter=True)[-1]
    assert (ter.score, ter.signature) == (by_lang.score, by_lang.signature) and "asian:yes" in ter.signature
    assert 0 < ter.score < 50
    for tokenize, name in (("zh", "Chinese"), ("ja-mecab", "Japanese")):  # refused before MeCab is needed
        with pytest.raises(UserError, match=rf"^chrF's word n-grams \(word order 2\) .* which {name} text"):
            corpus_scores(hyp, ref, tokenize=tokenize, chrf_word_order=2)
    assert "asian:no" in corpus_scores(hyp, ref, lang="en", tokenize="zh", ter=True)[-1].signature  # -l wins
    (tmp_path / "hyp").write_text("\n".join(hyp) + "\n", encoding="utf-8")
    (tmp_path / "ref").write_text("\n".join(ref[0]) + "\n", encoding="utf-8")
    assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--tokenize", "zh", "--ter"]) == 0
    assert f"TER: {by_lang.score:.2f}" in capsys.readouterr().out


def test_word_scores_of_unspaced_text_under_a_tokenizer_of_no_language_get_a_note(tmp_path, capsys):
    """--tokenize char --ter on Chinese gave TER 100.00, each line one word, silently: char names no
    language, and TER and chrF++ split words at spaces. The note named -l for TER of Thai too."""
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_text("我喜欢吃苹果。\n今天天气很好。\n他去了北京大学学习。\n", encoding="utf-8")
    ref.write_text("我爱吃苹果。\n今天天气非常好。\n他去北京大学学习了。\n", encoding="utf-8")
    note = ("aiayn: note: TER splits words at spaces, which this text, mostly of scripts written without "
            "them, has few of: pass -l zh or ja to score it as the language allows (sacreBLEU's TER has none "
            "for Thai, Lao, Khmer or Burmese)")  # `-l th --ter` is refused: the note sent Thai there
    assert main(["evaluate", str(hyp), str(ref), "--tokenize", "char", "--ter"]) == 0
    assert capsys.readouterr().err == note + "\n"
    assert main(["evaluate", str(hyp), str(ref), "--tokenize", "13a", "--ter", "--chrf-word-order", "1"]) == 0
    assert capsys.readouterr().err == (f"{note}; chrF's word n-grams split words at spaces, which this text "
                                       "has few of: leave out --chrf-word-order\n")  # -l refuses them
    for quiet in (["--tokenize", "char"], ["-l", "zh", "--tokenize", "char", "--ter"],
                  ["--tokenize", "zh", "--ter"]):
        assert main(["evaluate", str(hyp), str(ref), *quiet]) == 0
        assert "note:" not in capsys.readouterr().err, quiet
    hyp.write_text("The cat sat.\nA dog ran.\nPlease.\n", encoding="utf-8")
    assert main(["evaluate", str(hyp), str(ref), "--tokenize", "char", "--ter"]) == 0
    assert capsys.readouterr().err == ""


def test_the_one_word_note_with_ter_asks_for_the_language_alone(tmp_path, capsys):
    """With --ter, "pass -l LANG (or --tokenize char)": char mends BLEU alone, TER stayed 100.00 and a second
    note then said to pass -l. -l mends TER of Chinese and Japanese alone, and refuses chrF's word n-grams:
    the note said "(TER too)" and "(chrF's word n-grams too)" of Thai, whose `-l th` refuses both."""
    hyp = tmp_path / "hyp"
    hyp.write_text("我们今天下午去北京大学图书馆看书。\n他昨天晚上在家里看了一部很好的电影。\n" * 3, encoding="utf-8")
    bleu = ("aiayn: note: BLEU's 13a tokenizer found words of 17.5 characters on average: for Chinese, "
            "Japanese, Thai, Lao, Khmer or Burmese pass -l LANG")
    ter = " (TER too, for Chinese or Japanese: sacreBLEU's TER has none for Thai, Lao, Khmer or Burmese)"
    chrf = ("; chrF's word n-grams split words at spaces, which this text, mostly of scripts written without "
            "them, has few of: leave out --chrf-word-order")
    for options, said in ((["--ter"], bleu + ter), (["--chrf-word-order", "2"], bleu + chrf),
                          (["--ter", "--chrf-word-order", "1"], bleu + ter + chrf)):
        assert main(["evaluate", str(hyp), str(hyp), *options]) == 0
        assert capsys.readouterr().err.splitlines()[0] == said


def test_the_script_share_counts_letters_only():
    """Thai digits and vowel signs are in Thai's range but are no letters: counted, "Visit วัดพระแก้ว today"
    was mostly unspaced, and a share of the letters passed 1."""
    from aiayn.evaluate import mostly_unspaced

    assert not mostly_unspaced(["Visit วัดพระแก้ว today"] * 3) and not mostly_unspaced(["Hello world ๑๒๓๔๕๖"])
    assert mostly_unspaced(["วัดพระแก้ว"]) and mostly_unspaced(["我们今天去北京 and"])


def test_a_tokenizer_of_another_type_is_a_setting_error(tmp_path):
    """tokenize=['zh'] from Python was a bare TypeError (unhashable type: 'list') in the language lookup."""
    from aiayn.errors import SettingError

    with pytest.raises(SettingError, match=r"tokenize=\['zh'\] is not one of sacreBLEU's"):
        corpus_scores(["a b"], [["a b"]], tokenize=["zh"])


def test_a_tokenizer_other_than_the_languages_is_warned_about_once_in_aiayns_form(tmp_path, capsys):
    """-l zh --tokenize 13a printed sacreBLEU's "Consider using the 'zh' or 'spm' tokenizer for Chinese."
    twice (one per BLEU built, cased and lowercased), unprefixed, and sent offline users to spm."""
    hyp = tmp_path / "hyp"
    hyp.write_text("我喜欢吃苹果。\n今天天气很好。\n", encoding="utf-8")
    ref = tmp_path / "ref"
    ref.write_text("我爱吃苹果。\n今天天气非常好。\n", encoding="utf-8")
    said = {
        ("zh", "13a"): "BLEU of Chinese (zh) scored with the 13a tokenizer, where -l zh alone picks zh: it "
                       "compares only with BLEU signed tok:13a",
        ("ja", "char"): "BLEU of Japanese (ja) scored with the char tokenizer, where -l ja alone picks "
                        "ja-mecab (pip install 'sacrebleu[ja]'): it compares only with BLEU signed tok:char",
        ("th", "intl"): "BLEU of Thai (th) scored with the intl tokenizer, where -l th alone picks char: it "
                        "compares only with BLEU signed tok:intl",
    }
    for (lang, tokenize), warning in said.items():
        assert main(["evaluate", str(hyp), str(ref), "-l", lang, "--tokenize", tokenize, "--json"]) == 0
        captured = capsys.readouterr()
        assert captured.err == f"aiayn: warning: {warning}\n" and json.loads(captured.out)
    for quiet in (["-l", "zh"], ["-l", "zh", "--tokenize", "zh"], ["-l", "th"],
                  ["-l", "en", "--tokenize", "zh"], ["--tokenize", "char"]):
        assert main(["evaluate", str(hyp), str(ref), *quiet]) == 0
        assert capsys.readouterr().err == "", quiet


def test_hypotheses_that_look_tokenized_are_warned_about_once_in_aiayns_form(tmp_path, capsys, caplog):
    """100 hypotheses ending in " ." printed sacreBLEU's three unprefixed lines twice (BLEU and BLEU-lc),
    advising its `force` parameter, which aiayn has no setting for. Validation BLEU during training scores
    through `bleu_metrics` too, and gets no word from sacreBLEU either."""
    from aiayn.evaluate import bleu_metrics

    refs = [f"Ein Hund läuft über die Wiese Nummer {i}." for i in range(150)]
    (tmp_path / "ref").write_text("\n".join(refs) + "\n")
    for tokenized in (100, 99):
        hyps = [line[:-1] + " ." if i < tokenized else line for i, line in enumerate(refs)]
        (tmp_path / "hyp").write_text("\n".join(hyps) + "\n")
        assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--json"]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)[0]["score"] > 0
        assert captured.err == ("aiayn: warning: 100 of the 150 hypotheses end in a tokenized period (' .'): "
                                "they look tokenized, which may lower the scores; detokenize them first (the "
                                "scores are for detokenized text)\n" if tokenized == 100 else "")
    tokenized = [line[:-1] + " ." for line in refs]
    for bleu in bleu_metrics():
        assert bleu.corpus_score(tokenized, [refs]).score > 0
    assert not [r for r in caplog.records if r.name.startswith("sacrebleu")]


@pytest.mark.parametrize("split, said", [
    (lambda w: w[:2] + "@@ " + w[2:] if len(w) > 4 else w,
     ("hold BPE's '@@ ' marks: they look like subword pieces, which lowers the scores; join them first "
      "(fairseq's --remove-bpe, or sed -E 's/(@@ )|(@@ ?$)//g')")),
    (lambda w: "\u2581" + w[:2] + " " + w[2:] if len(w) > 4 else "\u2581" + w,
     ("hold SentencePiece's '\u2581' (U+2581) marks: they look like subword pieces, which score near 0; "
      "decode them first (spm_decode, or fairseq's --remove-bpe sentencepiece)")),
])
def test_hypotheses_of_subword_pieces_are_warned_about(tmp_path, capsys, split, said):
    """fairseq's output without --remove-bpe, or SentencePiece's pieces, scored near 0 BLEU with no word:
    a warning from a tenth of the lines (SUBWORD_SHARE)."""
    refs = [f"Ein Hund läuft über die Wiese Nummer {i}" for i in range(150)]
    (tmp_path / "ref").write_text("\n".join(refs) + "\n")
    for pieces in (15, 14):
        hyps = [" ".join(map(split, line.split())) if i < pieces else line for i, line in enumerate(refs)]
        (tmp_path / "hyp").write_text("\n".join(hyps) + "\n")
        assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--json"]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)[0]["score"] < 100
        assert captured.err == (f"aiayn: warning: 15 of the 150 hypotheses {said}\n" if pieces == 15 else "")


def test_a_file_of_blank_lines_is_named_in_a_warning(tmp_path, capsys):
    """A reference of newlines alone scored BLEU 0 (ref_len 0) with no word, where a file of no lines is
    refused; so did translations of newlines alone."""
    hyp, ref, other = tmp_path / "hyp", tmp_path / "ref", tmp_path / "other"
    hyp.write_text("The cat sat.\nA dog ran.\n", encoding="utf-8")
    ref.write_text("\n \t\n", encoding="utf-8")
    other.write_text("The cat sat.\n\n", encoding="utf-8")
    assert main(["evaluate", str(hyp), str(ref)]) == 0
    captured = capsys.readouterr()
    assert "ref_len = 0" in captured.out
    assert captured.err == f"aiayn: warning: {ref}: every line is blank: no reference text to score against\n"
    assert main(["evaluate", str(hyp), str(other), str(ref)]) == 0  # the blank one of two references
    assert capsys.readouterr().err.count("warning") == 1
    assert main(["evaluate", str(ref), str(other)]) == 0
    assert capsys.readouterr().err == (
        f"aiayn: warning: {ref}: every line is blank: no translations to score\n")
    assert main(["evaluate", str(hyp), str(other)]) == 0  # one line of text: no warning
    assert capsys.readouterr().err == ""


def test_translations_and_a_reference_in_other_unicode_forms_are_named_in_a_warning(tmp_path, capsys):
    """The same text, NFD-decomposed on one side and NFC-composed on the other, scored well under 100 with no
    word: sacreBLEU compares characters, and NFD's é is two."""
    import unicodedata

    lines = ["Café au lait, s'il vous plaît.", "Ça n'a pas été très facile.", "The end."]
    files = {}
    for form in ("NFC", "NFD"):
        files[form] = tmp_path / form
        files[form].write_text("\n".join(unicodedata.normalize(form, line) for line in lines) + "\n",
                               encoding="utf-8")
    said = {"NFC": "composed form (NFC: é one character)",
            "NFD": "decomposed form (NFD: é as e and a combining accent)"}
    for hyp, ref in (("NFD", "NFC"), ("NFC", "NFD")):
        assert main(["evaluate", str(files[hyp]), str(files[ref]), "--json"]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)[0]["score"] < 100
        assert captured.err == (f"aiayn: warning: {files[hyp]} is in Unicode's {said[hyp]}, {files[ref]} in "
                                f"its {said[ref]}: the same letters are other characters to the scores, "
                                "which lowers them; normalize both to one form (NFC) first\n")
    (tmp_path / "copy").write_text(files["NFC"].read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["evaluate", str(files["NFC"]), str(tmp_path / "copy"), str(files["NFD"])]) == 0
    assert capsys.readouterr().err.count(f"{files['NFD']} in its decomposed form") == 1  # that one alone
    (tmp_path / "ascii").write_text("Cafe au lait.\nCa va.\nThe end.\n", encoding="utf-8")
    # no telling ASCII's form; one form on both sides
    for hyp, ref in ((tmp_path / "ascii", files["NFD"]), (tmp_path / "copy", files["NFC"])):
        assert main(["evaluate", str(hyp), str(ref)]) == 0
        assert capsys.readouterr().err == ""


def test_standard_input_named_twice_is_refused_and_a_file_given_as_it_is_said_to_be_itself(tmp_path, capsys,
                                                                                          monkeypatch):
    """`cat ref | aiayn evaluate - /dev/stdin`: the second read of the pipe was empty, said as "line counts
    differ: /dev/stdin has 0 lines"; only a reference "-" was caught. /proc/self/fd/N names the pipe here
    as /dev/stdin names fd 0."""
    import sys

    ref = tmp_path / "ref"
    ref.write_text("a cat sat here\nthe dog ran\n", encoding="utf-8")
    read_end, write_end = os.pipe()
    os.write(write_end, ref.read_bytes())
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        this = f"/proc/self/fd/{read_end}"
        for argv, said in ((["-", this], f"{this}: standard input, which the translations (-) read already"),
                           ([this, this], f"{this}: standard input, which the translations ({this}) read"),
                           ([str(ref), this, this], f"{this}: standard input, which reference {this} read")):
            assert main(["evaluate", *argv]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"aiayn: error: {said}") and err.count("\n") == 1, argv
        assert err.endswith("read only once; give each reference as a file, or as <(command)\n")
    with open(ref, encoding="utf-8") as redirected:  # `aiayn evaluate - ref < ref`: a file, read anew by name
        monkeypatch.setattr(sys, "stdin", redirected)
        assert main(["evaluate", "-", str(ref)]) == 0
        note = f"aiayn: note: {ref} is the hypotheses' file itself: it is scored against itself\n"
        assert capsys.readouterr().err == note


def test_a_reference_of_another_length_is_refused_in_words_that_count_right():
    with pytest.raises(UserError, match="^reference 1 has 1 line but the hypotheses have 2$"):  # "1 lines"
        corpus_scores(["a", "b"], [["a"]])
    with pytest.raises(UserError, match="^reference 2 has 3 lines but the hypotheses have 2$"):
        corpus_scores(["a", "b"], [["a", "b"], ["a", "b", "c"]])
