"""Scores the way the field reports them: sacreBLEU BLEU and chrF with their signatures (Post, 2018).

The inputs are detokenized, cased translations and references (what `aiayn translate` writes, what the
test sets hold); sacreBLEU applies its own standard tokenization (13a), so numbers compare across
papers that report the signature. Older papers (the Transformer paper among them) scored tokenized,
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

LOWERCASE_LABEL = "BLEU-lc (lowercased, 13a-tokenized: only for comparison with older papers, not comparable)"


@dataclass(frozen=True)
class Score:
    """One corpus-level metric."""

    name: str  # BLEU, chrF2, or the BLEU-lc label
    score: float  # 0-100
    signature: str  # sacreBLEU's signature: what was computed, with which version
    detail: str  # sacreBLEU's full line (n-gram precisions, brevity penalty, lengths)


def corpus_scores(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> list[Score]:
    """BLEU, chrF and the lowercased BLEU of `hypotheses` against one or more reference streams
    (`references[j][i]` is reference j of sentence i)."""
    if not hypotheses:
        raise UserError("no hypotheses: nothing to score")
    for j, refs in enumerate(references):
        if len(refs) != len(hypotheses):
            raise UserError(
                f"reference {j + 1} has {len(refs)} lines but the hypotheses have {len(hypotheses)}"
            )
    out = []
    for label, metric in (("BLEU", BLEU()), ("chrF2", CHRF()), (LOWERCASE_LABEL, BLEU(lowercase=True))):
        result = metric.corpus_score(list(hypotheses), [list(r) for r in references])
        out.append(Score(label, result.score, str(metric.get_signature()), str(result)))
    return out


def evaluate_files(hypotheses: str | Path, references: Sequence[str | Path]) -> list[Score]:
    """Score a file of translations against reference files, line by line."""
    hyps = read_lines(hypotheses)
    if not hyps:
        raise UserError(f"{hypotheses}: empty, nothing to score")
    refs = [read_lines(r) for r in references]
    for path, lines in zip(references, refs):
        if len(lines) != len(hyps):
            raise UserError(f"{path}: {len(lines)} lines, but {hypotheses} has {len(hyps)}")
    return corpus_scores(hyps, refs)
