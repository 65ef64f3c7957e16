"""What a search does: `DecodeConfig`, one frozen dataclass, read and checked like every config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from aiayn.config import ConfigError, check_types
from aiayn.decoding.length_penalty import KINDS

MAX_ROWS = 2**31 - 1  # beam or n_best past it overflowed a tensor's size: a C++ traceback, not out of memory
MAX_LENPEN = 10.0  # |alpha| above this could overflow lp(|Y|): see DecodeConfig.search_problems
MIN_TEMPERATURE = 1e-3  # lower is greedy search but for near-ties: see DecodeConfig.sampling_problems
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest: past it T is inf in float32 and -inf / T NaN
# seed's bound: torch takes [-2**63, 2**64 - 1], but its CPU generator (mt19937) keeps a seed's low 32 bits,
# so seeds 1 and 2**32 + 1 drew the same samples there (CUDA's Philox kept them apart: one seed, two meanings)
MAX_CPU_SEED = 2**32 - 1


def cpu_seed_problem(named: str, seed: int) -> str | None:
    """Why `seed` (`named` so in the message: "seed=5", "--seed 5") is no seed of its own, or None."""
    if 0 <= seed <= MAX_CPU_SEED:
        return None
    return (f"{named} must be between 0 and 2**32 - 1 ({MAX_CPU_SEED:,}), the seeds PyTorch's CPU generator "
            "tells apart")
# The fields only sampling reads, at their defaults: a search must have them so (see sampling_problems)
SAMPLING_ONLY = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}


@dataclass(frozen=True)
class DecodeConfig:
    """Search settings; defaults are the paper's (section 6.1): beam 4, alpha 0.6, max length src + 50."""

    beam: int = 4  # hypotheses kept per sentence; 1 is greedy search
    lenpen: float = 0.6  # alpha of the length penalty
    lenpen_kind: str = "gnmt"  # gnmt: ((5+|Y|)/6)^alpha (paper); power: |Y|^alpha (fairseq, HF, CTranslate2)
    max_len_a: float = 1.0  # at most a * src_len + b output tokens (src_len counts the source's EOS)
    max_len_b: int = 50
    min_len: int = 0  # EOS is forbidden until this many tokens were produced (benchmarks force lengths)
    n_best: int = 1  # hypotheses returned per sentence (<= beam; with sampling: independent samples)
    early_stopping: bool = False  # beam > 1 only. False: tensor2tensor's rule (the paper's code), stop once
    # no live hypothesis can beat the `beam`-th finished one, bounding its score by log P / lp(max length)
    # (HuggingFace's early_stopping="never"; its default, False, bounds by the current length, a heuristic).
    # True: fairseq's rule (HuggingFace's True), stop once `beam` hypotheses ended: faster, but a confident
    # model's junk beams can end first (the demo measured 98.8% exact match against 100% with False)
    sample: bool = False  # sample from the model instead of searching (beam must be 1)
    temperature: float = 1.0  # divides the logits before sampling; at least MIN_TEMPERATURE
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    top_p: float = 1.0  # sample among the smallest set with probability >= p (nucleus); 1: all
    seed: int | None = None  # seeds the sampling generator once per translate call or stream; 0 to
    # MAX_CPU_SEED; None: random

    def __post_init__(self) -> None:
        check_types(self)
        problems = self.search_problems() + self.sampling_problems()
        if problems:
            raise ConfigError("DecodeConfig: " + "; ".join(problems))

    def search_problems(self) -> list[str]:
        """What is wrong with the search and length settings, each problem naming its field and value."""
        problems = []
        if self.beam < 1:
            problems.append(f"beam={self.beam} must be at least 1")
        if self.lenpen_kind not in KINDS:
            problems.append(f"lenpen_kind={self.lenpen_kind!r} is not one of {KINDS}")
        # lp(|Y|) is at most |Y|^|alpha|: with |alpha| <= 10 and |Y| below 10^6 positions it stays within
        # 1e-60..1e60, so log P / lp is a finite Python float (alpha = 1000 overflowed, -1000 divided by 0).
        # Useful values are 0 to 2 (the paper 0.6, fairseq 1.0).
        if not (math.isfinite(self.lenpen) and abs(self.lenpen) <= MAX_LENPEN):
            problems.append(f"lenpen={self.lenpen} must be a number between -{MAX_LENPEN} and {MAX_LENPEN}")
        if not (math.isfinite(self.max_len_a) and self.max_len_a >= 0):
            problems.append(f"max_len_a={self.max_len_a} must be a finite number >= 0")
        for name in ("max_len_b", "min_len"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        if self.max_len_a == 0 and self.max_len_b < 1:  # max_lengths would quietly allow 1 token anyway
            problems.append(f"max_len_a={self.max_len_a} and max_len_b={self.max_len_b} allow no output token")
        # EOS may come after min_len tokens: here every output would end cut, without EOS. min_len equal to
        # the limit forces that many tokens, no EOS (benchmarks); `Translator` refuses it for text.
        if self.max_len_a == 0 and self.min_len > self.max_len_b:
            problems.append(f"min_len={self.min_len} is more than the max_len_b={self.max_len_b} tokens that "
                            f"max_len_a={self.max_len_a} allows")
        if self.sample and self.n_best < 1:  # samples: as many as asked, whatever the beam (1)
            problems.append(f"n_best={self.n_best} must be at least 1")
        elif not self.sample and (self.n_best < 1 or self.n_best > self.beam >= 1):  # beam 0: said once above
            problems.append(f"n_best={self.n_best} must be between 1 and beam={self.beam}")
        for name in ("beam", "n_best"):
            if getattr(self, name) > MAX_ROWS:
                problems.append(f"{name}={getattr(self, name)} is more than {MAX_ROWS} rows a sentence")
        if self.early_stopping and self.beam == 1:  # beam 1 is greedy search (or sampling): nothing to stop
            problems.append(f"early_stopping=True needs beam > 1, not {self.beam}")
        return problems

    def sampling_problems(self) -> list[str]:
        """What is wrong with the sampling settings; they are refused without `sample`, never ignored."""
        problems = []
        if self.sample and self.beam != 1:
            problems.append(f"sample=True needs beam=1, not {self.beam}")
        # The float32 log-probabilities are divided by T: a T that rounds to 0 in float32 (1e-50) gives NaN
        # and torch refuses to sample. At T = 1e-3 a token 0.1 nats behind the best already has probability
        # e^-100, so lower values are greedy search in all but near-ties, and log P / T stays finite.
        if not (math.isfinite(self.temperature) and MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            problems.append(f"temperature={self.temperature} must be a number in [{MIN_TEMPERATURE}, "
                            f"{MAX_TEMPERATURE:.4g}] (float32's largest)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must not be negative")
        if not 0 < self.top_p <= 1:  # NaN fails this comparison too
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.seed is not None and (problem := cpu_seed_problem(f"seed={self.seed}", self.seed)):
            problems.append(problem)
        if not self.sample:  # a search would silently ignore them
            for name, default in SAMPLING_ONLY.items():
                if getattr(self, name) != default:
                    problems.append(f"{name}={getattr(self, name)} needs sample=True (--sample)")
        return problems

    def max_lengths(self, src_lengths: list[int], limit: int) -> list[int]:
        """Per sentence: at most a * src_len + b output tokens (rounded down; at least 1, which a > 0 with a
        short source and b <= 0 may go below), and never past `limit` positions."""
        # a as written, in decimal: in floats 0.29 * 100 is 28.999999999999996, which int() made 28 (fairseq's
        # int() does); b capped at the limit first (a * n >= 0, so the result is the same): a huge b is cheap
        a, b = Decimal(repr(float(self.max_len_a))), min(self.max_len_b, limit)
        return [max(1, int(min(limit, a * n + b))) for n in src_lengths]


def check_decode_config(config: object, who: str) -> None:
    """`who` (generate(), Translator) takes a DecodeConfig: None or a dict failed later, as "'NoneType'
    object has no attribute 'sample'" or "'dict' object has no attribute 'beam'"."""
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"{who} takes a DecodeConfig, not {type(config).__name__}: build one with "
                        "DecodeConfig(beam=4, ...), or aiayn.translate.decode_config(**options)")
