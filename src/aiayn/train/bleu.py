"""Validation BLEU during training: greedy decoding of the validation set, scored by sacreBLEU.

Greedy rather than the paper's beam 4: it is a progress signal, computed often, and several times
cheaper; `aiayn translate` / `aiayn evaluate` give the reportable beam-search score.
"""

from __future__ import annotations

import torch
from sacrebleu.metrics import BLEU

from aiayn.data.batching import right_pad, token_batches
from aiayn.data.dataset import ParallelText
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding import DecodeConfig, generate
from aiayn.model import Transformer


@torch.no_grad()
def validation_bleu(
    model: Transformer,
    tokenizer: Tokenizer,
    text: ParallelText,
    max_len: int,
    max_tokens: int,
    device: torch.device,
) -> tuple[float, str]:
    """(BLEU, sacreBLEU signature) of greedy translations of `text.src` against `text.tgt`."""
    was_training = model.training
    model.eval()
    sources = [tokenizer.encode_src(s) for s in text.src]
    sources = [ids if len(ids) <= max_len else ids[: max_len - 1] + [tokenizer.eos_id] for ids in sources]
    lengths = [len(ids) for ids in sources]
    hypotheses = [""] * len(sources)
    for indices in token_batches(lengths, lengths, max_tokens):
        src = right_pad([sources[i] for i in indices], tokenizer.pad_id)  # (B, S)
        for i, hyps in zip(indices, generate(model, src.to(device), DecodeConfig(beam=1))):
            hypotheses[i] = tokenizer.decode_tgt(hyps[0].tokens)
    model.train(was_training)
    bleu = BLEU()
    return bleu.corpus_score(hypotheses, [text.tgt]).score, str(bleu.get_signature())
