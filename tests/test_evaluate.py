"""Scores are sacreBLEU's (checked against a BLEU computed by hand), with signatures and clear labels."""

import importlib.util
import json
import math

import pytest

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.evaluate import LOWERCASE_LABEL, corpus_scores, evaluate_files


def test_bleu_equals_the_hand_computed_value():
    # 13a tokens: The cat sat on the mat . | The cat sat on a mat . -> n-gram precisions 6/7, 4/6, 2/5, 1/4,
    # equal lengths so no brevity penalty: BLEU = (6/7 * 4/6 * 2/5 * 1/4) ** (1/4).
    bleu, chrf, lowercased = corpus_scores(["The cat sat on the mat."], [["The cat sat on a mat."]])
    assert bleu.name == "BLEU"
    assert bleu.score == pytest.approx(100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25, abs=1e-6)
    assert "case:mixed" in bleu.signature and "tok:13a" in bleu.signature and "version:" in bleu.signature
    assert chrf.name == "chrF2" and "nc:6" in chrf.signature and 0 < chrf.score < 100
    assert lowercased.name == LOWERCASE_LABEL.format("13a") and "case:lc" in lowercased.signature


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
    assert "tokenize='nope' is not one of sacreBLEU's: none, zh, 13a" in capsys.readouterr().err
    if importlib.util.find_spec("MeCab") is None:  # sacreBLEU's ja tokenizer needs sacrebleu[ja]
        assert main(["evaluate", str(tmp_path / "hyp"), str(tmp_path / "ref"), "-l", "ja"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("aiayn: error: sacreBLEU's ja tokenizer needs packages missing here") and err.count("\n") == 1
        assert "pip install sacrebleu[ja]" in err


def test_several_references_and_line_counts(tmp_path):
    hyp, ref1, ref2 = tmp_path / "hyp", tmp_path / "ref1", tmp_path / "ref2"
    hyp.write_text("a b c d e\nf g h i j\n")
    ref1.write_text("a b c d e\nx y z w v\n")
    ref2.write_text("q q q q q\nf g h i j\n")
    assert evaluate_files(hyp, [ref1, ref2])[0].score == pytest.approx(100.0)  # each line matches a reference
    assert evaluate_files(hyp, [ref1])[0].score < 100
    ref1.write_text("a b c d e\n")
    with pytest.raises(UserError, match="ref1: 1 lines, but .*hyp has 2"):
        evaluate_files(hyp, [ref1])
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
    hyp.write_bytes(b"\xff\n")
    assert main(["evaluate", str(hyp), str(ref)]) == 2
    assert f"{hyp}:1: invalid UTF-8" in capsys.readouterr().err


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
