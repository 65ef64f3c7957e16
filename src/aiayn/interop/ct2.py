"""Export an aiayn checkpoint to CTranslate2 for serving, through CTranslate2's own converter API.

`AiaynConverter` is a `ctranslate2.converters.Converter`: its `_load` describes our weights as a
`TransformerSpec`, and the base class validates, optionally quantizes (`int8`, `float16`...) and writes
the model directory. Every aiayn model maps onto that spec: post-norm (the paper) or pre-norm, ReLU,
GELU or SiLU, shared or separate vocabularies, a logits bias. The position table is stored as an
explicit weight, so the paper's interleaved sinusoids and Marian's sin-then-cos ones both carry over.

The exported model reads SentencePiece pieces: CTranslate2 appends `</s>` to the source itself
(`add_source_eos`) and starts the decoder from our `decoder_start_id`'s token. Padding is never an
output of aiayn's searches (nor of OPUS-MT's, `bad_words_ids=[[pad]]`): the export bakes that in as a
-1e4 logit bias on the pad token, so CTranslate2's searches and scores equal aiayn's, pad excluded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import sentencepiece as spm
import torch
from ctranslate2.converters import Converter
from ctranslate2.specs import common_spec
from ctranslate2.specs.transformer_spec import TransformerSpec

from aiayn.checkpoint import check_utf8_path, load_checkpoint
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.files import OutputKind, check_not_inside, check_output, write_atomically
from aiayn.model import Transformer
from aiayn.train.state import check_outside_checkpoints

log = logging.getLogger(__name__)

# exp(-1e4) is 0 in float32, so pad drops out of the softmax exactly as aiayn's searches mask it; the
# value stays finite in float16 (whose largest is 65504), should the model be exported as float16.
PAD_LOGIT_BIAS = -1e4

ACTIVATIONS = {
    "relu": common_spec.Activation.RELU,
    "gelu": common_spec.Activation.GELU,  # the erf form, F.gelu's default (GELUTanh is the other one)
    "silu": common_spec.Activation.SWISH,
}


def _linear(spec, linear) -> None:
    spec.weight = linear.weight
    if linear.bias is not None:
        spec.bias = linear.bias


def _norm(spec, norm) -> None:
    spec.gamma, spec.beta = norm.weight, norm.bias


def _set_stack_common(spec, embeddings, final_norm, config) -> None:
    """Token embeddings, the sqrt(d_model) scale, the explicit position table, pre-norm's last LayerNorm."""
    spec.scale_embeddings = config.scale_embedding  # True: CTranslate2 multiplies by sqrt(d_model)
    spec.position_encodings.encodings = embeddings.pe  # (max_len, d), in the model's own layout
    embedding_spec = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embedding_spec.weight = embeddings.embed.weight
    if config.norm_first:
        _norm(spec.layer_norm, final_norm)


def _set_encoder(spec, model: Transformer) -> None:
    _set_stack_common(spec, model.src_embed, model.encoder_norm, model.config)
    for layer_spec, layer in zip(spec.layer, model.encoder):
        _linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj)  # packed [W^Q; W^K; W^V]
        _linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.sublayer[0].norm)
        _linear(layer_spec.ffn.linear_0, layer.feed_forward.w_1)
        _linear(layer_spec.ffn.linear_1, layer.feed_forward.w_2)
        _norm(layer_spec.ffn.layer_norm, layer.sublayer[1].norm)


def _set_decoder(spec, model: Transformer) -> None:
    _set_stack_common(spec, model.tgt_embed, model.decoder_norm, model.config)
    for layer_spec, layer in zip(spec.layer, model.decoder):
        _linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj)
        _linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.sublayer[0].norm)
        _linear(layer_spec.attention.linear[0], layer.src_attn.q_proj)
        _linear(layer_spec.attention.linear[1], layer.src_attn.kv_proj)  # packed [W^K; W^V]
        _linear(layer_spec.attention.linear[2], layer.src_attn.out_proj)
        _norm(layer_spec.attention.layer_norm, layer.sublayer[1].norm)
        _linear(layer_spec.ffn.linear_0, layer.feed_forward.w_1)
        _linear(layer_spec.ffn.linear_1, layer.feed_forward.w_2)
        _norm(layer_spec.ffn.layer_norm, layer.sublayer[2].norm)
    _linear(spec.projection, model.generator)
    c = model.config
    bias = torch.zeros(c.target_vocab_size) if model.final_logits_bias is None else model.final_logits_bias
    spec.projection.bias = bias.detach().clone().index_fill_(0, torch.tensor([c.pad_id]), PAD_LOGIT_BIAS)


def _tokens(sp: spm.SentencePieceProcessor, vocab: dict[str, int] | None, size: int) -> list[str]:
    """The token string of every id 0..size-1: CTranslate2 models speak tokens, not ids."""
    if vocab is None:
        tokens = [sp.id_to_piece(i) for i in range(min(size, sp.get_piece_size()))]
    else:
        by_id = {i: p for p, i in vocab.items()}
        tokens = [by_id.get(i) for i in range(size)]
    # An id with no piece (a model larger than its vocabulary) gets a name nothing tokenizes to.
    return [t if t is not None else f"<aiayn_unused_{i}>" for i, t in enumerate(tokens)] + [
        f"<aiayn_unused_{i}>" for i in range(len(tokens), size)]


def source_tokens(tokenizer: Tokenizer, size: int) -> list[str]:
    return _tokens(tokenizer.src, tokenizer.vocab, size)


def target_tokens(tokenizer: Tokenizer, size: int) -> list[str]:
    return _tokens(tokenizer.tgt, tokenizer.tgt_vocab, size)


def aiayn_spec(model: Transformer, tokenizer: Tokenizer) -> TransformerSpec:
    """Our model and tokenizer as a CTranslate2 `TransformerSpec` (weights are shared, not copied)."""
    c = model.config
    spec = TransformerSpec.from_config(
        (c.n_layers, c.decoder_layers), c.n_heads, pre_norm=c.norm_first, activation=ACTIVATIONS[c.activation]
    )
    _set_encoder(spec.encoder, model)
    _set_decoder(spec.decoder, model)
    src, tgt = source_tokens(tokenizer, c.vocab_size), target_tokens(tokenizer, c.target_vocab_size)
    spec.register_source_vocabulary(src)
    spec.register_target_vocabulary(tgt)
    if src[tokenizer.eos_id] != tgt[tokenizer.eos_id]:
        raise UserError(f"CTranslate2 names EOS once, but the source calls it {src[tokenizer.eos_id]!r} "
                        f"and the target {tgt[tokenizer.eos_id]!r}")
    spec.config.unk_token = tgt[tokenizer.unk_id]
    spec.config.bos_token = tgt[tokenizer.bos_id]
    spec.config.eos_token = tgt[tokenizer.eos_id]
    spec.config.decoder_start_token = tgt[c.decoder_start_id]
    spec.config.add_source_eos = True  # our encode_src ends every source with EOS
    spec.config.layer_norm_epsilon = c.layer_norm_eps
    return spec


class AiaynConverter(Converter):
    """CTranslate2 converter for an aiayn checkpoint directory: `AiaynConverter(ckpt).convert(out)`."""

    def __init__(self, checkpoint: str | Path, note: str = ""):
        self.checkpoint = Path(checkpoint)
        self.note = note  # logged once the checkpoint loaded, before the conversion's seconds

    def _load(self):
        ck = load_checkpoint(self.checkpoint)
        if self.note:
            log.info(self.note)
        return aiayn_spec(ck.model, ck.tokenizer)


def _is_ct2_model(directory: Path) -> bool:
    """Whether `directory` holds a CTranslate2 model (what an earlier export wrote)."""
    return (directory / "model.bin").is_file() and (directory / "config.json").is_file()


# What `export --force` may replace: the files CTranslate2's converters write (older ones wrote .txt
# vocabularies), so that a tokenizer or notes kept beside an export are refused rather than deleted.
_VOCABULARIES = {f"{side}_vocabulary.{ext}" for side in ("shared", "source", "target")
                 for ext in ("json", "txt")}
CT2_KIND = OutputKind("a CTranslate2 model", _is_ct2_model,
                      frozenset({"model.bin", "config.json"} | _VOCABULARIES))


def export_ctranslate2(checkpoint: str | Path, out: str | Path, quantization: str | None = None,
                       force: bool = False) -> Path:
    """Write the CTranslate2 model directory `out` for `checkpoint`; return its path.

    The converter writes into a temporary sibling that replaces `out` only once complete
    (`write_atomically`): a full disk leaves the old `out`, or none, never half a model. `force`
    replaces an existing `out`, but never the checkpoint itself or a directory holding it.
    """
    out = Path(out)
    # one with undecodable bytes was written, exit 0, then could not be opened
    check_utf8_path(out, "ctranslate2.Translator")
    check_outside_checkpoints(out)  # first (--force cannot mend it); Python callers too: keep_last deleted it
    check_not_inside(out, CT2_KIND)
    check_output(out, [Path(checkpoint)], force, earlier=CT2_KIND)

    # said before the work, once the checkpoint loaded (a missing one is its error alone): a `big`
    # checkpoint took 12 s with no word (8 s at int8)
    note = f"exporting {checkpoint} to {out} (CTranslate2, {quantization or 'float32'} weights)"

    def write(tmp: Path) -> None:
        try:  # force: the converter replaces `tmp`, the empty directory write_atomically made
            AiaynConverter(checkpoint, note).convert(str(tmp), quantization=quantization, force=True)
        except ValueError as e:  # ctranslate2's own checks: a bad quantization name, an incomplete spec
            raise UserError(f"{out}: CTranslate2 conversion failed ({e})") from None

    write_atomically(out, write, what="CTranslate2 model", exist_ok=force)  # one that came meanwhile too
    return out


def translate_tokens(translator, tokenizer: Tokenizer, texts: list[str], beam_size: int = 1,
                     max_len: int = 256, length_penalty: float = 1.0) -> list[list[int]]:
    """Translate `texts` with a `ctranslate2.Translator` of an exported model; target ids without EOS.

    The source pieces are the tokenizer's, so that a Marian language code (`>>fra<<`) stays one piece.
    `min_decoding_length=0`: CTranslate2's default of 1 forbids an empty translation (EOS first), which
    aiayn and HuggingFace allow; with it, a model whose best output is empty got another one here.
    `max_len` may not pass the model's position table (model.max_len): CTranslate2 raises there.
    `max_input_length=0`: CTranslate2's default of 1024 cut a longer source to its first 1024 pieces,
    silently (aiayn translates it whole, or refuses it past model.max_len; so does CTranslate2 then).
    `length_penalty` is alpha of |Y|^alpha (CTranslate2's default 1.0): its beams are aiayn's with
    `lenpen_kind="power"`, the same `lenpen` and `early_stopping=True`."""
    tgt_ids = {t: i for i, t in enumerate(target_tokens(tokenizer, tokenizer.tgt_vocab_size))}
    batch = [tokenizer.src_pieces(t)[:-1] for t in texts]  # without the EOS, which CTranslate2 appends
    results = translator.translate_batch(batch, beam_size=beam_size, max_decoding_length=max_len,
                                         min_decoding_length=0, max_input_length=0,
                                         length_penalty=length_penalty)
    return [[tgt_ids.get(t, tokenizer.unk_id) for t in r.hypotheses[0]] for r in results]
