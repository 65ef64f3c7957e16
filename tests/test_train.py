"""The training loop: it learns, resumes bit for bit, survives SIGKILL mid-checkpoint, refuses bad input."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from train_helpers import set_args, tiny_config, write_corpus

from aiayn import cli
from aiayn.checkpoint import load_checkpoint
from aiayn.train.average import average_last
from aiayn.config import ConfigError
from aiayn.train.config import TrainConfig, load_config, with_train
from aiayn.train.loop import train
from aiayn.train.state import checkpoint_dirs

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    """`train.threads=1` sets the process' thread count; give the other tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def weights(run_dir: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_dirs(run_dir)[-1] / name))


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """10 updates of 2 accumulated batches without interruption. The toy corpus makes 18 batches, 9
    updates an epoch: this run crosses an epoch boundary."""
    d = tmp_path_factory.mktemp("straight")
    config, _ = tiny_config(d, d / "run", "train.max_updates=10", "train.update_freq=2")
    result = train(config)
    return d, config, result


def test_learns_and_writes_its_files(straight_run):
    d, config, result = straight_run
    run = d / "run"
    assert result["step"] == 10 and result["stop"] == "max_updates=10"
    metrics = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any('"valid_loss"' in m for m in metrics) and any('"tokens_per_s"' in m for m in metrics)
    assert (run / "curves.png").stat().st_size > 1000
    assert [p.name for p in checkpoint_dirs(run)] == ["step_000004", "step_000008", "step_000010"]
    ck = load_checkpoint(checkpoint_dirs(run)[-1])
    assert ck.meta["config"]["train"]["max_updates"] == 10 and ck.meta["step"] == 10
    assert ck.meta["epoch"] == ck.meta["metrics"]["epoch"] == 2  # from 1, as the logs: the second had begun
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights(run))
    first_valid = [m for m in metrics if '"valid_loss"' in m][0]
    assert result["valid_loss"] < float(first_valid.split('"valid_loss": ')[1].split(",")[0])


def test_resume_is_bit_identical(straight_run, tmp_path):
    d, config, _ = straight_run
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(d / "run" / "spm.model", run / "spm.model")  # the same tokenizer, not a retrained one
    interrupted = with_train(config, run_dir=str(run), max_updates=5)  # stops mid-epoch
    train(interrupted)
    assert checkpoint_dirs(run)[-1].name == "step_000005"
    train(with_train(config, run_dir=str(run)), resume=True)
    assert checkpoint_dirs(run)[-1].name == "step_000010"
    assert_identical(weights(run), weights(d / "run"))
    a, b = weights(run, "trainer.safetensors"), weights(d / "run", "trainer.safetensors")
    assert_identical(a, b)  # Adam moments and RNG states too


def test_a_bf16_resume_is_bit_identical(straight_run, tmp_path):
    """In bf16 every update after the first ran with the first update's bf16 copies of the weights (train()
    holds an autocast context, where autocast keeps its casts): a resume, casting the saved weights anew,
    trained another model, and the checkpoints were never the weights validated."""
    d, config, _ = straight_run
    bf16 = with_train(config, precision="bf16", max_updates=6)
    for name in ("straight", "broken"):
        (tmp_path / name).mkdir()
        shutil.copy(d / "run" / "spm.model", tmp_path / name / "spm.model")
    train(with_train(bf16, run_dir=str(tmp_path / "straight")))
    train(with_train(bf16, run_dir=str(tmp_path / "broken"), max_updates=3))
    train(with_train(bf16, run_dir=str(tmp_path / "broken")), resume=True)
    assert checkpoint_dirs(tmp_path / "broken")[-1].name == "step_000006"
    assert_identical(weights(tmp_path / "broken"), weights(tmp_path / "straight"))


def test_batch_loss_computes_with_the_weights_as_they_are_now_under_any_autocast():
    """batch_loss under bf16 autocast nested in another autocast context (train() holds a disabled one):
    after an in-place change of the weights, as Adam's, it computes with the new weights, not with the
    bf16 copies autocast cached at the previous call (which it keeps until its outermost context ends)."""
    from copy import deepcopy
    from types import SimpleNamespace

    from aiayn.config import model_config
    from aiayn.data.dataset import EncodedCorpus, collate
    from aiayn.model import Transformer
    from aiayn.train import loop

    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=20, pad_id=0, decoder_start_id=1, eos_id=2))
    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 8, 9, 2]], [[8, 3], [9, 10, 11]])
    batch = collate(corpus, [0, 1], SimpleNamespace(pad_id=0, bos_id=1, eos_id=2))
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.autocast("cpu", enabled=False):
        before, _ = loop.batch_loss(model, batch, 0.1, bf16)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        after, _ = loop.batch_loss(model, batch, 0.1, bf16)
    fresh, _ = loop.batch_loss(deepcopy(model), batch, 0.1, bf16)  # no outer context: casts anew
    assert not torch.equal(before, fresh)
    assert torch.equal(after, fresh)


def test_batch_loss_of_a_compiled_checkpointed_model_computes_with_the_weights_as_they_are_now():
    """train.compile with train.checkpoint_activations in bf16 on a CPU: the attention's bf16 path breaks
    dynamo's graph, so the checkpoint runs eagerly without the model's clearing context, and its recompute
    in the backward pass left bf16 copies of the weights in autocast's cache, which the next update's
    forward used (every tensor of a 6-update run apart). aot_eager: dynamo's graph breaks without inductor's
    C++ compiler, in seconds."""
    from aiayn.train import loop

    model, (batch, _) = _micro_update()
    model.checkpoint_activations = True
    torch._dynamo.reset()
    net = torch.compile(model, backend="aot_eager")
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.autocast("cpu", enabled=False):  # as train() runs
        loss, _ = loop.batch_loss(net, batch, 0.1, bf16)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # an optimizer's step
        after, _ = loop.batch_loss(net, batch, 0.1, bf16)
    fresh, _ = loop.batch_loss(net, batch, 0.1, bf16)  # no outer context: casts anew
    assert torch.equal(after, fresh)


def test_adam_settings_changed_at_resume_are_used_and_said(straight_run, tmp_path, caplog):
    """--resume with another train.adam_beta2 or adam_eps: the checkpoint's param_groups had put the old
    ones back silently while meta.json recorded the new. The run's configuration now holds, as on a fresh
    start, and the change is said; the saved Adam moments carry on."""
    d, config, _ = straight_run
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(d / "run" / "spm.model", run / "spm.model")
    train(with_train(config, run_dir=str(run), max_updates=5))
    with caplog.at_level("INFO", logger="aiayn"):
        train(with_train(config, run_dir=str(run), adam_beta2=0.5, adam_eps=1e-6), resume=True)
    assert "Adam's betas [0.9, 0.98] -> [0.9, 0.5], eps 1e-09 -> 1e-06, as configured now" in caplog.text
    saved = json.loads((checkpoint_dirs(run)[-1] / "trainer.json").read_text())["param_groups"][0]
    assert saved["betas"] == [0.9, 0.5] and saved["eps"] == 1e-6
    changed = weights(run)
    assert any(not torch.equal(changed[k], v) for k, v in weights(d / "run").items())  # it trained otherwise


def test_resume_on_a_smaller_corpus_starts_the_next_epoch(straight_run, tmp_path, caplog):
    """The README's promise: --resume trains on another corpus, saying so. At update 5 of an epoch of 9 a
    corpus of 3 updates an epoch was called a corrupt trainer.json, and the hint (move the checkpoint
    away) failed again on the one before. Now the next epoch starts on the new corpus, said once."""
    d, config, _ = straight_run
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(d / "run" / "spm.model", run / "spm.model")
    train(with_train(config, run_dir=str(run), max_updates=5))  # update 5 of the epoch's 9
    small = tmp_path / "small"
    small.mkdir()
    src, tgt = write_corpus(small, 20)
    smaller = dataclasses.replace(config, data=dataclasses.replace(config.data, train_src=str(src),
                                                                   train_tgt=str(tgt)))
    with caplog.at_level("INFO", logger="aiayn"):
        result = train(with_train(smaller, run_dir=str(run), max_updates=8), resume=True)
    assert "at update 5 of epoch 1): epoch 2 starts" in caplog.text
    assert result["step"] == 8 and result["epoch"] == 2
    state = json.loads((checkpoint_dirs(run)[-1] / "trainer.json").read_text())["state"]
    assert state["epoch"] == 1 and state["cursor"] == 3 and state["epoch_updates"] < 9


def test_resume_on_another_corpus_of_as_many_updates_starts_the_next_epoch(straight_run, tmp_path, caplog):
    """The README's "an epoch ... starts anew on it" held for another length only: a corpus of as many
    batches (here each sentence's words reversed) went on at update 5 of the old epoch's order, its first
    five updates' worth of batches never trained on in that epoch."""
    d, config, _ = straight_run
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(d / "run" / "spm.model", run / "spm.model")
    train(with_train(config, run_dir=str(run), max_updates=5))  # update 5 of the epoch's 9
    reversed_files = []
    for side in ("train_src", "train_tgt"):
        lines = Path(getattr(config.data, side)).read_text(encoding="utf-8").splitlines()
        (tmp_path / side).write_text("".join(" ".join(line.split()[::-1]) + "\n" for line in lines), "utf-8")
        reversed_files.append(str(tmp_path / side))
    other = dataclasses.replace(config, data=dataclasses.replace(config.data, train_src=reversed_files[0],
                                                                 train_tgt=reversed_files[1]))
    with caplog.at_level("INFO", logger="aiayn"):
        train(with_train(other, run_dir=str(run), max_updates=8), resume=True)
    assert ("the training pairs are not those of when step_000005 was saved (at update 5 of epoch 1): "
            "epoch 2 starts") in caplog.messages
    state = json.loads((checkpoint_dirs(run)[-1] / "trainer.json").read_text())["state"]
    assert state["epoch"] == 1 and state["cursor"] == 3 and state["epoch_updates"] == 9


def test_without_a_validation_set_each_save_is_said(tmp_path, caplog):
    """The "saved ..." line came only with a validation loss: without a validation set nothing said
    where the checkpoints went."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=4", "data.valid_src=",
                            "data.valid_tgt=")
    with caplog.at_level("INFO", logger="aiayn"):
        train(config)
    assert f"update 4: saved {tmp_path / 'run' / 'checkpoints' / 'step_000004'}" in caplog.messages
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all("loss" in r for r in records)  # the saves, which measured nothing, wrote none


def test_average_last_k(straight_run, tmp_path):
    d, _, _ = straight_run
    out = average_last(d / "run", 2, tmp_path / "avg")
    got = load_file(str(out / "model.safetensors"))
    a, b = [load_file(str(p / "model.safetensors")) for p in checkpoint_dirs(d / "run")[-2:]]
    for k in got:
        assert torch.allclose(got[k], (a[k].double() + b[k].double()).div(2).float(), atol=0, rtol=0)
    assert load_checkpoint(out).meta["averaged"][-1].endswith("step_000010")


KILLER = """
import sys, time
import aiayn.checkpoint as ck
from aiayn.train.config import load_config
from aiayn.train.loop import train
real, calls = ck.save_file, []
def save_then_hang(tensors, path, *args, **kwargs):
    real(tensors, path, *args, **kwargs)
    calls.append(path)
    if len(calls) == 3:  # the second checkpoint: weights written, trainer state not yet
        open(sys.argv[1], "w").close()
        time.sleep(600)
ck.save_file = save_then_hang
train(load_config(None, sys.argv[2:]))
"""


@pytest.mark.slow  # a fresh Python that imports torch: 26 s on the shared 2-core machine
def test_sigkill_while_writing_keeps_the_previous_checkpoint(tmp_path):
    config, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=8")
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(marker), *sets], cwd=TESTS)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the child never reached the checkpoint"
            )
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    run = tmp_path / "run"
    assert any(
        p.name.startswith(".step_000008") for p in (run / "checkpoints").iterdir()
    )  # the half-written one
    assert [p.name for p in checkpoint_dirs(run)] == ["step_000004"]
    load_checkpoint(checkpoint_dirs(run)[-1])
    result = train(config, resume=True)
    assert result["step"] == 8
    # no debris: the half-written directory is cleared by the next save
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004", "step_000008"]


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_bad_inputs_give_one_line(tmp_path, capsys):
    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2")
    args = set_args(sets)
    (tmp_path / "short.en").write_text("a dog\n", encoding="utf-8")
    (tmp_path / "bad.de").write_bytes(b"ein Hund\nzwei \xc3\x28 Katzen\n")
    (tmp_path / "two.en").write_text("a dog\ntwo cats\n", encoding="utf-8")
    (tmp_path / "bad.toml").write_text("[train]\nmax_tokenz = 100\n", encoding="utf-8")
    cases = [
        (["--set", f"data.train_src={tmp_path / 'nope.de'}"], "nope.de: file not found"),
        (["--set", f"data.train_tgt={tmp_path / 'short.en'}"], "train.de:2: line counts differ"),
        (
            [
                "--set",
                f"data.train_src={tmp_path / 'bad.de'}",
                "--set",
                f"data.train_tgt={tmp_path / 'two.en'}",
            ],
            "bad.de:2: invalid UTF-8",
        ),
        (
            ["--config", str(tmp_path / "bad.toml")],
            f"{tmp_path / 'bad.toml'}:2: unknown [train] key max_tokenz (known: ",
        ),
        (["--set", "train.max_tokenz=5"], "max_tokenz"),
        (["--set", "model.d_modle=5"], "d_modle"),
        (["--set", "model.vocab_size=5"], "comes from the tokenizer"),
    ]
    for extra, message in cases:
        code, line = run_cli(capsys, "train", *args, *extra)
        assert code == 2 and line.startswith("aiayn: error: ") and message in line, (extra, line)
        shutil.rmtree(tmp_path / "run", ignore_errors=True)

    assert run_cli(capsys, "train", *args)[0] == 0
    code, line = run_cli(capsys, "train", *args)
    assert code == 2 and "already holds checkpoints; pass --resume" in line
    code, line = run_cli(capsys, "train", *args, "--resume", "--set", "model.d_model=64")
    assert code == 2 and "trained with model.d_model=32 (resumed with 64); --resume continues" in line
    # what the saved None means, written out: the same model (refused as n_decoder_layers=None against 1)
    assert run_cli(capsys, "train", *args, "--resume", "--set", "model.n_decoder_layers=1")[0] == 0
    code, line = run_cli(capsys, "train", *args, "--resume", "--set", "model.dropout=0.0")
    assert code == 2 and "trained with model.dropout=0.1 (resumed with 0.0); --resume continues" in line
    assert line.endswith("fine-tune from the checkpoint (train.init_from) in another train.run_dir")
    for setting, message in (("train.seed=7", "trained with train.seed=1 (resumed with 7); --resume"),
                             ("data.max_len=20", "trained with data.max_len=32 (resumed with 20); --resume")):
        # another batch order or other pairs: the saved position in the epoch would train some batches
        # twice and skip others, silently
        code, line = run_cli(capsys, "train", *args, "--resume", "--set", setting, "--set", "train.max_updates=4")
        assert code == 2 and message in line, (setting, line)
    latest = checkpoint_dirs(tmp_path / "run")[-1]
    (latest / "trainer.safetensors").write_bytes(b"\x00broken")
    code, line = run_cli(capsys, "train", *args, "--resume", "--set", "train.max_updates=4")
    assert code == 2 and "trainer.safetensors: training state damaged or cut short" in line
    (latest / "model.safetensors").write_bytes(b"\x00broken")  # 7 bytes: too short for its header's length
    code, line = run_cli(capsys, "train", *args, "--resume", "--set", "train.max_updates=4")
    assert code == 2 and "model.safetensors: damaged or cut short" in line


def test_plot_command(straight_run, tmp_path, capsys):
    d, _, _ = straight_run
    assert cli.main(["plot", str(d / "run"), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_shipped_configs_load():
    for path in sorted((TESTS.parent / "configs").glob("*.toml")):
        config = load_config(path)
        tc = config.train
        if path.stem in ("base", "big"):
            assert tc.max_tokens * tc.update_freq == 25000 and tc.warmup == 4000 and tc.label_smoothing == 0.1
            assert tc.max_updates == {"base": 100_000, "big": 300_000}[path.stem]
            assert tc.keep_last == {"base": 5, "big": 20}[path.stem]
            # every 10 minutes at the paper's step times (0.4 and 1.0 s): the window averaged is the paper's
            assert tc.valid_every == {"base": 1500, "big": 600}[path.stem]


def test_validation_bleu_is_sacrebleu_of_greedy_translations(straight_run, tmp_path):
    from sacrebleu.metrics import BLEU

    from aiayn.data.dataset import read_parallel
    from aiayn.decoding import DecodeConfig, generate
    from aiayn.train.bleu import validation_bleu

    d, config, _ = straight_run
    ck = load_checkpoint(checkpoint_dirs(d / "run")[-1])
    text = read_parallel(config.data.valid_src, config.data.valid_tgt)
    score, signature = validation_bleu(ck.model, ck.tokenizer, text, 64, torch.device("cpu"))
    one_by_one = []
    for sentence in text.src:  # unbatched: no padding can leak into the batched result
        src = torch.tensor([ck.tokenizer.encode_src(sentence)])
        one_by_one.append(ck.tokenizer.decode_tgt(generate(ck.model, src, DecodeConfig(beam=1))[0][0].tokens))
    assert score == pytest.approx(BLEU().corpus_score(one_by_one, [text.tgt]).score)
    assert signature.startswith("nrefs:1|")
    # train.bleu_lang picks the tokenizer as `aiayn evaluate -l` does: Thai is scored on characters
    # (13a scored unspaced targets near 0 whatever the model did)
    score, signature = validation_bleu(ck.model, ck.tokenizer, text, 64, torch.device("cpu"), lang="th")
    assert "tok:char" in signature
    assert score == pytest.approx(BLEU(tokenize="char").corpus_score(one_by_one, [text.tgt]).score)


def test_validation_bleu_decodes_greedily(tmp_path, one_thread):
    """Validation BLEU is greedy decoding's (train/bleu.py): scored against the greedy translations
    themselves it is 100, for a (random) model whose beam-2 translations are other ones. The trained
    model above translates alike both ways, so its test could not tell the search."""
    from conftest import numbers_checkpoint

    from aiayn.data.dataset import ParallelText
    from aiayn.decoding import DecodeConfig, generate
    from aiayn.train.bleu import validation_bleu

    ck = load_checkpoint(numbers_checkpoint(tmp_path))
    sources = [f"the number {i} is even" for i in range(0, 8, 2)]

    def translations(config):
        src = [torch.tensor([ck.tokenizer.encode_src(s)]) for s in sources]  # (1, S) each
        return [ck.tokenizer.decode_tgt(generate(ck.model, ids, config)[0][0].tokens) for ids in src]

    greedy = translations(DecodeConfig(beam=1))
    assert translations(DecodeConfig(beam=2)) != greedy
    text = ParallelText(sources, greedy, dropped_empty=0)
    score, _ = validation_bleu(ck.model, ck.tokenizer, text, 64, torch.device("cpu"))
    assert score == pytest.approx(100.0)


def test_validation_shows_its_progress_on_a_terminal(tmp_path, monkeypatch):
    """The validation loss over a large set took minutes on a CPU with the training bar standing still
    and nothing said, as if hung: a bar of its own counts the batches and is cleared after."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=2", "train.valid_every=2")
    train(config)
    shown = sys.stderr.getvalue()
    assert "\rvalidation: " in shown and "batch" in shown.split("\rvalidation: ", 1)[1], shown[-400:]


def test_validation_bleu_shows_its_progress_on_a_terminal_only(straight_run, monkeypatch):
    """A BLEU pass over a real validation set takes minutes, and the bar above it stood still meanwhile:
    on a terminal a bar of its own counts the sentences, and is gone once the pass ends; a log file gets
    none of its frames."""
    import io

    from aiayn.data.dataset import read_parallel
    from aiayn.train.bleu import validation_bleu

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    d, config, _ = straight_run
    ck = load_checkpoint(checkpoint_dirs(d / "run")[-1])
    text = read_parallel(config.data.valid_src, config.data.valid_tgt)
    for stream in (Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        validation_bleu(ck.model, ck.tokenizer, text, 64, torch.device("cpu"))
        shown = stream.getvalue()
        if isinstance(stream, Terminal):
            # the bar and its count of the sentences; how far it was drawn depends on tqdm's timing (it
            # redraws at most every 0.1 s, and a fast pass ends before its last redraw)
            assert shown.startswith("\rvalidation BLEU: ") and f"/{len(text.src)} [" in shown, shown
            assert shown.endswith("\r"), shown  # cleared (leave=False): the training bar's line is free again
        else:
            assert shown == ""


@pytest.mark.parametrize("normalization", ["nmt_nfkc", "nmt_nfkc_cf"])
def test_validation_bleu_of_a_tokenizer_that_folds_case_is_lowercased(tmp_path, monkeypatch, normalization):
    """A tokenizer that folds case makes a model that writes lowercase alone: scored against the cased
    references, a perfect model's validation BLEU on Multi30k German was 25.8, with nothing saying why; and
    lowercased by str.lower, which keeps a final ς that the tokenizer folds to σ, a perfect Greek one 67.4."""
    from types import SimpleNamespace

    from aiayn.config import model_config
    from aiayn.data.dataset import ParallelText, train_tokenizer
    from aiayn.model import Transformer
    from aiayn.train import bleu as bleu_module

    lines = [f"Ein Hund läuft über die Wiese Nummer {i} im Park von Berlin" for i in range(50)]
    lines += [f"ὁ λόγος ΣΟΦΌΣ Nummer {i}" for i in range(10)]  # a final ς, which str.lower keeps
    tok = train_tokenizer(ParallelText(lines, lines, 0), tmp_path, 120, normalization=normalization)
    model = Transformer(model_config("micro", vocab_size=tok.tgt_vocab_size, pad_id=tok.pad_id,
                                     decoder_start_id=tok.bos_id, eos_id=tok.eos_id))

    def perfect(model, src, config):  # the source's own pieces: the reference as the tokenizer keeps it
        return [[SimpleNamespace(tokens=[t for t in row.tolist() if t not in (tok.pad_id, tok.eos_id)])]
                for row in src]

    monkeypatch.setattr(bleu_module, "generate", perfect)
    score, signature = bleu_module.validation_bleu(model, tok, ParallelText(lines, lines, 0), 256,
                                                   torch.device("cpu"))
    assert score == pytest.approx(100.0)
    assert ("|case:lc|" in signature) == (normalization == "nmt_nfkc_cf")


def test_validation_bleu_scores_the_pairs_the_loss_drops_whole(straight_run, monkeypatch, caplog):
    """A validation source longer than data.max_len (dropped from the loss) was cut to data.max_len for
    BLEU and scored against its whole reference, holding the curve below `aiayn evaluate`'s score; only a
    source beyond the batch (train.max_tokens) or the model's positions is cut, and said."""
    from aiayn.data.dataset import ParallelText, read_parallel
    from aiayn.train import bleu as bleu_module

    d, config, _ = straight_run
    ck = load_checkpoint(checkpoint_dirs(d / "run")[-1])
    text = read_parallel(config.data.valid_src, config.data.valid_tgt)
    long = " ".join(text.src)
    n = len(ck.tokenizer.encode_src(long))
    assert config.data.max_len < n
    seen: list[int] = []

    def spy(model, src, options):
        seen.append(src.shape[1])  # (B, S)
        return generate(model, src, options)

    generate = bleu_module.generate
    monkeypatch.setattr(bleu_module, "generate", spy)
    pairs = ParallelText([long, *text.src], [" ".join(text.tgt), *text.tgt], 0)
    bleu_module.validation_bleu(ck.model, ck.tokenizer, pairs, n, torch.device("cpu"))
    assert max(seen) == n and "cut to fit" not in caplog.text
    seen.clear()
    bleu_module.validation_bleu(ck.model, ck.tokenizer, pairs, n - 1, torch.device("cpu"))
    assert max(seen) == n - 1
    cut = f"validation BLEU: 1 source(s) longer than {n - 1} pieces (train.max_tokens) cut to fit"
    assert cut in caplog.text


def test_validation_bleu_says_nothing_of_hypotheses_that_end_in_a_tokenized_period(straight_run, monkeypatch,
                                                                                    caplog):
    """100 hypotheses ending in " ." put sacreBLEU's three unprefixed lines into the training log twice a
    pass, advising a `force` parameter aiayn has no setting for. They are the model's own detokenized
    output (an early model's " ." is no forgotten detokenizer): nothing is said."""
    from aiayn.data.dataset import ParallelText, read_parallel
    from aiayn.train.bleu import validation_bleu

    d, config, _ = straight_run
    ck = load_checkpoint(checkpoint_dirs(d / "run")[-1])
    text = read_parallel(config.data.valid_src, config.data.valid_tgt)
    many = -(-100 // len(text.src))
    text = ParallelText(text.src * many, text.tgt * many, 0)
    monkeypatch.setattr(ck.tokenizer, "decode_tgt", lambda ids: "die Zahl 3 .")
    score, _ = validation_bleu(ck.model, ck.tokenizer, text, 64, torch.device("cpu"))
    assert len(text.src) >= 100 and score >= 0 and not caplog.records


def test_validation_bleus_unspaced_hint_looks_at_the_references(straight_run, monkeypatch, caplog):
    """The hint to set train.bleu_lang (13a finds about one word per line) read the hypotheses: an early
    model repeating one piece had it said for German; the references show the target language."""
    from aiayn.data.dataset import ParallelText, read_parallel
    from aiayn.train.bleu import validation_bleu

    d, config, _ = straight_run
    ck = load_checkpoint(checkpoint_dirs(d / "run")[-1])
    text = read_parallel(config.data.valid_src, config.data.valid_tgt)
    monkeypatch.setattr(ck.tokenizer, "decode_tgt", lambda ids: "ichichichichichichichich")  # unspaced
    validation_bleu(ck.model, ck.tokenizer, text, 64, torch.device("cpu"))
    assert "train.bleu_lang" not in caplog.text
    unspaced = ParallelText(text.src, ["我们今天在这里学习翻译模型" for _ in text.tgt], 0)
    validation_bleu(ck.model, ck.tokenizer, unspaced, 64, torch.device("cpu"))
    assert "for Chinese, Japanese, Thai, Lao, Khmer or Burmese set train.bleu_lang" in caplog.text


def test_a_bleu_tokenizer_missing_its_packages_fails_before_the_tokenizer_is_trained(tmp_path, capsys):
    """ja and ko need MeCab, which sacreBLEU does not install: refused before SentencePiece training and
    the encoding (minutes on a large corpus), not after them."""
    pytest.importorskip("sacrebleu")
    try:
        from sacrebleu.metrics import BLEU

        BLEU(tokenize="ja-mecab")
        pytest.skip("MeCab is installed here")
    except (RuntimeError, ImportError):
        pass
    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.bleu_every=2", "train.bleu_lang=ja")
    assert cli.main(["train", *set_args(sets)]) == 2
    assert "sacreBLEU's ja-mecab tokenizer needs packages missing here" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing trained, not even the run directory made


def test_bleu_lang_is_checked_with_the_config():
    with pytest.raises(ConfigError, match="train.bleu_lang 'en-zh': train.bleu_lang takes the target language"):
        TrainConfig(bleu_every=10, bleu_lang="en-zh")
    with pytest.raises(ConfigError, match="train.bleu_lang='zh' needs train.bleu_every"):
        TrainConfig(bleu_lang="zh")
    assert TrainConfig(bleu_every=10, bleu_lang="zh-CN").bleu_lang == "zh-CN"


def test_training_without_bleu_leaves_sacrebleu_unimported(tmp_path):
    """The config check imported sacreBLEU for a train.bleu_lang that was not set: 2.6 s of every cold
    `train` start, BLEU validation or not."""
    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=1", "train.valid_every=1")
    code = ("import sys; from aiayn.train.config import load_config; from aiayn.train.loop import train; "
            "train(load_config(None, sys.argv[1:])); "
            "assert 'sacrebleu' not in sys.modules, 'sacrebleu imported'")
    subprocess.run([sys.executable, "-c", code, *sets], check=True, cwd=TESTS)


def test_bleu_every_logs_bleu(tmp_path):
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=4", "train.bleu_every=4")
    result = train(config)
    assert (
        0.0 <= result["valid_bleu"] <= 100.0
        and "valid_bleu" in (tmp_path / "run" / "metrics.jsonl").read_text()
    )
    # a resume with nothing left to train answers as the run did (its signature was left out)
    again = train(config, resume=True)
    assert again == result and again["bleu_signature"].startswith("nrefs:1|")


def test_cooldown_takes_the_lr_linearly_to_zero_at_the_end_of_the_budget(tmp_path):
    config, _ = tiny_config(
        tmp_path, tmp_path / "run", "train.max_updates=20", "train.cooldown=0.5", "train.log_every=1"
    )
    train(config)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["step"]: m["lr"] for m in lines if "lr" in m}
    d_model = load_checkpoint(checkpoint_dirs(tmp_path / "run")[-1]).model.config.d_model
    for step in range(1, 21):  # the lr of update `step` is set from the budget used before it
        eq3 = d_model**-0.5 * min(step**-0.5, step * 4**-1.5)
        assert lrs[step] == pytest.approx(eq3 * min(1.0, (1 - (step - 1) / 20) / 0.5), rel=1e-9), step
    assert lrs[10] == pytest.approx(d_model**-0.5 * 10**-0.5, rel=1e-9)  # untouched before the last half
    assert lrs[20] == pytest.approx(0.1 * d_model**-0.5 * 20**-0.5, rel=1e-9)  # 1/20 of the budget left


def test_cooldown_needs_a_budget():
    with pytest.raises(ConfigError, match="train.cooldown needs a budget"):
        TrainConfig(cooldown=0.2)
    with pytest.raises(ConfigError, match=r"train.cooldown=1.0 is not in \[0, 1\)"):
        TrainConfig(cooldown=1.0, max_updates=10)


def test_stopping_rules_and_bf16(tmp_path):
    # lr_scale 0: the weights never change, so no validation improves on the first: patience ends it.
    config, _ = tiny_config(
        tmp_path,
        tmp_path / "a",
        "train.lr_scale=0.0",
        "train.valid_every=1",
        "train.patience=2",
        "train.max_updates=50",
    )
    result = train(config)
    assert result["step"] == 3 and result["stop"] == "no better validation loss for 2 validations"
    saved = [p.name for p in checkpoint_dirs(tmp_path / "a")]
    again = train(config, resume=True)  # a run patience ended trains no more, as one at its budget
    assert again["stop"] == result["stop"] and again["step"] == 3
    assert [p.name for p in checkpoint_dirs(tmp_path / "a")] == saved
    assert train(with_train(config, patience=3), resume=True)["step"] == 4  # more patience: one more
    # The toy corpus makes 18 batches of max_tokens=64: one epoch is 9 updates with update_freq 2.
    result = train(
        with_train(
            config,
            run_dir=str(tmp_path / "b"),
            patience=0,
            max_epochs=1,
            update_freq=2,
            valid_every=100,
            lr_scale=1.0,
            precision="bf16",
        )
    )
    assert result["step"] == 9 and result["stop"] == "max_epochs=1" and result["valid_loss"] < 10


def test_train_step_sums_the_losses_on_the_device_without_reading_them(monkeypatch):
    """train_step read each batch's loss with .item(): on a GPU the host waited for every batch's backward
    and could not collate the next one meanwhile. Its sums now stay a device tensor, read once per log
    line, and equal, bit for bit, the Python sums of the .item() values they replace."""
    from copy import deepcopy
    from types import SimpleNamespace

    from aiayn.config import model_config
    from aiayn.data.dataset import EncodedCorpus, collate
    from aiayn.model import Transformer
    from aiayn.train import loop
    from aiayn.train.distributed import Dist

    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=20, pad_id=0, decoder_start_id=1, eos_id=2))
    tok = SimpleNamespace(pad_id=0, bos_id=1, eos_id=2)
    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 2], [8, 9, 10, 2]], [[8], [9, 10, 11], [12, 13]])
    batches = [collate(corpus, indices, tok) for indices in ([0, 1], [2], [1, 2])]
    off = torch.autocast("cpu", enabled=False)
    want = [0.0, 0.0]
    for b in batches:  # micro has no dropout: the same forward as train_step's, before its update
        loss, nll = loop.batch_loss(deepcopy(model), b, 0.1, off)
        want = [want[0] + loss.item(), want[1] + nll.item()]
    reads = []
    for name in ("item", "tolist"):  # a caller in loop.py reading a tensor's value makes the host wait
        real = getattr(torch.Tensor, name)

        def recorded(self, *args, real=real, name=name, **kwargs):
            reads.append((name, sys._getframe(1).f_globals.get("__name__")))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recorded)
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    d = Dist(0, 1, 0, torch.device("cpu"))
    result = loop.train_step(model, optimizer, scaler, batches, 16, 1e-3, 0.1, 1.0, d, off)
    assert [r for r in reads if r[1] == "aiayn.train.loop"] == []  # was 6: loss and NLL of each batch
    monkeypatch.undo()
    sums, tokens, applied = result
    assert applied
    assert isinstance(sums, torch.Tensor) and sums.dtype == torch.float64 and sums.shape == (2,)
    assert sums.tolist() == want and tokens == 16.0 == sum(b.n_tokens for b in batches)


def _micro_update():
    """A `micro` model (no dropout) and an update of two batches of 6 and 3 real target tokens."""
    from types import SimpleNamespace

    from aiayn.config import model_config
    from aiayn.data.dataset import EncodedCorpus, collate
    from aiayn.model import Transformer

    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=20, pad_id=0, decoder_start_id=1, eos_id=2))
    tok = SimpleNamespace(pad_id=0, bos_id=1, eos_id=2)
    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 2], [8, 9, 10, 2]], [[8], [9, 10, 11], [12, 13]])
    batches = [collate(corpus, indices, tok) for indices in ([0, 1], [2])]
    assert [b.n_tokens for b in batches] == [6, 3]
    return model, batches


def _summed_loss_gradient(model, batches, eps):
    """A copy of `model` holding the gradient of the update's loss as train_step's docstring defines it,
    computed apart: PyTorch's label-smoothed cross entropy summed over every real target of all batches
    (padding ignored, every position projected), divided by their number."""
    from copy import deepcopy

    import torch.nn.functional as F

    ref = deepcopy(model)
    loss = sum(F.cross_entropy(ref(b.src, b.tgt_in).flatten(0, 1), b.tgt_out.flatten(), ignore_index=0,
                               label_smoothing=eps, reduction="sum") for b in batches)
    (loss / sum(b.n_tokens for b in batches)).backward()
    return ref


def _step(model, batches, clip_norm, lr):
    """train_step of one process over `batches` with plain SGD: its update is -lr x the gradient it made."""
    from aiayn.train import loop
    from aiayn.train.distributed import Dist

    optimizer = torch.optim.SGD(model.parameters())
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    tokens = sum(b.n_tokens for b in batches)
    off = torch.autocast("cpu", enabled=False)
    d = Dist(0, 1, 0, torch.device("cpu"))
    loop.train_step(model, optimizer, scaler, batches, tokens, lr, 0.1, clip_norm, d, off)


def test_train_step_gradient_is_that_of_the_updates_summed_loss_over_its_tokens():
    """update_freq 2: the accumulated gradient is that of both batches' summed smoothed losses over the
    update's 9 tokens; not each batch's mean (the 3-token batch weighing as much as the 6-token one), nor
    the unnormalized sum (which Adam nearly hides, clipping and the learning rate do not)."""
    model, batches = _micro_update()
    want = _summed_loss_gradient(model, batches, 0.1)
    _step(model, batches, clip_norm=0.0, lr=1e-3)
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_train_step_clips_the_gradient_as_torch_does():
    """clip_norm: the update is SGD's with the gradient clipped by torch.nn.utils.clip_grad_norm_, whose
    total norm is then clip_norm (here a quarter of the gradient's own)."""
    model, batches = _micro_update()
    ref = _summed_loss_gradient(model, batches, 0.1)
    clip = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))) / 4  # the norm, unclipped
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, batches, clip_norm=clip, lr=1.0)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert float(norm) == pytest.approx(clip, rel=1e-4)
    for (name, p), b, q in zip(model.named_parameters(), before, ref.parameters()):
        torch.testing.assert_close(b - p.detach(), q.grad, rtol=1e-4, atol=1e-6,  # p - 1.0 x grad, rounded
                                   msg=lambda m, name=name: f"{name}: {m}")


class _ValueReads(TorchDispatchMode):
    """Counts the operators that read a tensor's values back to the host, which on a GPU wait for the
    device: `.item()`/`bool()` (`_local_scalar_dense`), `nonzero`, `masked_select`, and indexing by a
    bool mask (whose result size is the mask's count)."""

    SYNCS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default")

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        masks = [i for i in args[1] if i is not None and i.dtype == torch.bool] if name == "aten.index.Tensor" else []
        if name in self.SYNCS or masks:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_step_reads_no_value_back_from_the_device(precision):
    """Forward, loss, backward, clipping and Adam of collated batches: no operator whose result depends
    on a tensor's values being on the host. Selecting the real targets by a bool mask (twice a batch)
    and checking the mask (`bool(keep.all())`) made a GPU's host wait three times per batch; `collate`
    now finds the positions on the host."""
    from types import SimpleNamespace

    from aiayn.config import model_config
    from aiayn.data.dataset import EncodedCorpus, collate
    from aiayn.model import Transformer
    from aiayn.train import loop
    from aiayn.train.distributed import Dist

    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=20, pad_id=0, decoder_start_id=1, eos_id=2, dropout=0.1))
    tok = SimpleNamespace(pad_id=0, bos_id=1, eos_id=2)
    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 2], [8, 9, 10, 2]], [[8], [9, 10, 11], [12, 13]])
    batches = [collate(corpus, indices, tok) for indices in ([0, 1], [2], [1, 2])]
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with _ValueReads() as mode:
        loop.train_step(model, optimizer, scaler, batches, 16, 1e-3, 0.1, 1.0, Dist(0, 1, 0, torch.device("cpu")),
                        autocast)
    assert mode.reads == []  # was 6 bool-mask selections and 3 reads
    with _ValueReads() as mode:  # the mode does see them
        bool((batches[0].tgt_out != 0).all()), batches[0].tgt_out[batches[0].tgt_out != 0]
    assert mode.reads == ["aten._local_scalar_dense.default", "aten.index.Tensor"]


def test_an_update_whose_scaled_gradients_overflow_is_skipped_and_said(monkeypatch):
    """fp16's GradScaler skips Adam when a gradient is inf or NaN and halves its scale: train_step says
    so (on a CPU scaler here; the logic is the device's own GradScaler's)."""
    from types import SimpleNamespace

    from aiayn.config import model_config
    from aiayn.data.dataset import EncodedCorpus, collate
    from aiayn.model import Transformer
    from aiayn.train import loop
    from aiayn.train.distributed import Dist

    torch.manual_seed(0)
    model = Transformer(model_config("micro", vocab_size=20, pad_id=0, decoder_start_id=1, eos_id=2))
    tok = SimpleNamespace(pad_id=0, bos_id=1, eos_id=2)
    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 2]], [[8], [9, 10, 11]])
    batches = [collate(corpus, [0, 1], tok)]
    optimizer = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    d, off = Dist(0, 1, 0, torch.device("cpu")), torch.autocast("cpu", enabled=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real_loss = loop.batch_loss
    monkeypatch.setattr(loop, "batch_loss", lambda *a: tuple(x * float("inf") for x in real_loss(*a)))
    *_, applied = loop.train_step(model, optimizer, scaler, batches, 4, 1e-3, 0.1, 0.0, d, off)
    assert not applied and scaler.get_scale() == 512.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # Adam did not step
    monkeypatch.setattr(loop, "batch_loss", real_loss)
    *_, applied = loop.train_step(model, optimizer, scaler, batches, 4, 1e-3, 0.1, 0.0, d, off)
    assert applied and not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _train_with_skips(config, skipped_calls: set[int], monkeypatch) -> tuple[dict, int]:
    """train(config) with the train_step calls numbered in `skipped_calls` (from 1) reported as skipped
    updates with an infinite loss, as an fp16 overflow may come; (its result, how many calls)."""
    from aiayn.train import loop

    real_step, calls = loop.train_step, []

    def sometimes_skipped(*args):
        calls.append(1)
        sums, tokens, _ = real_step(*args)
        skipped = len(calls) in skipped_calls
        return sums * float("inf") if skipped else sums, tokens, not skipped

    with monkeypatch.context() as m:
        m.setattr(loop, "train_step", sometimes_skipped)
        return train(config), len(calls)


def validated_steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "valid_loss" in r]


def test_skipped_updates_are_not_counted(tmp_path, monkeypatch, caplog):
    """Three updates skipped (as fp16 overflow skips them), one right after a validation: the run still
    makes max_updates real updates, its log, validations and checkpoints number only those, and it says
    which were skipped."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=6", "train.log_every=1",
                            "train.valid_every=3")
    with caplog.at_level("WARNING", logger="aiayn"):
        result, calls = _train_with_skips(config, {2, 3, 6}, monkeypatch)  # after updates 1, 1 and 3
    assert result["step"] == 6 and calls == 9
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_000003", "step_000006"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert validated_steps(tmp_path / "run") == [3, 6]
    assert [m.split(":")[0] for m in caplog.messages if m.startswith("update ") and "skipped" in m] == [
        "update 2 skipped", "update 2 skipped", "update 4 skipped"]


def test_a_skipped_last_update_of_the_last_epoch_saves_nothing_twice(tmp_path, monkeypatch):
    """The epoch's last batches skipped right after a validation: the run stops at max_epochs without
    validating and saving that same step again (which counted against patience and logged it twice)."""
    (tmp_path / "a").mkdir()
    config, _ = tiny_config(tmp_path / "a", tmp_path / "a" / "run", "train.max_epochs=1",
                            "train.valid_every=1000")
    _, n = _train_with_skips(config, set(), monkeypatch)  # updates in one epoch
    (tmp_path / "b").mkdir()
    config, _ = tiny_config(tmp_path / "b", tmp_path / "b" / "run", "train.max_epochs=1",
                            f"train.valid_every={n - 1}", "train.patience=1")
    result, calls = _train_with_skips(config, {n}, monkeypatch)
    assert calls == n and result["step"] == n - 1 and result["stop"] == "max_epochs=1"
    assert validated_steps(tmp_path / "b" / "run") == [n - 1]


def test_an_epoch_budget_is_measured_in_batches_used_not_updates_counted():
    """With skipped fp16 updates the step falls behind the epoch position: the cooldown and the time
    left follow the position, which is what max_epochs stops on."""
    from types import SimpleNamespace

    from aiayn.train.loop import _budget_used
    from aiayn.train.state import TrainState

    tc = SimpleNamespace(max_minutes=0, max_updates=0, max_epochs=2)
    assert _budget_used(TrainState(step=12, epoch=1, cursor=5), tc, n_updates=10) == 0.75  # was 0.6


def test_an_epoch_budget_lowered_below_the_epoch_under_way_trains_no_more():
    """--resume with max_epochs=2 from an update in epoch 4 trained to the end of epoch 4: the budget was
    looked at only at an epoch's end."""
    from types import SimpleNamespace

    from aiayn.train.loop import _stop_reason
    from aiayn.train.state import TrainState

    tc = SimpleNamespace(max_minutes=0, max_updates=0, max_epochs=2)
    assert _stop_reason(TrainState(step=130, epoch=3, cursor=10), tc, n_updates=40) == "max_epochs=2"
    assert _stop_reason(TrainState(step=80, epoch=1, cursor=40), tc, n_updates=40) == "max_epochs=2"
    assert _stop_reason(TrainState(step=79, epoch=1, cursor=39), tc, n_updates=40) == ""  # the last epoch's
    assert _stop_reason(TrainState(step=40, epoch=1, cursor=0), tc, n_updates=40) == ""


def test_a_patience_stop_keeps_the_best_checkpoint(tmp_path):
    """keep_last=1 and patience=2: the run stops two validations after its best one, whose checkpoint
    pruning deleted, leaving only worse weights."""
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.keep_last=1", "train.patience=2",
                            "train.valid_every=1", "train.lr_scale=50", "train.max_updates=40")
    result = train(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["valid_loss"] for r in records if "valid_loss" in r}
    best = min(losses, key=losses.get)
    assert result["stop"].startswith("no better validation loss") and result["step"] > best
    kept = [p.name for p in checkpoint_dirs(tmp_path / "run")]
    assert kept == [f"step_{best:06d}", f"step_{result['step']:06d}"]


def test_a_value_out_of_range_names_where_it_was_written(tmp_path):
    """Type errors and unknown keys named their file; a range error or a contradiction did not. Each is
    named by the file's line or the --set item that wrote it: "FILE with --set" blamed an unrelated --set
    for the file's max_len = 1, and named vocab_size with it."""
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nkeep_last = 0\n")
    with pytest.raises(ConfigError, match=rf"^{toml}:2: train.keep_last=0 must be >= 1$"):
        load_config(toml)
    with pytest.raises(ConfigError, match=r"^--set 'train.keep_last=0': train.keep_last=0 must be >= 1$"):
        load_config(None, ["train.keep_last=0"])
    toml.write_text("[model]\npreset = 'micro'\ndropout = 1.5\n")
    with pytest.raises(ConfigError, match=rf"^{toml}:3: model.dropout=1.5 is not in \[0, 1\)$"):
        load_config(toml, ["train.seed=2"])
    toml.write_text("[data]\nvocab_size = 200\nmax_len = 1\n")
    with pytest.raises(ConfigError, match=rf"^{toml}:3: data.max_len=1 must be >= 2$"):
        load_config(toml, [f"train.run_dir={tmp_path}"])
    toml.write_text("[data]\nvocab_size = 4\nmax_len = 3\n")
    with pytest.raises(ConfigError, match=rf"^{toml}:2: data.vocab_size=4 must be >= 8; "
                                          rf"--set 'data.max_len=1': data.max_len=1 must be >= 2$"):
        load_config(toml, ["data.max_len=1"])  # the file's line 3 is replaced by --set's
    toml.write_text("[data]\nmax_len = 300\n")  # a contradiction: both places
    with pytest.raises(ConfigError, match=rf"^{toml}:2 and --set 'train.max_tokens=200': data.max_len=300 "):
        load_config(toml, ["train.max_tokens=200"])
    toml.write_text("[model]\npreset = 'micro'\n[data]\ntrain_src = 'a'\nvocab_sise = 3\n")
    with pytest.raises(ConfigError, match=rf"^{toml}:5: unknown \[data\] key vocab_sise \(known: "
                                          "character_coverage, max_len,"):  # the file's: --set's are checked
        load_config(toml, ["train.seed=2"])


def test_which_data_keys_were_written_is_known_only_for_the_data_read():
    """Fine-tuning adopts the checkpoint's tokenizer settings for [data] keys not written; a `data` replaced
    since (the keys were another DataConfig's) or built in Python falls back to "equal to the default"."""
    config = load_config(None, ["data.vocab_size=8000", "data.train_src=a"])
    assert config.given_data_keys() == {"vocab_size", "train_src"}
    assert with_train(config, seed=3).given_data_keys() == {"vocab_size", "train_src"}
    assert dataclasses.replace(config, data=dataclasses.replace(config.data)).given_data_keys() is None
    assert dataclasses.replace(config, data=config.data) == config
    from aiayn.train.config import RunConfig
    assert RunConfig().given_data_keys() is None


def test_init_from_leaves_the_model_keys_to_the_checkpoint():
    """[model] was built on the base preset before the checkpoint was read: restating a checkpoint's
    d_model=36 was "not divisible by n_heads=8", and its max_len 2048 "shorter" than data.max_len."""
    sets = ["train.init_from=ck", "model.d_model=36", "data.max_len=1500", "train.max_tokens=4096"]
    assert load_config(None, sets).model == {"d_model": 36}
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(None, sets[1:])
    for key, message in (("model.dropout=1.5", r"model.dropout=1.5 is not in \[0, 1\)"),
                         ("model.preset=nope", r"model.preset='nope' is not one of")):  # still when loaded
        with pytest.raises(ConfigError, match=rf"^--set {re.escape(repr(key))}: {message}"):
            load_config(None, sets[:1] + [key])


def test_a_set_value_holding_a_line_break_is_refused():
    """Its second line was read as another TOML key and dropped: the run went on without train.seed=3."""
    items = ("train.max_tokens=2048\ntrain.seed=3", "train.run_dir=runs/a\ntrain.seed=3",
             "train.run_dir=a\rb")
    for item in items:
        with pytest.raises(ConfigError, match=r"one value per --set \(the value holds a line break\)"):
            load_config(None, [item])
    assert load_config(None, ["train.run_dir=a b=c"]).train.run_dir == "a b=c"


@pytest.mark.parametrize("where, error", [
    ("update", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
    ("validation", RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                                "allocate memory: you tried to allocate 8589934592 bytes")),
])
def test_running_out_of_memory_in_training_is_one_line_naming_the_setting(tmp_path, capsys, monkeypatch,
                                                                         where, error):
    """A batch too large for the device was CUDA's (or the CPU allocator's) traceback: now one line naming
    train.max_tokens and the checkpoint a --resume goes on from (with the same max_tokens), exit 2. The
    fifth forward is update 5 of a run that saved at update 4 (valid_every=4), or the validation of
    update 4 after its four updates."""
    from aiayn.train import loop

    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=8")
    real_loss, calls = loop.batch_loss, []

    def failing(net, batch, eps, autocast):
        calls.append(net.training)
        forwards = sum(calls) if where == "update" else len(calls)
        if forwards == 5 and net.training == (where == "update"):
            raise error
        return real_loss(net, batch, eps, autocast)

    monkeypatch.setattr(loop, "batch_loss", failing)
    code, line = run_cli(capsys, "train", *set_args(sets))
    doing = "update 5" if where == "update" else "the validation at update 4"
    sized = f"aiayn: error: out of memory in {doing} (batches of up to train.max_tokens=64 tokens a side)"
    keep = "train.update_freq to keep the tokens of an update"
    less = "train.checkpoint_activations=true (less memory, the same updates)"
    saved = tmp_path / "run" / "checkpoints" / "step_000004"
    assert code == 2
    assert line == (f"{sized}: --resume goes on from {saved} with {less} or where more memory is free, or "
                    f"train anew with a lower train.max_tokens (a resume keeps it) and a higher {keep}"
                    if where == "update"
                    else f"{sized}: lower train.max_tokens, and raise {keep}")  # nothing saved before it
    # recomputing the activations saves nothing in a validation (no backward) nor where it is already on
    shutil.rmtree(tmp_path / "run")
    calls.clear()
    code, line = run_cli(capsys, "train", *set_args(sets), "--set", "train.checkpoint_activations=true")
    assert code == 2 and " with train.checkpoint_activations" not in line and sized in line


def test_running_out_of_memory_in_the_first_update_says_recomputing_keeps_less(tmp_path, capsys,
                                                                                monkeypatch):
    """Nothing saved yet: the line says what to set for the same run in less memory, then max_tokens."""
    from aiayn.train import loop

    _, sets = tiny_config(tmp_path, tmp_path / "run", "train.max_updates=8")

    def failing(net, batch, eps, autocast):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loop, "batch_loss", failing)
    code, line = run_cli(capsys, "train", *set_args(sets))
    assert code == 2
    assert line == ("aiayn: error: out of memory in update 1 (batches of up to train.max_tokens=64 tokens a "
                    "side): set train.checkpoint_activations=true (less memory, the same updates), or lower "
                    "train.max_tokens, and raise train.update_freq to keep the tokens of an update")


def test_the_last_updates_before_the_budget_ends_are_logged(tmp_path):
    """A run of 7 updates logging every 2 wrote its training loss at 2, 4 and 6 only: update 7's loss
    was nowhere, and the curve ended short of the run. Its window, however short, is logged at the end:
    the same loss as a run logging every update gives for update 7 alone."""
    records = {}
    for every in (1, 2):
        config, _ = tiny_config(tmp_path, tmp_path / f"run{every}", "train.max_updates=7",
                                f"train.log_every={every}")
        train(config)
        lines = (tmp_path / f"run{every}" / "metrics.jsonl").read_text().splitlines()
        records[every] = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in records[2]] == [2, 4, 6, 7]
    last = [{k: r[k] for k in ("step", "loss", "nll", "lr")} for r in (records[1][-1], records[2][-1])]
    assert last[0] == last[1]


def test_the_last_window_is_logged_where_the_validation_spends_the_budget(tmp_path, monkeypatch):
    """A run whose validation at update 3 used up max_minutes stopped there with update 3's loss nowhere
    (log_every=2): the update's own check saw budget left. The window is logged after that validation."""
    from aiayn.train import loop

    spent = [0.0]
    monkeypatch.setattr(loop, "_training_seconds", lambda before, start, tc, d: before + spent[0])
    real_validate = loop.validate

    def slow_validation(*args, **kwargs):
        spent[0] = 61.0  # the first validation (update 3) spends the minute
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(loop, "validate", slow_validation)
    config, _ = tiny_config(tmp_path, tmp_path / "run", "train.max_minutes=1", "train.valid_every=3",
                            "train.log_every=2")
    assert train(config)["stop"] == "max_minutes=1"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in records] == [(2, True), (3, False), (3, True)]


def test_the_docs_say_training_changes_malloc_for_the_process_and_how_to_keep_it(monkeypatch):
    """train() leaves glibc's malloc keeping freed memory after it returns (mallopt holds for the whole
    process); its docstring listed its other global effects, not this one nor AIAYN_SYSTEM_MALLOC=1."""
    from aiayn import memory

    doc = " ".join(train.__doc__.split())
    assert "for the whole process and after it returns (`aiayn.memory.keep_freed_memory`" in doc
    assert "AIAYN_SYSTEM_MALLOC=1 in the environment before the process first does so leaves malloc" in doc
    monkeypatch.setattr(memory, "_done", False)  # a process that has not changed malloc yet
    monkeypatch.setenv("AIAYN_SYSTEM_MALLOC", "1")
    assert memory.keep_freed_memory() is False  # the opt-out the docstring names


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointed_activations_train_the_same_run_bit_for_bit(straight_run, tmp_path, monkeypatch,
                                                                  precision):
    """train.checkpoint_activations=true recomputes each layer in the backward pass: 6 updates of 2 batches
    with dropout give the weights, Adam moments and generator states of the run that keeps them, exactly, and
    so does a run that turns it on at a --resume (as the out-of-memory line advises). In bf16 the recompute
    left autocast's weight copies cached, and every update after the first computed with stale ones. (The
    recipe counts it as bookkeeping: two ensemble members apart in it alone would train one model twice.)"""
    from conftest import record_checkpointed_layers

    d, config, _ = straight_run
    checkpointed = record_checkpointed_layers(monkeypatch)
    runs = {}
    for name in ("kept", "recomputed", "turned on"):
        run = runs[name] = tmp_path / name
        run.mkdir()
        shutil.copy(d / "run" / "spm.model", run / "spm.model")
        six = with_train(config, run_dir=str(run), precision=precision, max_updates=6)
        if name == "turned on":
            train(with_train(six, max_updates=3))
        train(with_train(six, checkpoint_activations=name != "kept"), resume=name == "turned on")
        assert checkpoint_dirs(run)[-1].name == "step_000006"
    # 6 + 3 updates of 2 batches through micro's 1+1 layers; none in validation, where nothing is recorded
    assert len(checkpointed) == (6 + 3) * 2 * 2
    saved = json.loads((checkpoint_dirs(runs["recomputed"])[-1] / "meta.json").read_text())["config"]["train"]
    assert saved["checkpoint_activations"] is True
    for name in ("recomputed", "turned on"):
        assert_identical(weights(runs[name]), weights(runs["kept"]))
        trainer = "trainer.safetensors"
        assert_identical(weights(runs[name], trainer), weights(runs["kept"], trainer))
