"""What the export tests share (test_ctranslate2.py, test_marian_export.py): a small parallel corpus for
their SentencePiece models, and a micro model whose every weight counts."""

from __future__ import annotations

from pathlib import Path

import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.config import model_config
from aiayn.data.tokenizer import Tokenizer
from aiayn.model import Transformer

SRC_LINES = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'} and {i % 7} is small" for i in range(200)]
TGT_LINES = [f"die Zahl {i} ist {'gerade' if i % 2 == 0 else 'ungerade'} und {i % 7} ist klein"
             for i in range(200)]


@torch.no_grad()
def random_model(tokenizer: Tokenizer, likelier_eos: float = 0.0, **overrides) -> Transformer:
    """A micro model of `tokenizer`'s vocabularies, `overrides` on its config: LayerNorms and biases away
    from 1 and 0 so that each one counts, embeddings that the positions do not drown, a source that the
    decoder attends to. `likelier_eos` is added to EOS's logit bias where the model has one."""
    separate = not overrides.get("share_embeddings", True)
    config = model_config(
        "micro", n_heads=4, n_layers=2, vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size if separate else None, pad_id=tokenizer.pad_id,
        eos_id=tokenizer.eos_id, **{"max_len": 64, "decoder_start_id": tokenizer.bos_id, **overrides})
    model = Transformer(config).eval()
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
        elif "embed" in name:  # unscaled embeddings of std d^-1/2 drowned in the positions: a constant output
            p.mul_(1.0 if config.scale_embedding else config.d_model**0.5)
        elif "src_attn" in name:
            p.mul_(3.0)  # encoder-decoder attention sharper than at initialization, so the source counts
    if model.final_logits_bias is not None:
        model.final_logits_bias.normal_(0.0, 0.3)
        model.final_logits_bias[tokenizer.eos_id] += likelier_eos
    return model


def variant_checkpoint(path: Path, spm_models: tuple[Path, Path], likelier_eos: float = 0.0,
                       **overrides) -> Path:
    """A `random_model` (seed 0) of `overrides` saved at `path`: one SentencePiece model for a shared
    vocabulary, both (source, target) for `share_embeddings=False`."""
    src, tgt = spm_models
    tokenizer = Tokenizer(src, tgt) if overrides.get("share_embeddings") is False else Tokenizer(src)
    torch.manual_seed(0)
    save_checkpoint(path, random_model(tokenizer, likelier_eos, **overrides), tokenizer)
    return path
