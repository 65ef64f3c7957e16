"""Validation BLEU during training: greedy decoding of the validation set, scored by sacreBLEU.

Greedy rather than the paper's beam 4: it is a progress signal, computed often, and several times
cheaper; `aiayn translate` / `aiayn evaluate` give the reportable beam-search score.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from aiayn.data.batching import right_pad, token_batches
from aiayn.data.dataset import ParallelText, folds_case, simple_casefold
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding import DecodeConfig, generate
from aiayn.evaluate import bleu_metrics, unspaced_hint
from aiayn.model import Transformer, evaluating

log = logging.getLogger(__name__)


@torch.no_grad()
def validation_bleu(
    model: Transformer,
    tokenizer: Tokenizer,
    text: ParallelText,
    max_tokens: int,
    device: torch.device,
    lang: str = "",
    stop: Callable[[], bool] | None = None,
) -> tuple[float, str] | None:
    """(BLEU, sacreBLEU signature) of greedy translations of `text.src` against `text.tgt`; BLEU's
    tokenizer picked for target language `lang` as `aiayn evaluate -l` picks it. None where `stop()` turns
    true before the last batch (training's stop signal: the pass can take minutes, a scheduler's grace
    is short).

    Every pair of `text` is scored, those longer than data.max_len that the validation loss drops too, as
    `aiayn evaluate` scores the set: cutting them at data.max_len held the curve below the score the
    checkpoint gets. (Training's `text` holds the pairs with text on both sides: one with an empty side,
    which `aiayn evaluate` would score, is dropped as from the loss, and counted.) Only a source the model
    has no positions for, or longer than a batch (`max_tokens`), is cut (where `aiayn translate` would
    refuse it), and said. A target tokenizer that folds case (data.normalization "nmt_nfkc_cf", "nfkc_cf")
    is scored lowercased, as its signature says, against references case-folded as it folds them.

    On a terminal a bar counts the sentences (a pass over a real validation set takes minutes, and was
    silent), and goes when the pass ends."""
    limit = min(model.config.max_len, max_tokens)
    sources = [tokenizer.encode_src(s) for s in text.src]
    if cut := sum(len(ids) > limit for ids in sources):
        log.warning("validation BLEU: %d source(s) longer than %d pieces (%s) cut to fit", cut, limit,
                    "model.max_len" if limit == model.config.max_len else "train.max_tokens")
    sources = [ids if len(ids) <= limit else ids[: limit - 1] + [tokenizer.eos_id] for ids in sources]
    lengths = [len(ids) for ids in sources]
    hypotheses = [""] * len(sources)
    # disable=None: no bar where stderr is not a terminal (a log file), as training's
    with evaluating(model), tqdm(total=len(sources), desc="validation BLEU", unit="sent", leave=False,
                                 disable=None) as bar:
        for indices in token_batches(lengths, lengths, max_tokens):
            if stop is not None and stop():
                return None
            src = right_pad([sources[i] for i in indices], tokenizer.pad_id)  # (B, S)
            for i, hyps in zip(indices, generate(model, src.to(device), DecodeConfig(beam=1))):
                hypotheses[i] = tokenizer.decode_tgt(hyps[0].tokens)
            bar.update(len(indices))
    bleu, lowercased = bleu_metrics(lang)
    references = text.tgt
    if folds_case(tokenizer.tgt):  # the model writes lowercase alone: cased references held the curve down
        bleu = lowercased  # (Multi30k German: 25.8 for a perfect model); its signature says case:lc
        # folded as the tokenizer folds: sacreBLEU's str.lower keeps a Greek word's final ς, which the
        # model writes σ (a perfect model scored 67.4 on Greek)
        references = [simple_casefold(line) for line in text.tgt]
    # the references show the language; an early model's hypotheses (a few words repeated) looked unspaced
    if (note := unspaced_hint(text.tgt, lang, advice="set train.bleu_lang")) is not None:
        log.warning("validation BLEU: %s", note)  # else a flat curve near 0 for Chinese or Japanese
    # nothing said of hypotheses ending in " ." (bleu_metrics' BLEU has sacreBLEU's block off): they are
    # the model's own detokenized output, and an early model's " ." is no detokenizer forgotten
    return bleu.corpus_score(hypotheses, [references]).score, str(bleu.get_signature())
