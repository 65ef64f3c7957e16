"""Decoding: greedy search, beam search and sampling over a `KVCache`, and the length penalties.

    from aiayn.decoding import DecodeConfig, generate
    hyps = generate(model, src_ids, DecodeConfig(beam=4, lenpen=0.6))  # per sentence, n-best Hypothesis
"""

from aiayn.decoding.beam import beam_search
from aiayn.decoding.greedy import greedy_search
from aiayn.decoding.length_penalty import length_penalty
from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.search import Hypothesis, generate

__all__ = ["DecodeConfig", "Hypothesis", "beam_search", "generate", "greedy_search", "length_penalty"]
