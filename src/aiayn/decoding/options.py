"""What a search does: `DecodeConfig`, one frozen dataclass, read and checked like every config."""

from __future__ import annotations

from dataclasses import dataclass

from aiayn.config import ConfigError, check_types
from aiayn.decoding.length_penalty import KINDS


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
    early_stopping: bool = False  # False: tensor2tensor's rule (the paper's code): stop a sentence once
    # no live hypothesis can beat the `beam`-th finished one, bounding its score by log P / lp(max length).
    # True: fairseq's and HuggingFace's rule, stop once `beam` hypotheses ended: faster, but a confident
    # model's junk beams can end first (the demo measured 98.8% exact match against 100% with False)
    sample: bool = False  # sample from the model instead of searching (beam must be 1)
    temperature: float = 1.0  # divides the logits before sampling
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    top_p: float = 1.0  # sample among the smallest set with probability >= p (nucleus); 1: all
    seed: int | None = None  # seeds the sampling generator; None: nondeterministic

    def __post_init__(self) -> None:
        check_types(self)
        problems = []
        if self.beam < 1:
            problems.append(f"beam={self.beam} must be at least 1")
        if self.lenpen_kind not in KINDS:
            problems.append(f"lenpen_kind={self.lenpen_kind!r} is not one of {KINDS}")
        if self.max_len_a < 0 or self.max_len_b < 0 or self.min_len < 0:
            problems.append("max_len_a, max_len_b and min_len must not be negative")
        if self.n_best < 1 or (not self.sample and self.n_best > self.beam):
            problems.append(f"n_best={self.n_best} must be between 1 and beam={self.beam}")
        if self.sample and self.beam != 1:
            problems.append(f"sample=True needs beam=1, not {self.beam}")
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            problems.append("sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1")
        if problems:
            raise ConfigError("DecodeConfig: " + "; ".join(problems))

    def max_lengths(self, src_lengths: list[int], limit: int) -> list[int]:
        """Per sentence: at most a * src_len + b output tokens, and never past `limit` positions."""
        return [max(1, min(limit, int(self.max_len_a * n + self.max_len_b))) for n in src_lengths]
