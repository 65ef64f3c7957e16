"""Scores the way the field reports them: sacreBLEU BLEU and chrF with their signatures (Post, 2018).

The inputs are detokenized, cased translations and references (what `aiayn translate` writes, what the
test sets hold); sacreBLEU applies its own standard tokenization (13a, or for a Chinese, Japanese or
Korean target the one sacreBLEU picks for that language: 13a leaves their unspaced text as a few long
"words" and the score near 0), so numbers compare across papers that report the signature. Older papers (the Transformer paper among them) scored tokenized,
sometimes lowercased text with multi-bleu.perl; `BLEU-lc` (lowercased, 13a-tokenized) is given for
comparison with those, clearly labelled, and is not the score to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF

from aiayn.data.dataset import read_lines
from aiayn.errors import UserError

LOWERCASE_LABEL = "BLEU-lc (lowercased, {}-tokenized: only for comparison with older papers, not comparable)"
TOKENIZERS = tuple(BLEU.TOKENIZERS)  # sacreBLEU's: 13a, intl, zh, ja-mecab, ko-mecab, char, none, ...


@dataclass(frozen=True)
class Score:
    """One corpus-level metric."""

    name: str  # BLEU, chrF2, or the BLEU-lc label
    score: float  # 0-100
    signature: str  # sacreBLEU's signature: what was computed, with which version
    detail: str  # sacreBLEU's full line (n-gram precisions, brevity penalty, lengths)


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]], lang: str = "", tokenize: str | None = None
) -> list[Score]:
    """BLEU, chrF and the lowercased BLEU of `hypotheses` against one or more reference streams
    (`references[j][i]` is reference j of sentence i). `lang`: the target language's code, from which
    sacreBLEU picks BLEU's tokenizer (zh, ja-mecab, ko-mecab; 13a for the others); `tokenize` names one."""
    if not hypotheses:
        raise UserError("no hypotheses: nothing to score")
    for j, refs in enumerate(references):
        if len(refs) != len(hypotheses):
            raise UserError(
                f"reference {j + 1} has {len(refs)} lines but the hypotheses have {len(hypotheses)}"
            )
    if tokenize is not None and tokenize not in TOKENIZERS:
        raise UserError(f"tokenize={tokenize!r} is not one of sacreBLEU's: {', '.join(TOKENIZERS)}")
    try:  # ja-mecab and ko-mecab need packages sacreBLEU does not install: a RuntimeError at construction
        bleu, lowercased = (BLEU(lowercase=lc, tokenize=tokenize, trg_lang=lang) for lc in (False, True))
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        advice = next((line for line in lines if "pip install" in line), lines[0] if lines else "")
        raise UserError(f"sacreBLEU's {tokenize or lang} tokenizer needs packages missing here: {advice}") from None
    out = []
    for label, metric in (("BLEU", bleu), ("chrF2", CHRF()), (LOWERCASE_LABEL.format(bleu.tokenizer_signature), lowercased)):
        result = metric.corpus_score(list(hypotheses), [list(r) for r in references])
        out.append(Score(label, result.score, str(metric.get_signature()), str(result)))
    return out


def evaluate_files(
    hypotheses: str | Path, references: Sequence[str | Path], lang: str = "", tokenize: str | None = None
) -> list[Score]:
    """Score a file of translations against reference files, line by line (`lang`, `tokenize`: as
    `corpus_scores`)."""
    hyps = read_lines(hypotheses)
    if not hyps:
        raise UserError(f"{hypotheses}: empty, nothing to score")
    refs = [read_lines(r) for r in references]
    for path, lines in zip(references, refs):
        if len(lines) != len(hyps):
            raise UserError(f"{path}: {len(lines)} lines, but {hypotheses} has {len(hyps)}")
    return corpus_scores(hyps, refs, lang, tokenize)
