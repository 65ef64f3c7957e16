"""Length penalties for beam search scores: score(Y) = log P(Y | X) / lp(|Y|).

Without a penalty, beam search prefers short outputs (every token adds a negative log-probability).
|Y| counts the output tokens including the final EOS when there is one, as tensor2tensor (the paper's
code: `(5 + (i + 1)) / 6` after step i) and fairseq (`(step + 1) ** lenpen`) do; the decoder start
token never counts. A hypothesis cut at the maximum length has no EOS and counts its tokens.
"""

from __future__ import annotations

KINDS = ("gnmt", "power", "none")


def length_penalty(length: int, alpha: float, kind: str = "gnmt") -> float:
    """lp(|Y|): `gnmt` ((5 + |Y|) / 6)^alpha (Wu et al. 2016, the paper with alpha = 0.6);
    `power` |Y|^alpha (fairseq, HuggingFace, CTranslate2); `none` 1."""
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "power":
        return float(length) ** alpha
    if kind == "none":
        return 1.0
    raise ValueError(f"length penalty kind {kind!r} is not one of {KINDS}")
