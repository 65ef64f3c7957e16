"""`aiayn demo` end to end: corpus files, the real training path, beam search, scores, curves, attention."""

import json

import pytest
from safetensors.torch import load_file

from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.demo import DemoConfig, run_demo


def check_outputs(out, n_test):
    """What a demo run leaves behind, whatever its accuracy."""
    hyps = (out / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    refs = (out / "data" / "test.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) == n_test
    checkpoints = sorted((out / "run" / "checkpoints").iterdir())
    meta = json.loads((checkpoints[-1] / "meta.json").read_text())
    assert meta["format"] == "aiayn-1" and (checkpoints[-1] / "spm.model").is_file()
    assert (out / "run" / "metrics.jsonl").is_file()
    for png in ("run/curves.png", "attention/attention_encoder.png", "attention/attention_decoder.png",
                "attention/attention_cross.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    assert (out / "attention" / "attention.html").read_text(encoding="utf-8").count("base64,") == 3
    return hyps, refs, checkpoints[-1]


def test_short_demo_through_the_cli(tmp_path, capsys):
    """The whole path in seconds: a micro model that learns little, but every stage runs."""
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--size", "tiny", "--steps", "12", "--train-pairs", "600",
            "--test-pairs", "12", "--beam", "2"]
    assert main(argv) == 0
    hyps, refs, _ = check_outputs(out, 12)
    printed = capsys.readouterr().out
    correct = sum(h == r for h, r in zip(hyps, refs))
    assert f"held-out exact match: {correct}/12" in printed and "12 updates" in printed
    assert main(["demo", "--size", "huge"]) == 2 and "huge" in capsys.readouterr().err
    assert main(argv) == 2 and "earlier demo run" in capsys.readouterr().err  # never mixes two runs


def test_config_errors():
    with pytest.raises(ConfigError, match="size"):
        DemoConfig(size="giant")
    with pytest.raises(ConfigError, match="steps"):
        DemoConfig(steps=0)


@pytest.mark.slow
def test_same_seed_same_run(tmp_path):
    config = dict(size="tiny", steps=30, n_train=800, n_test=20, n_valid=20, beam=2)
    a = run_demo(DemoConfig(out=str(tmp_path / "a"), **config))
    b = run_demo(DemoConfig(out=str(tmp_path / "b"), **config))
    wa, wb = (load_file(str(r.checkpoint / "model.safetensors")) for r in (a, b))
    assert all((wa[k] == wb[k]).all() for k in wa)
    assert (tmp_path / "a" / "test.hyp.de").read_text() == (tmp_path / "b" / "test.hyp.de").read_text()


@pytest.mark.slow
def test_default_demo_reaches_99_percent(tmp_path):
    """The README's claim: the default demo translates >= 99% of its held-out sentences exactly."""
    result = run_demo(DemoConfig(out=str(tmp_path / "demo")))
    hyps, refs, _ = check_outputs(tmp_path / "demo", result.total)
    assert result.correct == sum(h == r for h, r in zip(hyps, refs))
    assert result.accuracy >= 0.99, result.examples
