"""Decoding: greedy search, beam search and sampling over a `KVCache`, the length penalties, ensembles.

    from aiayn.decoding import DecodeConfig, generate
    model.eval()  # one in training mode is refused: its dropout would make every search differ
    hyps = generate(model, src_ids, DecodeConfig(beam=4, lenpen=0.6))  # per sentence, n-best Hypothesis
"""

from aiayn.decoding.beam import beam_search
from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.greedy import greedy_search
from aiayn.decoding.length_penalty import length_penalty
from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.search import Hypothesis, generate

__all__ = ["DecodeConfig", "Ensemble", "Hypothesis", "beam_search", "generate", "greedy_search", "length_penalty"]
