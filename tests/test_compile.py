"""`compile_for_training` computes the eager loss and gradients, and leaves the saved state alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import model_config
from aiayn.model import Transformer
from aiayn.model.compile import compile_for_training


def loss_fn(logits, tgt_out):
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1)


def test_a_training_model_with_dropout_compiles_as_one_graph():
    """The CPU dropout's `random_` is not traced: 18 graph breaks for a 2+2-layer model in training mode,
    and `SublayerConnection` recompiled past dynamo's limit, so `train.compile` ran mostly eager. Traced,
    dropout is `F.dropout`, whose random numbers inductor makes."""
    import torch._dynamo

    model = Transformer(model_config("micro", vocab_size=50, dropout=0.1)).train()
    src, tgt_in = torch.randint(3, 50, (3, 7)), torch.randint(3, 50, (3, 6))
    explained = torch._dynamo.explain(model)(src, tgt_in)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow
def test_compiled_loss_and_gradients_equal_eager():
    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=50, dropout=0.0))
    src = torch.randint(3, 50, (3, 7))
    src[0, 5:] = 0  # padding
    tgt_in, tgt_out = torch.randint(3, 50, (3, 6)), torch.randint(3, 50, (3, 6))
    eager = loss_fn(model(src, tgt_in), tgt_out)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    keys = set(model.state_dict())
    compiled = compile_for_training(model, loss_fn)(src, tgt_in, tgt_out)
    grads = torch.autograd.grad(compiled, list(model.parameters()))
    torch.testing.assert_close(compiled, eager)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert set(model.state_dict()) == keys  # no `_orig_mod.` prefixes
