"""Scores the way the field reports them: sacreBLEU BLEU and chrF with their signatures (Post, 2018).

The inputs are detokenized, cased translations and references (what `aiayn translate` writes, what the
test sets hold); sacreBLEU applies its own standard tokenization (13a, or for a Chinese, Japanese or
Korean target the one sacreBLEU picks for that language, and for Thai, Lao, Khmer or Burmese, which
sacreBLEU has no tokenizer for, its `char` one: 13a leaves unspaced text as a few long "words" and the
score near 0), so numbers compare across papers that report the signature. Older papers (the
Transformer paper among them) scored tokenized, sometimes lowercased text with multi-bleu.perl;
`BLEU-lc` (lowercased, 13a-tokenized) is given for comparison with those, clearly labelled, and is not
the score to report.
"""

from __future__ import annotations

import logging
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.metrics.ter import TERScore
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from aiayn.data.lines import read_lines, require_same_count
from aiayn.errors import SettingError, UserError, str_list
from aiayn.files import reads_stdin_once

log = logging.getLogger(__name__)

LOWERCASE_LABEL = "BLEU-lc (lowercased, {}-tokenized: only for comparison with older papers, not comparable)"
TOKENIZERS = tuple(BLEU.TOKENIZERS)  # sacreBLEU's: 13a, intl, zh, ja-mecab, ko-mecab, char, none, ...
DOWNLOADED = ("spm", "flores101", "flores200", "spBLEU-1K")  # fetch a SentencePiece model on first use
# Unspaced scripts sacreBLEU has no tokenizer for: with -l and no --tokenize, BLEU is scored on characters
# (13a would leave each line a few long "words" and score a correct translation near 0).
CHAR_LANGS = {"th": "Thai", "lo": "Lao", "km": "Khmer", "my": "Burmese"}
UNSPACED = {"zh": "Chinese", "ja": "Japanese", **CHAR_LANGS}  # whose words no space separates
# The tokenizer -l picks for a language (13a for those not here), and its name: another named with it is
# warned about once (sacreBLEU warned in each of BLEU's two constructions, unprefixed, and named spm,
# which downloads its model)
LANG_TOKENIZERS = {"zh": ("zh", "Chinese"), "ja": ("ja-mecab", "Japanese"), "ko": ("ko-mecab", "Korean"),
                   **{lang: ("char", name) for lang, name in CHAR_LANGS.items()}}
# ISO 639-2/3 codes of the languages whose tokenizer differs, so that -l tha or -l zho is not 13a unnoticed
_ALIASES = {"zho": "zh", "chi": "zh", "cmn": "zh", "yue": "zh", "jpn": "ja", "kor": "ko",
            "tha": "th", "lao": "lo", "khm": "km", "mya": "my", "bur": "my"}
# sacreBLEU's tokenizers made for one language (char is not): naming one says the language as -l does
# (--tokenize zh --ter scored plain TER, a whole Chinese line one word, where -l zh splits its characters)
TOKENIZER_LANGS = {tok: lang for lang, (tok, _) in LANG_TOKENIZERS.items() if tok != "char"}
# LANG, LANG-REGION or LANG_REGION: a region in capitals (zh-CN, pt_BR) or digits (es-419), a script before it
# (zh-Hant, zh-Hans-CN). A lowercase two-letter second part is what a pair looks like (en-zh, en-de): refused.
_LANG_TAG = re.compile(r"(?P<lang>[A-Za-z]{2,3})(?:[-_][A-Za-z]{4})?(?:[-_](?P<region>[A-Z]{2}|[0-9]{3}))?")
# 13a "words" of more characters than this on average: unspaced text left unsplit (a line of Thai, Lao,
# Khmer or Burmese, or two of Thai, whose spaces part clauses, not words); segmented Thai averages 4-5
HINT_WORD_CHARS = 8
# The same for text mostly of Han and kana: segmented Chinese averages under 2.5 characters a word, Japanese
# under 3.5 (katakana loanwords), while an unsegmented line is one word: a short one of 5 to 7 characters
# (我爱吃苹果。) scored BLEU 0.00 with no note under HINT_WORD_CHARS
HINT_HAN_WORD_CHARS = 4
# Han and kana (halfwidth too), of the letters below
_HAN_KANA = ("\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
             "\U00020000-\U0003ffff")
_HAN_KANA_LETTER = re.compile(f"[{_HAN_KANA}]")
# Letters of the scripts written without spaces between words: Thai, Lao, Myanmar, Khmer, kana, Han. Not
# Hangul: Korean spaces its words. Counts alone called a file of one German compound a line unspaced.
_UNSPACED_LETTER = re.compile(f"[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\ua9e0-\ua9ff\uaa60-\uaa7f"
                              f"{_HAN_KANA}]")
UNSPACED_SHARE = 0.5  # of a text's letters in those scripts, from which it is unspaced text
# Hypotheses ending in a tokenized period (" .") from which they look tokenized: sacreBLEU's count. Its own
# warning is off (BLEU's force): three unprefixed lines, from each of BLEU's two scorings, advised `force`,
# which aiayn has no setting for; `corpus_scores` says it once
TOKENIZED_PERIODS = 100
# Share of the hypotheses holding subword pieces' marks (BPE's "@@ " that fairseq's --remove-bpe joins,
# SentencePiece's U+2581) from which they look like pieces, not words: scored so, a good translation is
# near 0 BLEU (150 lines of three words split in two: 3.01), silently. No text has either mark otherwise.
SUBWORD_SHARE = 0.1
# Unicode's normalization forms, as the warning of translations and a reference in different ones names
# them (the same text scored 79 BLEU, silently)
UNICODE_FORMS = {"NFC": "composed form (NFC: é one character)",
                 "NFD": "decomposed form (NFD: é as e and a combining accent)"}
# Bytes of the (resamples, lines) index table sacreBLEU's bootstrap draws at once: past this no machine
# holds it (numpy's OverflowError or "array is too big" otherwise, as tracebacks)
MAX_BOOTSTRAP_BYTES = 2**50


class _CHRF(CHRF):
    """sacreBLEU's chrF, its score a Python float. sacreBLEU 2.6 returns 0.0 where a resample matched no
    character n-gram and a numpy float32 elsewhere, and the bootstrap's `statistics.mean` refuses the mix
    (a TypeError, in `sacrebleu --confidence` too), so a few lines with an empty hypothesis crashed."""

    def _compute_f_score(self, statistics: list[int]) -> float:
        return float(super()._compute_f_score(statistics))


class _TER(TER):
    """sacreBLEU's TER, its score a Python float. sacreBLEU 2.6 returns 100.0 or 0.0 where a resample's
    references are all empty (no words to divide by) and a numpy float32 elsewhere: the mix `_CHRF` avoids
    crashed `--ter --confidence` on a few lines with empty references."""

    def _compute_score_from_stats(self, stats: list[float]) -> TERScore:
        result = super()._compute_score_from_stats(stats)
        result.score = float(result.score)
        return result


@dataclass(frozen=True)
class Score:
    """One corpus-level metric."""

    name: str  # BLEU, chrF2 (chrF2++ with word bigrams), the BLEU-lc label, or TER
    score: float  # 0-100 (TER: edits per reference word, x 100, lower is better)
    signature: str  # sacreBLEU's signature: what was computed, with which version
    detail: str  # sacreBLEU's full line (n-gram precisions, brevity penalty, lengths)
    ci: float | None = None  # with `confidence`: half the width of the bootstrap's 95% interval


def target_language(lang: str, option: str = "-l") -> str:
    """`lang` as sacreBLEU knows it: lowercase, the primary subtag of a tag (zh-CN, zh_TW, zh-Hant: zh;
    zho, tha: zh, th), '' for none. A UserError naming `option` for what is not a language's code, a
    pair (en-zh) among them."""
    tag = lang.strip()
    if not tag:
        return ""
    match = _LANG_TAG.fullmatch(tag)
    if match and match["lang"].isupper() and match["region"] and match["region"].isalpha():
        match = None  # EN-ZH: no telling a pair from a region
    if match is None and re.search(r"[-_>/:\s]", tag):
        raise UserError(
            f"{option} {tag!r}: {option} takes the target language's code (e.g. zh), not a pair "
            "(a region goes in capitals after it: zh-CN)"
        )
    if match is None:
        raise UserError(
            f"{option} {tag!r} is not a language code: {option} takes the target language's, 2 or 3 letters "
            "(e.g. zh)"
        )
    code = match["lang"].lower()
    return _ALIASES.get(code, code)


def unspaced_hint(
    hypotheses: Sequence[str], lang: str = "", tokenize: str | None = None,
    advice: str = "pass -l LANG (or --tokenize char)", ter: bool = False, chrf_word_order: int = 0,
) -> str | None:
    """A note for unspaced text (mostly letters of the scripts written without spaces: `mostly_unspaced`)
    scored with no language known (no `lang`, and no `tokenize` of TOKENIZER_LANGS). Where 13a was used (no
    `tokenize`) and found words of more than HINT_WORD_CHARS characters on average (HINT_HAN_WORD_CHARS
    for Chinese or Japanese), as unsegmented text gives (Thai's spaces part clauses): BLEU near 0 however
    good the translation. Else where `ter` or `chrf_word_order` (as `corpus_scores` takes them) asks for
    scores of words split at spaces, which -l would score as the language allows. None when it does not
    apply."""
    if lang.strip() or tokenizer_language(tokenize):
        return None
    lines = [line for line in hypotheses if line.strip()]
    if not lines or not mostly_unspaced(lines):
        return None
    # -l mends TER for Chinese and Japanese alone, and refuses chrF's word n-grams for every such language
    ter_too = " (TER too, for Chinese or Japanese: sacreBLEU's TER has none for Thai, Lao, Khmer or Burmese)"
    unspaced = ", mostly of scripts written without them,"  # said once a note

    def chrf(text: str) -> list[str]:
        said = f"chrF's word n-grams split words at spaces, which this text{text} has few of: leave out "
        return [said + "--chrf-word-order"] if chrf_word_order else []

    if tokenize is None and (chars := _word_chars(lines)) > _hint_word_chars(lines):
        if ter or chrf_word_order:  # --tokenize char mends BLEU alone: TER stayed 100 and a second note
            advice = "pass -l LANG"  # said to pass -l
        bleu = (f"BLEU's 13a tokenizer found words of {chars:.1f} characters on average: for Chinese, "
                f"Japanese, Thai, Lao, Khmer or Burmese {advice}" + (ter_too if ter else ""))
        return "; ".join([bleu, *chrf(unspaced)])
    if ter:  # --tokenize char is BLEU's alone: TER scored each Chinese line as one word
        ter_note = (f"TER splits words at spaces, which this text{unspaced} has few of: pass -l zh or ja to "
                    "score it as the language allows (sacreBLEU's TER has none for Thai, Lao, Khmer or "
                    "Burmese)")
        return "; ".join([ter_note, *chrf("")])
    return "; ".join(chrf(unspaced)) or None


def tokenizer_language(tokenize: object) -> str:
    """The language a tokenizer of TOKENIZER_LANGS is made for, else "" (any other value: a list, from
    Python, is `bleu_metrics`' SettingError to say, not an unhashable-type TypeError here)."""
    return TOKENIZER_LANGS.get(tokenize, "") if isinstance(tokenize, str) else ""


def _word_chars(lines: Sequence[str]) -> float:
    """The average characters of the words 13a finds in `lines`, those with a letter: its punctuation
    apart ("我爱吃苹果!" was two words, of 3 characters on average: no note, BLEU 0.00; NFKC, aiayn's
    default normalization, writes Chinese full stops and commas as ASCII). Words a line alone missed Thai,
    whose lines of two clauses are two 13a words of 20 characters (BLEU 0.00, and no note)."""
    tokenize13a = Tokenizer13a()
    words = chars = 0
    for line in lines:  # counted, not listed: a list of every word of a large file took 100 MB and more
        split = [word for word in tokenize13a(line).split() if any(map(str.isalpha, word))]
        words, chars = words + len(split), chars + sum(map(len, split))
    return chars / max(words, 1)


def _hint_word_chars(lines: Sequence[str]) -> int:
    """HINT_HAN_WORD_CHARS for `lines` of unspaced letters mostly Han or kana, else HINT_WORD_CHARS."""
    han_kana = unspaced = 0
    for line in lines:  # letters only, as `mostly_unspaced` counts them
        han_kana += sum(1 for m in _HAN_KANA_LETTER.finditer(line) if m.group().isalpha())
        unspaced += sum(1 for m in _UNSPACED_LETTER.finditer(line) if m.group().isalpha())
    return HINT_HAN_WORD_CHARS if han_kana > unspaced / 2 else HINT_WORD_CHARS


def mostly_unspaced(lines: Sequence[str]) -> bool:
    """Whether at least UNSPACED_SHARE of the letters of `lines` are of a script written without spaces."""
    letters = unspaced = 0
    for line in lines:  # counted, not listed: findall made a string per character (80 bytes each)
        letters += sum(map(str.isalpha, line))
        # letters only: vowel signs and digits of those scripts are in their ranges (the share passed 1)
        unspaced += sum(1 for m in _UNSPACED_LETTER.finditer(line) if m.group().isalpha())
    return letters > 0 and unspaced >= UNSPACED_SHARE * letters


def bleu_metrics(lang: str = "", tokenize: str | None = None) -> tuple[BLEU, BLEU]:
    """sacreBLEU's BLEU and lowercased BLEU for target language `lang` (see `target_language`; BLEU's
    tokenizer is picked from it: zh, ja-mecab, ko-mecab as sacreBLEU does, char for CHAR_LANGS, 13a for
    the others) or the tokenizer `tokenize` names, with a warning where `lang` has a tokenizer of its own
    (LANG_TOKENIZERS: zh, ja, ko, th, lo, km, my) and `tokenize` is neither it nor a SentencePiece one.
    A UserError for an unknown tokenizer, one whose packages are missing, or one whose model cannot be
    downloaded."""
    if tokenize is not None and tokenize not in TOKENIZERS:
        raise SettingError("tokenize", tokenize, f" is not one of sacreBLEU's: {', '.join(TOKENIZERS)}")
    lang = target_language(lang)
    if tokenize is None and lang in CHAR_LANGS:
        tokenize = "char"
    try:  # ja-mecab and ko-mecab need packages sacreBLEU does not install: a RuntimeError at construction
        sacre = "flores101" if tokenize == "spm" else tokenize  # same model and signature, no deprecation
        trg_lang = lang if tokenize is None else ""  # picks the tokenizer; given one, it only warns
        bleu, lowercased = (BLEU(lowercase=lc, force=True, tokenize=sacre, trg_lang=trg_lang)
                            for lc in (False, True))
    except (RuntimeError, ImportError) as e:  # ImportError: spm's sentencepiece
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        advice = next((line for line in lines if "pip install" in line), lines[0] if lines else "")
        advice = re.sub(r"(?<= )([\w.-]+\[[\w,.-]+\])", r"'\1'", advice)  # unquoted, a shell globs it
        name = tokenize or LANG_TOKENIZERS.get(lang, (lang,))[0]  # the one -l picked: ja-mecab, not "ja"
        raise UserError(f"sacreBLEU's {name} tokenizer needs packages missing here: {advice}") from None
    except (OSError, SystemExit) as e:  # URLError is an OSError; sacreBLEU exits on an SSL error
        if tokenize not in DOWNLOADED:
            raise
        ssl_exit = not isinstance(e, OSError)
        reason = "an SSL error" if ssl_exit else getattr(e, "reason", None) or e.strerror or e
        raise UserError(
            f"sacreBLEU's {tokenize} tokenizer downloads its SentencePiece model on first use, and the "
            f"download failed: {reason}"
        ) from None
    own, name = LANG_TOKENIZERS.get(lang, (tokenize, ""))
    if tokenize not in (None, own, *DOWNLOADED):  # SentencePiece's are made for any language
        needs = f" (pip install 'sacrebleu[{lang}]')" if own.endswith("-mecab") else ""
        log.warning("BLEU of %s (%s) scored with the %s tokenizer, where -l %s alone picks %s%s: it "
                    "compares only with BLEU signed tok:%s", name, lang, tokenize, lang, own, needs,
                    bleu.tokenizer_signature)
    return bleu, lowercased


def ter_metric(lang: str = "") -> TER:
    """sacreBLEU's TER for target language `lang`. TER counts word edits: Chinese and Japanese characters
    are split into words first (sacreBLEU's asian_support, which needs its normalization; plain TER read
    a whole unspaced line as one word, 100 for nearly every sentence). Thai, Lao, Khmer and Burmese,
    which sacreBLEU cannot split into words, are refused."""
    lang = target_language(lang)
    if lang in CHAR_LANGS:
        raise UserError(f"TER counts word edits, and sacreBLEU cannot split {CHAR_LANGS[lang]} text into "
                        "words: score it with BLEU (on characters, as -l gives) and chrF")
    return _TER(normalized=True, asian_support=True) if lang in ("zh", "ja") else _TER()


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]], lang: str = "", tokenize: str | None = None,
    chrf_word_order: int = 0, ter: bool = False, confidence: int = 0,
) -> list[Score]:
    """BLEU, chrF and the lowercased BLEU of `hypotheses`, then TER with `ter`, against one or more
    reference streams (`references[j][i]` is reference j of sentence i). `lang`, `tokenize`: BLEU's
    tokenizer, as `bleu_metrics` picks it; without `lang`, a tokenizer made for one language (zh,
    ja-mecab, ko-mecab: TOKENIZER_LANGS) gives TER and chrF that language. `chrf_word_order=2` is chrF++
    (Popovic, 2017). `confidence`: that many bootstrap resamples (sacreBLEU's, 1,000 as its --confidence),
    each score with its 95% interval, for telling whether two systems differ. Hypotheses that look
    tokenized (TOKENIZED_PERIODS lines or more ending in " .") or like subword pieces (SUBWORD_SHARE of them
    with BPE's "@@ " or SentencePiece's U+2581) get a warning."""
    hypotheses = str_list(hypotheses, "hypotheses", "lines", "line")
    streams = enumerate(_streams(references))
    references = [str_list(r, f"references[{j}]", "lines", "line") for j, r in streams]
    if not references:
        raise UserError("no references: nothing to score against")
    if not hypotheses:
        raise UserError("no hypotheses: nothing to score")
    for j, refs in enumerate(references):
        if len(refs) != len(hypotheses):
            raise UserError(
                f"reference {j + 1} has {len(refs)} line{'s' * (len(refs) != 1)} but the hypotheses have "
                f"{len(hypotheses)}"
            )
    # sacreBLEU takes 0-2 (0: chrF, 2: chrF++); 2.0 failed inside it, True signed itself nw:yes
    if type(chrf_word_order) is not int or chrf_word_order not in (0, 1, 2):
        raise UserError(f"chrF's word order {chrf_word_order!r} is not 0, 1 or 2 (2 is chrF++)")
    if isinstance(confidence, bool) or not isinstance(confidence, int) or confidence < 0 or confidence == 1:
        raise SettingError("confidence", confidence, ": give a whole number of bootstrap resamples, at "
                           "least 2 (0: off)")  # 2.5 failed inside sacreBLEU
    if not isinstance(ter, bool):  # "no" is true
        raise TypeError(f"ter={ter!r} must be True or False")
    lang = target_language(lang) or tokenizer_language(tokenize)
    if chrf_word_order and (unspaced := UNSPACED.get(lang)):
        raise UserError(f"chrF's word n-grams (word order {chrf_word_order}) are split at spaces, which "
                        f"{unspaced} text has few of: use chrF's characters alone (0)")
    extra = [(None, ter_metric(lang))] if ter else []
    bleu, lowercased = bleu_metrics(lang, tokenize)
    metrics = [(None, bleu), (None, _CHRF(word_order=chrf_word_order)),
               (LOWERCASE_LABEL.format(bleu.tokenizer_signature), lowercased)] + extra
    too_many = SettingError("confidence", confidence, ": out of memory for that many bootstrap resamples of "
                            f"{len(hypotheses)} lines; give fewer (sacreBLEU's default is 1,000)")
    if confidence * len(hypotheses) * 8 > MAX_BOOTSTRAP_BYTES:
        raise too_many
    _warn_if_tokenized(hypotheses)
    out = []
    for label, metric in metrics:
        try:
            result = metric.corpus_score(list(hypotheses), [list(r) for r in references],
                                         n_bootstrap=confidence or 1)
        except MemoryError:  # sacreBLEU draws all resamples of every line at once (numpy's message: a traceback)
            raise too_many from None
        ci = getattr(result, "_ci", None) if confidence else None
        ci = None if ci is None else float(ci)  # sacreBLEU's is a numpy float32, which json cannot write
        out.append(Score(label or result.name, result.score, str(metric.get_signature()), str(result), ci))
    return out


def _warn_if_tokenized(hypotheses: Sequence[str]) -> None:
    """A warning where TOKENIZED_PERIODS or more of `hypotheses` end in " .", as tokenized text does, and
    one where SUBWORD_SHARE of them or more hold BPE's or SentencePiece's marks, as subword pieces do."""
    n = f"{len(hypotheses):,}"
    periods = sum(line.endswith(" .") for line in hypotheses)
    if periods >= TOKENIZED_PERIODS:
        log.warning("%s of the %s hypotheses end in a tokenized period (' .'): they look tokenized, which "
                    "may lower the scores; detokenize them first (the scores are for detokenized text)",
                    f"{periods:,}", n)
    share = SUBWORD_SHARE * len(hypotheses)
    if (bpe := sum("@@ " in line or line.endswith("@@") for line in hypotheses)) >= share:
        log.warning("%s of the %s hypotheses hold BPE's '@@ ' marks: they look like subword pieces, which "
                    "lowers the scores; join them first (fairseq's --remove-bpe, or sed -E "
                    "'s/(@@ )|(@@ ?$)//g')", f"{bpe:,}", n)
    if (pieces := sum("\u2581" in line for line in hypotheses)) >= share:
        log.warning("%s of the %s hypotheses hold SentencePiece's '\u2581' (U+2581) marks: they look like "
                    "subword pieces, which score near 0; decode them first (spm_decode, or fairseq's "
                    "--remove-bpe sentencepiece)", f"{pieces:,}", n)


def _streams(references: Sequence[Sequence[str]]) -> list:
    """Reference streams: a flat list of lines is one stream given without its list, and refused."""
    streams = [] if isinstance(references, (str, bytes)) else list(references)
    if isinstance(references, (str, bytes)) or any(isinstance(r, str) for r in streams):
        raise TypeError("references is a list of reference streams, each a list of lines: pass [lines]")
    return streams


def _paths(paths: Sequence[str | Path], name: str) -> list[str | Path]:
    if isinstance(paths, (str, Path)):  # one path, iterable by character
        raise TypeError(f"{name} is a list of files: pass [{str(paths)!r}]")
    return list(paths)


def evaluate_files(
    hypotheses: str | Path, references: Sequence[str | Path], lang: str = "", tokenize: str | None = None,
    **options: int | bool,
) -> list[Score]:
    """Score a file of translations ("-": standard input) against reference files, line by line (`lang`,
    `tokenize` and `options`: as `corpus_scores`)."""
    references = _paths(references, "references")  # before reading the hypotheses
    return score_lines(read_hypotheses(hypotheses), hypotheses, references, lang, tokenize, **options)


def read_hypotheses(path: str | Path) -> list[str]:
    """The lines of a translation file, or of standard input for "-" (`aiayn translate ... | aiayn
    evaluate - REF`), checked as every text file is."""
    if str(path) == "-":
        if sys.stdin is None:  # started with stdin closed (`<&-`, some service managers)
            raise UserError("<stdin>: closed; give the translations as a file")
        return read_lines("<stdin>", sys.stdin.buffer, done="scored")
    return read_once(path)


def read_once(path: str | Path) -> list[str]:
    """`read_lines`, which also takes a pipe named by path (`<(head ref.de)`), read once."""
    if Path(path).is_fifo():
        try:
            with open(path, "rb") as f:
                return read_lines(path, f, done="scored")
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    return read_lines(path, done="scored")


def score_lines(
    hyps: Sequence[str], name: str | Path, references: Sequence[str | Path], lang: str = "",
    tokenize: str | None = None, **options: int | bool,
) -> list[Score]:
    """`corpus_scores` of translations already read (from `name`) against reference files."""
    references = _paths(references, "references")  # a generator is read once, for the names below too
    if any(str(r) == "-" for r in references):  # else "-: file not found"
        raise UserError("-: only the translations (HYP) may come from standard input; give each reference "
                        "as a file, or as <(command)")
    _check_stdin_read_once(name, references)
    name = "<stdin>" if str(name) == "-" else name
    if not hyps:
        raise UserError(f"{name}: empty, nothing to score")
    refs = [read_once(r) for r in references]
    for path, lines in zip(references, refs):
        require_same_count(path, len(lines), name, len(hyps))  # as training and score name it
    scores = corpus_scores(hyps, refs, lang, tokenize, **options)
    _warn_of_files(hyps, name, refs, references)  # once scored: a refused setting is the one line said
    return scores


def _warn_of_files(hyps: Sequence[str], name: str | Path, refs: list[list[str]], references: list) -> None:
    """Warnings, naming the files, of what sacreBLEU scores silently: a file whose every line is blank
    (BLEU 0, ref_len 0: an empty file is refused, a file of newlines was not), and a reference in another
    Unicode normalization form than the translations (NFD's é is e and a combining accent, NFC's one
    character: the same text scored 79 BLEU)."""
    blank = [(name, "no translations to score")] if not any(map(str.strip, hyps)) else []
    blank += [(path, "no reference text to score against") for path, lines in zip(references, refs)
              if not any(map(str.strip, lines))]
    for path, said in blank:
        log.warning("%s: every line is blank: %s", path, said)
    form = _unicode_form(hyps)
    for path, lines in zip(references, refs):
        if form and (other := _unicode_form(lines)) and other != form:
            log.warning("%s is in Unicode's %s, %s in its %s: the same letters are other characters to the "
                        "scores, which lowers them; normalize both to one form (NFC) first", name,
                        UNICODE_FORMS[form], path, UNICODE_FORMS[other])


def _unicode_form(lines: Sequence[str]) -> str:
    """"NFD" where more of `lines` hold decomposed letters (that NFC would compose) than composed ones (that
    NFD would decompose), "NFC" where fewer, "" where as many (text in ASCII alone: none of either)."""
    decomposed = sum(not unicodedata.is_normalized("NFC", line) for line in lines)
    composed = sum(not unicodedata.is_normalized("NFD", line) for line in lines)
    return "NFD" if decomposed > composed else "NFC" if composed > decomposed else ""


def _check_stdin_read_once(hypotheses: str | Path, references: list[str | Path]) -> None:
    """A reference naming standard input (/dev/stdin) that the translations, or an earlier reference, read
    already: a pipe read a second time is empty ("line counts differ: /dev/stdin has 0 lines")."""
    reader = f"the translations ({hypotheses})" if reads_stdin_once(hypotheses) else None
    for path in filter(reads_stdin_once, references):
        if reader is not None:
            raise UserError(f"{path}: standard input, which {reader} read already, and it can be read only "
                            "once; give each reference as a file, or as <(command)")
        reader = f"reference {path}"
