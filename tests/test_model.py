"""The model against peers we did not write (torch.nn.Transformer, a float64 formula) and its invariants."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import ConfigError, ModelConfig, model_config
from aiayn.model import MultiHeadAttention, Transformer, causal_mask, padding_mask, sinusoidal_positions
from aiayn.model.kv_cache import KVCache
from conftest import padded_batch, record_checkpointed_layers, tiny_model
from reference import TorchReference, naive_attention


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matches_torch_nn_transformer(norm_first, activation):
    model = tiny_model(norm_first=norm_first, activation=activation, n_layers=3, n_decoder_layers=2)
    ref = TorchReference(model).eval()
    src = padded_batch([7, 4, 1], 50)
    tgt = padded_batch([5, 6, 2], 50)
    with torch.no_grad():
        ours, theirs = model(src, tgt), ref(src, tgt)
    real = tgt != 0  # nn.Transformer's outputs at padded target rows differ by design; compare real ones
    assert not ours.isnan().any()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


def test_sdpa_attention_equals_float64_formula():
    mha = MultiHeadAttention(d_model=32, n_heads=4, self_attention=False).eval()
    x, memory = torch.randn(3, 5, 32), torch.randn(3, 7, 32)
    mask = padding_mask(padded_batch([7, 3, 5], 50), 0)  # (B, 1, 1, S)
    with torch.no_grad():
        out = mha(x, memory, mask=mask)
        q = mha.q_proj(x).view(3, 5, 4, 8).transpose(1, 2)
        k, v = mha.project_kv(memory)
        expected = naive_attention(q, k, v, mask).transpose(1, 2).reshape(3, 5, 32)
        expected = mha.out_proj(expected.float())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_causal_self_attention_equals_float64_formula():
    mha = MultiHeadAttention(d_model=16, n_heads=2, self_attention=True).eval()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        out = mha(x, is_causal=True)
        q, k, v = (t.view(2, 6, 2, 8).transpose(1, 2) for t in mha.qkv_proj(x).chunk(3, -1))
        expected = mha.out_proj(naive_attention(q, k, v, causal_mask(6)).transpose(1, 2).reshape(2, 6, 16).float())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_causal_mask_with_past_keys():
    m = causal_mask(2, past=3)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_decoder_is_causal():
    model = tiny_model()
    src, tgt = padded_batch([6, 6], 50), padded_batch([8, 8], 50)
    changed = tgt.clone()
    t = 4
    changed[:, t + 1 :] = torch.randint(3, 50, changed[:, t + 1 :].shape)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("norm_first", [False, True])
def test_padding_leaves_real_positions_unchanged(norm_first):
    model = tiny_model(norm_first=norm_first)
    src, tgt = padded_batch([5, 3], 50), padded_batch([4, 6], 50)
    with torch.no_grad():
        base = model(src, tgt)
        padded = model(F.pad(src, (0, 9)), F.pad(tgt, (0, 4)))  # pad id 0 on the right
    for i, n in enumerate([4, 6]):
        torch.testing.assert_close(padded[i, :n], base[i, :n], atol=1e-5, rtol=1e-5)


def test_each_sentence_alone_equals_the_batch():
    model = tiny_model()
    src, tgt = padded_batch([5, 2, 7], 50), padded_batch([3, 6, 4], 50)
    with torch.no_grad():
        batch = model(src, tgt)
        for i, (s, t) in enumerate(zip([5, 2, 7], [3, 6, 4])):
            alone = model(src[i : i + 1, :s], tgt[i : i + 1, :t])
            torch.testing.assert_close(batch[i, :t], alone[0], atol=1e-5, rtol=1e-5)


def test_no_nan_for_all_padding_rows_forward_and_backward():
    model = tiny_model(dropout=0.1).train()
    src = padded_batch([4, 1], 50)
    src[1, 0] = 0  # a source made only of padding
    tgt = padded_batch([3, 2], 50)
    logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_cached_decoding_equals_full_recomputation():
    model = tiny_model()
    src, tgt = padded_batch([6, 3], 50), padded_batch([7, 7], 50)
    with torch.no_grad():
        memory = model.encode(src)
        mask = model.src_mask(src)
        full = model.decode(tgt, memory, mask)
        cache = model.new_cache(batch_size=2, max_len=7)
        prefix = model.decode(tgt[:, :3], memory, mask, cache)  # a forced prefix in one call
        steps = [model.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_sinusoids_are_the_papers_formula():
    pe = sinusoidal_positions(50, 16)
    pos, i = 17, 3
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    sin_cos = sinusoidal_positions(50, 16, "sin_cos")
    torch.testing.assert_close(sin_cos[:, :8], pe[:, 0::2])
    torch.testing.assert_close(sin_cos[:, 8:], pe[:, 1::2])


def test_position_tables_are_exact_in_the_models_dtype():
    """The tables follow a cast: a float64 model kept float32-accurate positions (3e-8 off, so no float64
    reference), and one cast to bfloat16 and back kept bfloat16's, unlike the same model saved and loaded."""
    model = tiny_model().double()
    pos, i, d = 17, 3, model.config.d_model
    for pe in (model.src_embed.pe, model.tgt_embed.pe):
        assert pe.dtype == torch.float64
        assert abs(pe[pos, 2 * i].item() - math.sin(pos / 10000 ** (2 * i / d))) < 1e-12
    round_trip = tiny_model().to(torch.bfloat16).float()
    assert torch.equal(round_trip.src_embed.pe, tiny_model().src_embed.pe)


def test_an_unknown_position_layout_is_refused():
    """Any string but "interleaved" gave the sin_cos table, silently ("Interleaved" included)."""
    with pytest.raises(ValueError, match="'Interleaved' is not one of interleaved, sin_cos"):
        sinusoidal_positions(4, 4, "Interleaved")


def test_parameter_count_is_every_distinct_weight_frozen_or_not():
    """Its callers (`aiayn info`, a memory estimate, MFU) mean the model's size, frozen weights included."""
    model = tiny_model()
    embedding = model.src_embed.embed.weight  # shared by both stacks and the output projection
    embedding.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model.num_parameters() == trainable + embedding.numel()


@pytest.mark.parametrize("preset,paper", [("base", 65e6), ("big", 213e6)])
def test_parameter_counts_match_the_paper(preset, paper):
    model = Transformer(model_config(preset, vocab_size=37000))
    assert abs(model.num_parameters() - paper) / paper < 0.05


def test_attention_projections_start_as_fairseqs():
    """Each of W^Q, W^K, W^V is drawn as its own d x d Xavier-uniform matrix with gain 1/sqrt(2) and W^O
    with gain 1, in self- and encoder-decoder attention alike (fairseq's MultiheadAttention). Xavier over
    the packed matrices gave W^Q three scales: 3d x d, 2d x d and d x d."""
    torch.manual_seed(0)
    d = 256
    model = Transformer(ModelConfig(d_model=d, n_heads=4, d_ff=512, n_layers=1, vocab_size=50))

    def check(w, gain):
        bound = gain * math.sqrt(6 / (w.shape[0] + w.shape[1]))  # Glorot and Bengio (2010), eq. 16
        assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
        assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.02  # a uniform's standard deviation

    layer = model.decoder[0]
    for linear in layer.self_attn.qkv_proj, layer.src_attn.q_proj, layer.src_attn.kv_proj:
        for w in linear.weight.split(d):
            check(w, 2**-0.5)
        assert not linear.bias.any()
    for attention in layer.self_attn, layer.src_attn, model.encoder[0].self_attn:
        check(attention.out_proj.weight, 1.0)
    check(layer.feed_forward.w_1.weight, 1.0)  # the rest as before: Xavier over the matrix


def test_embeddings_are_shared_and_scaled():
    model = tiny_model()
    assert model.src_embed.embed.weight is model.tgt_embed.embed.weight is model.generator.weight
    tok = torch.tensor([[5]])
    expected = model.src_embed.embed.weight[5] * math.sqrt(32) + model.src_embed.pe[0]
    torch.testing.assert_close(model.src_embed(tok)[0, 0], expected)
    separate = tiny_model(share_embeddings=False, tgt_vocab_size=40)
    assert separate.src_embed.embed.weight.shape == (50, 32)
    assert separate.generator.weight is separate.tgt_embed.embed.weight
    assert separate(padded_batch([3], 50), padded_batch([2], 40)).shape == (1, 2, 40)


def test_a_target_vocabulary_of_its_own_is_not_shared_even_of_the_same_size():
    """tgt_vocab_size None is one vocabulary; a given one is the target's own. With share_embeddings=True
    (the default), one the size of the source's had the two tied silently, where one more was refused."""
    for size in (50, 51):
        with pytest.raises(ConfigError, match=rf"^ModelConfig: share_embeddings=True needs one vocabulary, "
                           rf"but vocab_size=50 and tgt_vocab_size={size} are two: leave tgt_vocab_size None "
                           r"to share one, or set share_embeddings=False$"):
            model_config("tiny", vocab_size=50, tgt_vocab_size=size)
    two = tiny_model(tgt_vocab_size=50, share_embeddings=False)
    assert two.src_embed.embed.weight is not two.tgt_embed.embed.weight


def test_attention_refuses_heads_that_do_not_divide_the_width():
    """MultiHeadAttention(129, 2) was built, then failed at the first forward with a reshape error."""
    from aiayn.model import MultiHeadAttention

    with pytest.raises(ValueError, match="d_model=129 is not divisible into n_heads=2"):
        MultiHeadAttention(129, 2, self_attention=True)


def test_encoder_decoder_attention_without_memory_says_so():
    """MultiHeadAttention(..., self_attention=False)(x) failed in linear(): "argument 'input' (position 1)
    must be Tensor, not NoneType"."""
    from aiayn.model import MultiHeadAttention

    with pytest.raises(TypeError, match=r"^encoder-decoder attention \(self_attention=False\) reads memory"):
        MultiHeadAttention(32, 4, self_attention=False)(torch.randn(1, 3, 32))


def test_every_activation_a_config_accepts_builds_a_model():
    """The config's names and the model's functions are two lists: one name short in the model was a
    KeyError at construction, after the config had accepted it."""
    from aiayn.config import ACTIVATIONS
    from aiayn.model.transformer import ACTIVATION_FUNCTIONS

    assert set(ACTIVATION_FUNCTIONS) == set(ACTIVATIONS)
    for activation in ACTIVATIONS:
        tiny_model(activation=activation)


def test_the_compiled_step_slot_is_no_part_of_the_state_dict():
    """`one_row_step` (set by translate --compile) is a plain attribute: a step set there adds no key to
    the state dict, so a checkpoint of a model compiled for translating is the model's."""
    model = Transformer(model_config("micro", vocab_size=50))
    keys = list(model.state_dict())
    assert model.one_row_step is None
    model.one_row_step = object()
    assert list(model.state_dict()) == keys and "one_row_step" not in dict(model.named_modules())


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="n_heads"):
        ModelConfig(vocab_size=10, d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="activation"):
        ModelConfig(vocab_size=10, activation="tanh")
    with pytest.raises(ConfigError, match="unknown ModelConfig key.*d_modle"):
        model_config("base", vocab_size=10, d_modle=3)
    with pytest.raises(ConfigError, match="share_embeddings"):
        ModelConfig(vocab_size=10, tgt_vocab_size=12)
    with pytest.raises(ConfigError, match="dropout"):
        ModelConfig(vocab_size=10, dropout="0.1")
    with pytest.raises(ConfigError, match="preset"):
        model_config("huge", vocab_size=10)
    with pytest.raises(ConfigError, match="n_decoder_layers=-2 must be positive"):
        ModelConfig(vocab_size=10, n_decoder_layers=-2)  # was a model with no decoder, silently
    with pytest.raises(ConfigError, match="max_len=2000000 is more than 1,048,576"):
        ModelConfig(vocab_size=10, max_len=2_000_000)  # was a d_model x max_len table, or a MemoryError
    with pytest.raises(ConfigError, match="tgt_vocab_size=0 must be positive"):
        ModelConfig(vocab_size=10, tgt_vocab_size=0, share_embeddings=False)
    with pytest.raises(ConfigError, match=r"decoder_start_id=1 is outside the vocabulary of 1; eos_id=2"):
        ModelConfig(vocab_size=1)  # aiayn info base --vocab-size 1: the size it is too small for was unsaid


@pytest.mark.parametrize("overrides", [{}, {"share_embeddings": False, "tgt_vocab_size": 40, "final_logits_bias": True}])
def test_built_on_meta_then_materialized_equals_the_model(overrides):
    # The lazy-init path (FSDP and other large-model tools): build on `meta`, `to_empty`, load. The
    # position tables are not weights and the output projection is tied: both must come back.
    torch.manual_seed(0)
    ref = tiny_model(**overrides)
    with torch.device("meta"):
        model = Transformer(ref.config)
    model.to_empty(device="cpu").load_state_dict(ref.state_dict())
    model.eval()
    assert model.generator.weight is model.tgt_embed.embed.weight
    assert model.num_parameters() == ref.num_parameters()
    src, tgt = padded_batch([5, 3], 50), padded_batch([4, 2], model.config.target_vocab_size)
    torch.testing.assert_close(model(src, tgt), ref(src, tgt), rtol=0, atol=0)
    with torch.device("meta"):
        fresh = Transformer(ref.config)
    fresh.to_empty(device="cpu").reset_parameters()  # a new model, initialized after materializing
    assert torch.isfinite(fresh.eval()(src, tgt)).all()
    if fresh.final_logits_bias is not None:
        assert not fresh.final_logits_bias.any()
    # Module by module, as FSDP materializes: each module's own tensors, then its reset_parameters
    with torch.device("meta"):
        piecewise = Transformer(ref.config)
    for module in piecewise.modules():
        module.to_empty(device="cpu", recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.equal(piecewise.src_embed.pe, ref.src_embed.pe) and torch.equal(piecewise.tgt_embed.pe, ref.tgt_embed.pe)


def test_parameters_alone_on_meta_keep_the_position_tables(monkeypatch):
    """accelerate's init_empty_weights (include_buffers=False, its default) moves each parameter to the
    meta device as it is registered and leaves buffers where they are: the position tables, buffers that
    no checkpoint holds, were left uninitialized memory when the parameters' device decided."""
    ref = tiny_model()
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), param.requires_grad)

    monkeypatch.setattr(torch.nn.Module, "register_parameter", to_meta)
    torch.empty(4 * ref.config.max_len * ref.config.d_model).fill_(7.0)  # memory a table could reuse
    model = Transformer(ref.config)
    monkeypatch.undo()
    assert model.generator.weight.is_meta
    assert torch.equal(model.src_embed.pe, ref.src_embed.pe)
    assert torch.equal(model.tgt_embed.pe, ref.tgt_embed.pe)


def test_learns_a_copy_task():
    torch.manual_seed(0)
    model = tiny_model(vocab_size=13).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 50))
    losses = []
    for _ in range(500):
        seq = torch.randint(3, 13, (32, 8))
        src = torch.cat([seq, torch.full((32, 1), 2)], 1)  # ... EOS
        tgt_in = torch.cat([torch.full((32, 1), 1), seq], 1)  # BOS ...
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), src.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        warmup.step()
        losses.append(loss.item())
    # From log(10) = 2.3 at the start. The mean of the last 20 batches, not the last one: a single
    # batch's loss jumps (0.002 to 0.2 seen) with thread count and seed; the mean stayed below 0.016.
    assert sum(losses[-20:]) / 20 < 0.05


def test_the_package_and_its_command_line_import_torch_only_when_used():
    """`aiayn --help` and argument errors took 1.7 s, 1.6 of them importing torch through aiayn/__init__."""
    import subprocess
    import sys

    code = ("import sys, aiayn, aiayn.cli; assert 'torch' not in sys.modules, 'torch imported'; "
            "from aiayn import Transformer, KVCache; assert Transformer.__name__ == 'Transformer'; "
            "import aiayn as a; assert a.translate.Translator and a.model.KVCache is KVCache; "  # subpackages too
            "assert not hasattr(a, 'nope') and not hasattr(a, '__main__')")  # which ran the command line
    subprocess.run([sys.executable, "-c", code], check=True)


def test_train_is_aiayn_train_train_and_dir_lists_the_names_imported_on_first_use():
    """`from aiayn.train import train` failed (it was aiayn.train.loop.train alone), and dir(aiayn) left out
    Transformer and KVCache, which `__getattr__` imports on first use. The README's DataConfig and
    TrainConfig were in aiayn.train.config alone."""
    import subprocess
    import sys

    names = "DataConfig, RunConfig, TrainConfig, load_config, run_config"
    code = ("import sys, aiayn, aiayn.train; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert {'KVCache', 'Transformer'} <= set(dir(aiayn)), dir(aiayn); "
            f"assert {{'train', *'{names}'.split(', ')}} <= set(dir(aiayn.train)), dir(aiayn.train); "
            f"from aiayn.train import train, {names}; import aiayn.train.config as c; "
            f"assert train is aiayn.train.loop.train and ({names}) == (c.{names.replace(', ', ', c.')}); "
            "assert not hasattr(aiayn.train, 'nope')")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_src_mask_row_that_attends_to_nothing_is_refused():
    """torch's key_padding_mask (True = padding) or an all-False mask gave wrong logits, silently: a row
    of an unpadded source is all False there. With a cache, on its first step (later ones must pass the
    same mask); `forward`'s own mask of an all-padding source still trains (its outputs are zeros)."""
    model = tiny_model()
    src = padded_batch([4, 3], 50)  # row 0 has no padding
    key_padding = (src == 0)[:, None, None, :]
    with torch.no_grad():
        memory, tgt = model.encode(src), torch.tensor([[1, 5], [1, 6]])
        for mask in (key_padding, torch.zeros_like(key_padding)):
            with pytest.raises(ValueError, match=r"^src_mask row 0 is False everywhere: it is True where the "
                                                 r"source is a token \(Transformer.src_mask\), unlike torch's"):
                model.decode(tgt, memory, mask)
            with pytest.raises(ValueError, match=r"^src_mask row 0 is False everywhere"):
                model.decode(tgt, memory, mask, model.new_cache(2, 8))
        # a mask of another shape with a False row is refused for its shape: it was "src_mask row 4 is
        # False everywhere" (a row of it flattened; the batch has 2), or row 0 of a mask per beam row
        by_query = torch.ones(2, 1, 3, 4, dtype=torch.bool)
        by_query[1, 0, 1] = False
        for mask in (by_query, torch.zeros(4, 1, 1, 4, dtype=torch.bool)):
            with pytest.raises(ValueError, match=rf"^src_mask is torch\.bool \({', '.join(map(str, mask.shape))}"
                                                 r"\): it is bool \(B, 1, 1, S\) with memory's B, S = 2, 4"):
                model.decode(tgt, memory, mask)
        all_padding = src.clone()
        all_padding[1] = 0
        assert torch.isfinite(model(all_padding, tgt)).all()


def test_ids_that_are_no_tensor_and_a_config_that_is_no_model_config_are_type_errors():
    """A list, numpy array or str of ids was "'list' object has no attribute 'dim'" in forward, encode,
    decode, generate and force_decode; Transformer({...}) "'dict' object has no attribute 'd_model'"."""
    import numpy as np

    from aiayn.decoding import DecodeConfig, generate
    from aiayn.decoding.score import force_decode

    model = tiny_model()
    src = padded_batch([3], 50)
    calls = {"src": [model.encode, lambda x: model(x, src), lambda x: generate(model, x, DecodeConfig()),
                     lambda x: generate(model, x, DecodeConfig(sample=True, beam=1)),
                     lambda x: force_decode(model, x, [[5]])],
             "tgt_in": [lambda x: model(src, x), lambda x: model.decode(x, model.encode(src), None)]}
    for name, takers in calls.items():
        for take in takers:
            for ids, kind in (([[5, 2]], "list"), (np.array([[5, 2]]), "ndarray"), ("ab", "str")):
                with pytest.raises(TypeError, match=rf"^{name} is {kind}: token ids are a \(batch, length\) "
                                                    "torch tensor of ids"):
                    take(ids)
    for config in ({"d_model": 32}, None):
        with pytest.raises(TypeError, match=rf"^Transformer takes a ModelConfig, not {type(config).__name__}: "
                                            r"build one with model_config\('base', vocab_size=\.\.\.\)"):
            Transformer(config)


def test_a_cache_prints_its_rows_length_and_layers():
    """It printed as "<aiayn.model.kv_cache.KVCache object at 0x...>"."""
    model = tiny_model()
    cache = model.new_cache(4, 8, beam_size=2)
    with torch.no_grad():
        model.decode(torch.ones(4, 3, dtype=torch.long), model.encode(padded_batch([3, 3], 50)), None, cache)
    assert repr(cache) == "KVCache(rows=4, beam_size=2, length=3, max_len=8, layers=2, torch.float32, cpu)"


def test_mismatched_batches_and_bad_ids_are_refused_not_broadcast():
    """A 1-row target with a 2-row source, or a 1-row step into a 2-row cache, broadcast silently into
    2 rows of output; 1-D, empty or float ids failed deep inside with PyTorch's own messages."""
    model = tiny_model().eval()
    src = padded_batch([3, 2], 50)
    with pytest.raises(ValueError, match=r"^src has 2 rows and tgt_in 1: one target per source$"):
        model(src, torch.tensor([[1, 5]]))
    with torch.no_grad():
        memory = model.encode(src[:1])
        with pytest.raises(ValueError, match=r"^tgt_in has 2 rows, memory \(1, 3, \d+\): \(B, S, d\)"):
            model.decode(torch.tensor([[1, 5], [1, 6]]), memory, None)
        with pytest.raises(ValueError, match=r"^KVCache holds 2 rows; this step has 1$"):
            model.decode(torch.tensor([[1]]), memory, None, model.new_cache(2, 8))
    for bad, error, message in ((torch.tensor([5, 6, 2]), ValueError, r"src has shape \(3,\): token ids are"),
                                (torch.zeros(0, 3, dtype=torch.long), ValueError, r"no token to read"),
                                (torch.zeros(2, 0, dtype=torch.long), ValueError, r"no token to read"),
                                (torch.tensor([[5.0, 2.0]]), TypeError, r"src is torch.float32: token ids"),
                                # passed the check, then the embedding's "Expected ... Long, Int" error
                                (torch.tensor([[5, 2]], dtype=torch.int16), TypeError, r"is torch.int16")):
        with pytest.raises(error, match=message):
            model.encode(bad)
    assert torch.equal(model.encode(src.int()), model.encode(src))  # int32 is read as long is
    with torch.no_grad():  # a float 0/1 mask was added to the scores by SDPA: padding attended, silently
        memory = model.encode(src)
        for mask in (model.src_mask(src).float(), model.src_mask(src)[:, 0]):
            with pytest.raises(ValueError, match=r"^src_mask is torch\.\w+ \(.*\): it is bool \(B, 1, 1"):
                model.decode(torch.tensor([[1], [1]]), memory, mask)
        # Sentence 0's mask broadcast to sentence 1, silently; 3 rows or one per query or head failed in
        # attention or passed; one per beam row failed inside attention
        mask = model.src_mask(src)
        b, s = memory.shape[:2]
        for wrong in (mask[:1], mask[[0, 1, 1]], mask.expand(b, 1, 2, s), mask.expand(b, 2, 1, s)):
            shape = re.escape(str(tuple(wrong.shape)))
            expected = rf"^src_mask is torch\.bool {shape}: it is bool \(B, 1, 1, S\) with memory's B, S = "
            expected += rf"{b}, {s}, "
            with pytest.raises(ValueError, match=expected + "True where"):
                model.decode(torch.tensor([[1, 5], [1, 6]]), memory, wrong)
        beams = model.new_cache(2 * b, 8, beam_size=2)  # memory and mask per sentence, not per beam row
        with pytest.raises(ValueError, match=r"^src_mask is torch\.bool \(4, 1, 1, 3\): it is bool"):
            model.decode(torch.ones(2 * b, 1, dtype=torch.long), memory, mask.repeat_interleave(2, 0), beams)
        model.decode(torch.ones(2 * b, 1, dtype=torch.long), memory, mask, beams)
    # an id past the vocabulary, or a negative one, was the embedding's "index out of range in self"; a
    # memory of another width or dtype, "mat1 and mat2 shapes cannot be multiplied" or "must have the same
    # dtype" in the cross-attention
    v = model.config.vocab_size
    for bad in (v, -1):
        with pytest.raises(ValueError, match=rf"^src holds id {bad}, outside the vocabulary of {v} \(ids 0"):
            model.encode(torch.tensor([[5, 2], [bad, 2]]))
        with pytest.raises(ValueError, match=rf"^tgt_in holds id {bad}, outside the vocabulary of {v} "):
            model(src, torch.tensor([[1, 5], [1, bad]], dtype=torch.int32))
    with torch.no_grad():
        memory, tgt = model.encode(src), torch.tensor([[1], [1]])
        d = model.config.d_model
        with pytest.raises(ValueError, match=rf"^memory is torch.float32 \(2, 3, 7\): it is \(B, S, "
                                             rf"d_model={d}\) in the model's torch.float32, Transformer"
                                             r".encode's output$"):
            model.decode(tgt, memory[..., :7], None)
        with pytest.raises(TypeError, match=rf"^memory is torch.float64 \(2, 3, {d}\): it is \(B, S, d_mod"):
            model.decode(tgt, memory.double(), None)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts memory as it casts the weights
            model.decode(tgt, memory.bfloat16(), None)
    long = torch.ones(1, model.config.max_len + 1, dtype=torch.long)
    past = model.config.max_len + 1
    with pytest.raises(ValueError, match=rf"^tgt_in reaches position {past}, past max_len"):
        model(src[:1], long)  # the message said "sequence", not which
    with pytest.raises(ValueError, match=rf"^src reaches position {past}, past max_len"):
        model(long, src[:1])


def test_positions_are_checked_before_the_decoder_runs():
    """`positions` past B*T or below 0 failed in index_select as "index out of range in self", a (B, T)
    bool mask (what selecting by a mask would take) as "Index is supposed to be a vector", float ones as
    "Expected dtype int32 or int64": none named positions. Valid ones select those rows' logits."""
    model = Transformer(model_config("micro", vocab_size=50)).eval()
    src, tgt = torch.tensor([[5, 6, 7, 2], [5, 2, 0, 0]]), torch.tensor([[1, 5, 6], [1, 8, 0]])
    for bad in (6, -1):
        with pytest.raises(ValueError, match=rf"^positions holds {bad}, outside the B\*T = 6 positions of "
                                             r"tgt_in \(0 to 5\)$"):
            model(src, tgt, positions=torch.tensor([0, bad]))
    with pytest.raises(TypeError, match=r"^positions is torch.bool: .*target_positions\(tgt_out, pad_id\), "
                                        r"not a mask$"):
        model(src, tgt, positions=tgt != 0)
    with pytest.raises(TypeError, match=r"^positions is torch.float32: it is \(N,\) long indices"):
        model(src, tgt, positions=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"^positions has shape \(1, 2\): it is \(N,\) indices"):
        model(src, tgt, positions=torch.tensor([[0, 1]]))
    with torch.no_grad():
        full, chosen = model(src, tgt), torch.tensor([0, 2, 4], dtype=torch.int32)
        torch.testing.assert_close(model(src, tgt, positions=chosen), full.flatten(0, 1)[chosen.long()])


def test_a_kv_cache_is_tied_to_its_memory_and_to_no_grad():
    """The cache kept the first step's cross-attention keys and silently ignored a later memory (the
    step attended over the first source's keys with the second's mask). In grad mode the copy into the
    cache failed with a message about views made in no_grad mode."""
    model = tiny_model().eval()
    a, b = padded_batch([3], 50), padded_batch([5], 50)
    with torch.no_grad():
        cache = model.new_cache(1, 8)
        model.decode(torch.tensor([[1]]), model.encode(a), None, cache)
        with pytest.raises(ValueError, match=r"^KVCache was filled for a memory of 1 x 3 source positions, "
                                             r"not 1 x 5: a new source needs a new cache$"):
            model.decode(torch.tensor([[4]]), model.encode(b), None, cache)
        # Another source of the same shape, too: its keys were never projected
        c = padded_batch([3], 50)
        assert not torch.equal(a, c)
        memory = model.encode(a)
        cache = model.new_cache(1, 8)
        model.decode(torch.tensor([[1]]), memory, None, cache)
        model.decode(torch.tensor([[4]]), memory, None, cache)  # the same memory goes on
        with pytest.raises(ValueError, match=r"^KVCache was filled from another memory: pass"):
            model.decode(torch.tensor([[4]]), model.encode(c), None, cache)
        model.decode(torch.tensor([[4]]), model.encode(a).clone(), None, cache)  # the same source again
        cache.select(torch.tensor([0]))  # rows selected: the caller's memory is selected alike, a new tensor
        model.decode(torch.tensor([[4]]), memory[torch.tensor([0])], None, cache)
        beams = model.new_cache(3, 8, beam_size=3)  # beams reordered: the sentences' memory stays
        model.decode(torch.tensor([[1], [1], [1]]), memory, None, beams)
        beams.select(torch.tensor([2, 0, 1]))
        with pytest.raises(ValueError, match=r"^KVCache was filled from another memory: pass"):
            model.decode(torch.tensor([[4], [4], [4]]), model.encode(c), None, beams)
    for sizes in ((1, 8, 0), (1, 0, 1), (0, 8, 1)):  # beam_size 0 was a ZeroDivisionError
        with pytest.raises(ValueError, match=r"^KVCache (batch_size|max_len|beam_size)=0: at least 1$"):
            KVCache(1, sizes[0], 1, 4, sizes[1], beam_size=sizes[2])
    # zero layers made a cache that decoded nothing; negative heads, a float or a string failed in
    # torch.zeros or a comparison, naming no argument
    for args, error, message in (((0, 1, 1, 4, 8), ValueError, r"n_layers=0: at least 1"),
                                 ((1, 1, -2, 4, 8), ValueError, r"n_heads=-2: at least 1"),
                                 ((1, 2.0, 1, 4, 8), TypeError, r"batch_size is float \(2.0\): a whole"),
                                 ((1, "2", 1, 4, 8), TypeError, r"batch_size is str \('2'\): a whole"),
                                 ((1, 1, 1, True, 8), TypeError, r"head_dim is bool \(True\): a whole")):
        with pytest.raises(error, match=rf"^KVCache {message}"):
            KVCache(*args)
    with torch.no_grad():
        c = model.config
        wrong = ((c.decoder_layers - 1, c.n_heads, c.d_k), (c.decoder_layers, 1, c.d_model))
        for layers, heads, size in wrong:  # a layer too few was an IndexError, other heads a size mismatch
            hand_made = KVCache(layers, 1, heads, size, 8)
            with pytest.raises(ValueError, match=r"^KVCache has \(layers, heads, head size\) .* make it"):
                model.decode(torch.tensor([[1]]), model.encode(a), None, hand_made)
    with pytest.raises(RuntimeError, match=r"^decoding with a KVCache needs torch.no_grad\(\) or "):
        model.decode(torch.tensor([[1]]), model.encode(a), None, model.new_cache(1, 8))


def test_a_kv_cache_is_tied_to_its_source_mask():
    """A mask on the first step and None on the next was accepted: the step attended to the padding."""
    model = tiny_model()
    src = padded_batch([4, 2], 50)
    first = torch.tensor([[1], [1]])
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        cache = model.new_cache(2, 8)
        model.decode(first, memory, mask, cache)
        model.decode(first, memory, model.src_mask(src), cache)  # the same mask, made again
        other = mask.clone()
        other[1, ..., 1] = False
        for wrong in (None, other):
            with pytest.raises(ValueError, match=r"^KVCache was filled with another src_mask: pass the same"):
                model.decode(first, memory, wrong, cache)
        unpadded = padded_batch([3, 3], 50)  # None means no padding: an all-True mask is the same
        cache = model.new_cache(2, 8)
        model.decode(first, model.encode(unpadded), None, cache)
        model.decode(first, model.encode(unpadded), model.src_mask(unpadded), cache)


def test_a_gpu_kv_cache_forgets_its_rows_at_a_select_as_before():
    """Kept, the selected rows were compared with the search's newly selected tensors at the next step: a
    wait for the device at every select (a beam-1 beam_search's every step). On a GPU the cache forgets
    them, as before; "meta" stands in for the device here (no GPU on CI)."""
    cache = KVCache(1, 2, 2, 4, 8)
    cache.memory = torch.zeros(2, 5, 8, device="meta")
    cache.src_mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    cache._select_source(torch.tensor([1]))
    assert cache.memory is None and cache.src_mask is None
    cache.memory, cache.src_mask = torch.zeros(2, 5, 8), torch.ones(2, 1, 1, 5, dtype=torch.bool)
    cache._select_source(torch.tensor([1]))  # a CPU's: kept, the first position of each row
    assert cache.memory.shape == (1, 1, 8) and cache.memory_head and cache.src_mask.shape == (1, 1, 1, 5)


def test_ids_are_checked_only_where_they_can_be_read():
    """The CPU's range check read the ids with numpy, which a FakeTensor (memory estimation) cannot give:
    `model(src, tgt)` under FakeTensorMode failed where it had worked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = tiny_model()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        src = mode.from_tensor(padded_batch([4, 3], 50))
        assert model(src, src).shape == (2, 4, model.config.vocab_size)


def test_a_kv_cache_knows_its_rows_after_a_select():
    """After a select of rows (greedy search, beam 1) or `keep_sentences` (beams) the cache forgot its
    memory and mask: a step with those of the rows before the select ran (the logits off by 0.2), and one
    with another memory ignored it, silently."""
    model = tiny_model()
    src = padded_batch([4, 2, 3], 50)  # every sentence padded otherwise
    order = torch.tensor([2, 0, 1])
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        for beam in (1, 2):
            def started(beam=beam):
                cache = model.new_cache(3 * beam, 8, beam_size=beam)
                model.decode(torch.ones(3 * beam, 1, dtype=torch.long), memory, mask, cache)
                (cache.select if beam == 1 else cache.keep_sentences)(order)
                return cache
            step = torch.ones(3 * beam, 1, dtype=torch.long)
            wrong = ((memory, mask[order], "memory"), (torch.randn_like(memory), mask[order], "memory"),
                     (memory[order], mask, "src_mask"), (memory[order], None, "src_mask"))
            for other_memory, other_mask, named in wrong:
                with pytest.raises(ValueError, match=rf"^KVCache was filled \w+ another {named}: pass the "
                                                     r"same \w+ at every step, after a select its rows"):
                    model.decode(step, other_memory, other_mask, started())
            cache = started()
            model.decode(step, memory[order], mask[order], cache)  # selected alike: the same source
            model.decode(step, memory[order], mask[order], cache)
        cache = model.new_cache(3, 8)  # two selects before a step: the rows of both
        model.decode(torch.ones(3, 1, dtype=torch.long), memory, mask, cache)
        cache.select(order)
        cache.select(torch.tensor([1, 2]))
        with pytest.raises(ValueError, match=r"^KVCache was filled from another memory"):
            model.decode(torch.ones(2, 1, dtype=torch.long), memory[[1, 2]], mask[[1, 2]], cache)
        model.decode(torch.ones(2, 1, dtype=torch.long), memory[order][[1, 2]], mask[order][[1, 2]], cache)


def test_kv_cache_misuse_fails_where_it_happens():
    """A beam cache's select of rows that are not all its rows failed only at the next step ("KVCache
    holds 3 rows"); a cache made under inference_mode and stepped under no_grad with PyTorch's "Inplace
    update to inference tensor outside InferenceMode"."""
    model = tiny_model()
    src = padded_batch([4, 2], 50)
    with torch.no_grad():
        beams = model.new_cache(4, 8, beam_size=2)
        model.decode(torch.ones(4, 1, dtype=torch.long), model.encode(src), None, beams)
        with pytest.raises(ValueError, match=r"^KVCache.select with beams reorders all 4 rows, not 3: drop"):
            beams.select(torch.tensor([0, 1, 2]))
        with pytest.raises(ValueError, match=r"^KVCache.select takes a \(rows,\) index, not one of shape"):
            beams.select(torch.tensor([[0, 1, 2, 3]]))
    with torch.inference_mode():
        memory, cache = model.encode(src), model.new_cache(2, 8)
        model.decode(torch.tensor([[1], [1]]), memory, None, cache)
    with torch.no_grad():
        made_under = r"^KVCache was made under torch.inference_mode\(\), whose tensors PyTorch updates only"
        with pytest.raises(RuntimeError, match=made_under):
            model.decode(torch.tensor([[1], [1]]), memory, None, cache)
        with pytest.raises(RuntimeError, match=made_under):
            cache.select(torch.tensor([1, 1]))


def test_a_kv_cache_holds_the_models_dtype():
    """A cache in another dtype failed inside SDPA ("Expected query, key, and value to have the same
    dtype"), one made by hand as one from new_cache(dtype=...), which is gone: nothing used it."""
    model, c = tiny_model(), tiny_model().config
    with torch.no_grad():
        memory = model.encode(padded_batch([3], 50))
        for dtype in (torch.float64, torch.bfloat16):
            hand_made = KVCache(c.decoder_layers, 1, c.n_heads, c.d_k, 8, dtype)
            wrong = rf"^KVCache holds {dtype}, the model computes in torch.float32: make it with"
            with pytest.raises(TypeError, match=wrong):
                model.decode(torch.tensor([[1]]), memory, None, hand_made)
        with pytest.raises(TypeError, match="dtype"):
            model.new_cache(1, 8, dtype=torch.float64)
        assert model.double().new_cache(1, 8).k.dtype == torch.float64


def test_pad_and_eos_must_differ():
    """The search masks padding: with pad_id == eos_id no output could end (twenty tokens, no EOS)."""
    with pytest.raises(ConfigError, match=r"pad_id and eos_id are both 2: padding and the end of a sentence"):
        model_config("micro", vocab_size=10, pad_id=2, eos_id=2)


def test_the_models_dropout_is_found_as_torch_dropout():
    """`isinstance(m, nn.Dropout)`, the usual way to find a model's dropout (Monte Carlo dropout, another p
    for fine-tuning), found none of aiayn's and changed nothing, silently."""
    model = tiny_model(dropout=0.3).eval()
    found = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(found) == 2 * 2 + 3 * 2 + 2  # sublayers (2 per encoder, 3 per decoder layer), 2 embeddings
    src, tgt = padded_batch([5, 3], 50), padded_batch([4, 4], 50)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), model(src, tgt))
        for m in found:  # Monte Carlo dropout: the model in eval mode, its dropout on
            m.train()
        assert not torch.equal(model(src, tgt), model(src, tgt))


@pytest.mark.parametrize("norm_first", [False, True])
def test_sublayer_dropout_is_on_the_sublayers_output_alone(norm_first):
    """Section 5.4: dropout on each sub-layer's output, before the residual sum (and, post-norm, before the
    LayerNorm). In training: a sub-layer giving zeros leaves the residual stream as it was (pre-norm: x
    itself, post-norm: LayerNorm(x)), and with the same random numbers the output is the formula's with
    the model's dropout put there; dropout around the sum or after the LayerNorm changes both."""
    from aiayn.model.dropout import dropout
    from aiayn.model.transformer import SublayerConnection

    config = model_config("tiny", vocab_size=50, d_model=32, dropout=0.3, norm_first=norm_first)
    conn, linear = SublayerConnection(config).train(), torch.nn.Linear(32, 32)
    x = torch.randn(3, 5, 32)  # (B, T, d)
    with torch.no_grad():
        untouched = conn(x, torch.zeros_like)
        assert torch.equal(untouched, x if norm_first else conn.norm(x))
        torch.manual_seed(1)
        out = conn(x, linear)
        torch.manual_seed(1)
        want = x + dropout(linear(conn.norm(x)), 0.3, True) if norm_first else \
            conn.norm(x + dropout(linear(x), 0.3, True))
    assert torch.equal(out, want)
    assert not torch.equal(out, conn.eval()(x, linear))  # something was dropped


def test_embedding_dropout_is_on_the_sum_of_embeddings_and_positions():
    """Section 5.4: dropout on the sums of the (scaled) embeddings and the positional encodings: in
    training each element is that sum, scaled by 1 / (1 - p), or 0."""
    model = tiny_model(dropout=0.3).train()
    tokens = padded_batch([6, 6], 50)
    with torch.no_grad():
        out = model.src_embed(tokens)  # (B, T, d)
        full = (model.src_embed.embed(tokens) * math.sqrt(32) + model.src_embed.pe[:6]) / 0.7
    dropped = out == 0
    assert 0.1 < dropped.float().mean() < 0.5  # about p = 0.3 of them
    torch.testing.assert_close(out[~dropped], full[~dropped])


def test_attention_refuses_a_float_mask():
    """SDPA adds a float mask to the scores: a 0/1 mask attended to the padding it meant to hide."""
    attention = MultiHeadAttention(8, 2, True).eval()
    x, mask = torch.randn(1, 3, 8), torch.tensor([[1.0, 1.0, 0.0]])[:, None, None, :]  # (B, 1, 1, S)
    with pytest.raises(ValueError, match="mask is torch.float32: it is bool, True = attend"):
        attention(x, mask=mask)
    assert attention(x, mask=mask.bool()).shape == (1, 3, 8)


@pytest.mark.parametrize("max_len, d_model", [(4, 5), (4, 0), (-1, 4)])
def test_a_position_table_of_an_odd_width_is_refused(max_len, d_model):
    """sinusoidal_positions(4, 5) was a (4, 6) table: a sine and a cosine per frequency need an even width."""
    with pytest.raises(ValueError, match=r"d_model is an even number >= 2 .* and max_len >= 0"):
        sinusoidal_positions(max_len, d_model)


def _trained_grads(model: Transformer, src: torch.Tensor, tgt: torch.Tensor, bf16: bool = False):
    """Logits and every parameter's gradient of one training forward and backward, dropout drawn from
    seed 5; and the next number the generator gives (the state checkpointing must leave it in)."""
    model.train().zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(src, tgt)
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, torch.rand(3)


@pytest.mark.parametrize("norm_first, bf16", [(False, False), (True, False), (False, True)])
def test_checkpointed_activations_give_the_same_gradients_bit_for_bit(norm_first, bf16):
    """`checkpoint_activations` runs each layer's forward again in the backward pass: with the dropout
    masks drawn again from the generator's saved state, the logits and gradients are the uncheckpointed
    ones exactly, and the generator goes on from where the forward left it (a recompute that drew anew
    trained on other masks than the loss saw; one that left the generator moved, another run)."""
    model = tiny_model(dropout=0.3, norm_first=norm_first)
    src, tgt = padded_batch([7, 4, 6], 50), padded_batch([5, 6, 2], 50)
    plain = _trained_grads(model, src, tgt, bf16)
    model.checkpoint_activations = True
    checkpointed = _trained_grads(model, src, tgt, bf16)
    assert torch.equal(plain[0], checkpointed[0]) and torch.equal(plain[2], checkpointed[2])
    assert plain[1].keys() == checkpointed[1].keys()
    for name, grad in plain[1].items():
        assert torch.equal(grad, checkpointed[1][name]), name
    model.eval()
    assert not torch.equal(plain[0], model(src, tgt))  # dropout did drop: the masks were compared


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_recompute_leaves_no_weight_copies_for_the_next_forward(checkpointed):
    """Inside an enclosing autocast, even a disabled one (train() holds one for the whole run), autocast keeps
    its bf16 copies of the weights until that one ends; batch_loss clears them after the forward, but the
    recompute in the backward pass cast them again: the next update's forward, after the optimizer's step,
    computed with the old weights' copies, and a bf16 run with checkpointing trained another model."""
    model = tiny_model(dropout=0.0)
    model.train().checkpoint_activations = checkpointed
    src, tgt = padded_batch([7, 4], 50), padded_batch([5, 6], 50)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.autocast("cpu", enabled=False):
        with bf16:
            logits = model(src, tgt)
        torch.clear_autocast_cache()  # as batch_loss does
        logits.float().pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # an optimizer's step
        with bf16:
            after = model(src, tgt)
        torch.clear_autocast_cache()
    with bf16:
        fresh = model(src, tgt)  # no enclosing autocast: casts the weights as they are now
    assert torch.equal(after, fresh)


def test_checkpointed_activations_run_under_checkpoints_debug_mode():
    """torch.utils.checkpoint's debug mode, PyTorch's tool for a recompute that differs, refuses any
    context_fn ("debug=True is incompatible with non-default context_fn"): a step stopped there."""
    model = tiny_model(dropout=0.3)
    src, tgt = padded_batch([7, 4], 50), padded_batch([5, 6], 50)
    plain = _trained_grads(model, src, tgt)
    model.checkpoint_activations = True
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        debugged = _trained_grads(model, src, tgt)
    assert all(torch.equal(grad, debugged[1][name]) for name, grad in plain[1].items())


def _kept_for_backward(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of a training forward (the
    activations), parameters left out: what `saved_tensors_hooks` is handed outside any checkpoint."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()(src, tgt)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in kept.items() if ptr not in weights)


def test_checkpointed_activations_keep_each_layers_input_alone(monkeypatch):
    """The point of checkpointing: of a 2+2-layer model's activations, autograd keeps little more than each
    layer's input (B, T, d) and the logits; without it, every sub-layer's inner tensors too (the FFN's
    d_ff-wide hidden layer, q, k, v, dropout masks, LayerNorm inputs). Under no_grad (decoding,
    validation) nothing is checkpointed: there is no backward pass to recompute for."""
    model = tiny_model(dropout=0.1, d_ff=128)
    src, tgt = padded_batch([16] * 8, 50), padded_batch([16] * 8, 50)
    plain = _kept_for_backward(model, src, tgt)
    model.checkpoint_activations = True
    checkpointed = _kept_for_backward(model, src, tgt)
    d_model_floats = 8 * 16 * 32 * 4  # bytes of one (B, T, d) float32 activation
    logits = 8 * 16 * 50 * 4
    # the 4 layers' inputs, the memory the decoder reads, the decoder's final states, the logits, ids, masks
    assert checkpointed <= 7 * d_model_floats + logits + 4096
    assert plain > 6 * checkpointed
    calls = record_checkpointed_layers(monkeypatch)
    model(src, tgt)
    assert calls == [*model.encoder, *model.decoder]
    calls.clear()
    with torch.no_grad():
        model.eval()(src, tgt)
    assert calls == []
