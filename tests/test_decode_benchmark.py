"""The decoding benchmark's Linear floor: it times the products of a real cached decoder step, and each
of its kernels computes x W^T."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import sys
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from aiayn.config import model_config
from aiayn.decoding import DecodeConfig
from aiayn.decoding.search import source_mask, step_log_probs
from aiayn.model import Transformer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import decode  # noqa: E402


@pytest.mark.parametrize("rows", [1, 3])
def test_step_linear_shapes_are_the_products_of_a_cached_step(rows):
    """After the first step (which projects the source's K/V once), a decoder step's mm/addmm FLOPs,
    as torch counts them, are those of `step_linear_shapes` (attention's products are bmm, outside). Under
    no_grad: torch 2.5's FlopCounterMode counted nothing under inference_mode (2.13's does)."""
    torch.manual_seed(0)
    c = model_config("tiny", vocab_size=500, n_decoder_layers=3)
    model = Transformer(c).eval()
    src = torch.randint(3, 500, (rows, 7))
    with torch.no_grad():
        memory, mask = model.encode(src), source_mask(model, src)
        cache = model.new_cache(rows, 8)
        last = torch.full((rows,), c.decoder_start_id)
        step_log_probs(model, last, memory, mask, cache, 0, DecodeConfig())
        with FlopCounterMode(display=False) as counter:
            step_log_probs(model, last, memory, mask, cache, 1, DecodeConfig())
    counted = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in counted.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert linear == 2 * rows * sum(i * o for i, o in decode.step_linear_shapes(c))


@pytest.mark.parametrize("rows", [1, 5])
def test_every_floor_kernel_computes_x_times_w_transposed(rows):
    w, x = torch.randn(24, 16), torch.randn(rows, 16)
    kernels = decode.floor_kernels(rows)
    assert {"MKL sgemm on W", "MKL sgemm on W^T"} <= set(kernels)
    for name, layout in kernels.items():
        torch.testing.assert_close(layout(w)(x), F.linear(x, w), msg=name)


def test_linear_floor_runs_the_steps_with_the_fastest_kernel():
    floor = decode.LinearFloor(model_config("tiny", vocab_size=500))
    assert floor(2, 1) is None and floor(1, 3) is None  # products only: no output to compare
    assert set(floor.chosen) == {2, 3}
    assert all(kernel in decode.floor_kernels(r) for r, kernel in floor.chosen.items())


@pytest.mark.parametrize("beam", [1, 2])
def test_the_engines_return_the_same_ids_for_the_same_model(tmp_path, beam):
    """The benchmark compares the engines' outputs (`agreement`): aiayn, HF and CTranslate2 runners give
    each sentence's ids in one id space. Checked on a narrow model of the benchmark's vocabulary."""
    from transformers import MarianConfig, MarianMTModel

    small = {**decode.marian_config().to_dict(), "d_model": 32, "encoder_layers": 1, "decoder_layers": 2,
             "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_attention_heads": 2,
             "decoder_attention_heads": 2}
    torch.manual_seed(0)
    hf = MarianMTModel(MarianConfig(**small)).eval()
    with torch.no_grad():  # as `build_hf`: embeddings of unit variance after the sqrt(d) scale
        hf.model.shared.weight.normal_(0.0, 32**-0.5)
        hf.model.shared.weight[decode.PAD] = 0.0
    src = decode.sources(0)[:2]
    ours, theirs = decode.run_aiayn(decode.build_aiayn(hf), src, beam), decode.run_hf(hf, src, beam)
    outputs = {"aiayn fp32@1": ours, "HF Marian fp32@1": theirs, "aiayn int8@1": [[0]] * 2,
               "Linear floor@1": None}
    if decode.peer_available("ctranslate2", "CTranslate2"):
        import ctranslate2

        path = decode.convert_ct2(hf, tmp_path)["float32"]
        translator = ctranslate2.Translator(path, device="cpu", intra_threads=1)
        tokens = [[f"t{i}" for i in row[:-1].tolist()] + ["</s>"] for row in src]
        outputs["CT2 float32@1"] = decode.run_ct2(translator, tokens, beam, decode._Vocabulary().get_vocab())
    assert all(len(ids) == decode.NEW_TOKENS for ids in ours)
    assert decode.agreement(outputs) == {k: 1.0 for k in outputs if k.split("@")[0] in decode.EXACT[1:]}
    other = [ours[0], [i + 1 for i in ours[1]]]  # one sentence translated otherwise
    assert decode.agreement({**outputs, "HF Marian fp32@1": other})["HF Marian fp32@1"] == 0.5


def test_each_engine_is_taken_at_its_own_best_thread_count():
    measured = {"greedy, batch 1": {"aiayn fp32@1": 100.0, "CT2 float32@1": 120.0,
                                    "aiayn fp32@2": 150.0, "CT2 float32@2": 70.0}}
    per_threads = decode.by_threads(measured, [1, 2])
    assert per_threads == {1: {"greedy, batch 1": {"aiayn fp32": 100.0, "CT2 float32": 120.0}},
                           2: {"greedy, batch 1": {"aiayn fp32": 150.0, "CT2 float32": 70.0}}}
    best, count = decode.at_best(per_threads)
    assert best == {"greedy, batch 1": {"aiayn fp32": 150.0, "CT2 float32": 120.0}}
    assert count == {"greedy, batch 1": {"aiayn fp32": 2, "CT2 float32": 1}}


def test_thread_counts_parse_a_comma_list():
    assert decode.thread_counts("2,1,2") == [1, 2]
    for bad in ("0", "two", "1,"):
        with pytest.raises(decode.argparse.ArgumentTypeError):
            decode.thread_counts(bad)


def test_without_ctranslate2_its_engines_are_skipped_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` then fails, as if absent
    monkeypatch.setattr(decode, "has_cxx_compiler", lambda: True)
    assert decode.engine_names("cpu") == [
        "aiayn fp32", decode.COMPILED, "HF Marian fp32", "aiayn int8", decode.FLOOR]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ctranslate2" in err[0] and "pip install -e '.[bench]'" in err[0]
    monkeypatch.setattr(decode, "has_cxx_compiler", lambda: False)  # no C++ compiler: no compiled engine
    assert decode.engine_names("cpu") == ["aiayn fp32", "HF Marian fp32", "aiayn int8", decode.FLOOR]
    assert "no C++ compiler" in capsys.readouterr().err


def test_table_and_verdict_of_the_compiled_engine():
    results = {"greedy, batch 1": {"aiayn fp32": 90.0, decode.COMPILED: 110.0, "HF Marian fp32": 50.0,
                                   "CT2 float32": 100.0}}
    assert "| 90.0 | 110.0 | 50.0 | 100.0 | 0.90x | 1.80x | 1.10x |" in decode.table(results)
    verdict = decode.verdict(results)
    assert "vs CT2 float32 >= 1: 0.90x, NOT met" in verdict
    assert "compiled vs CT2 float32 >= 1: 1.10x, met" in verdict
    assert "vs HF >= 2: 1.80x, NOT met" in verdict and "compiled vs HF >= 2: 2.20x, met" in verdict


def test_table_and_verdict_without_ctranslate2_columns():
    results = {"greedy, batch 1": {"aiayn fp32": 90.0, "HF Marian fp32": 30.0, decode.FLOOR: 120.0}}
    assert "| greedy, batch 1 | 90.0 | 30.0 | 120.0 | - | 3.00x | 4.00x |" in decode.table(results)
    assert "vs HF >= 2: 3.00x, met" in decode.verdict(results)
    assert "CT2" not in decode.verdict(results)


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--settle", "-1"], ["--threads", "0"]])
def test_bad_arguments_are_usage_errors(bad):
    with pytest.raises(SystemExit) as stopped:
        decode.parse_args(bad)
    assert stopped.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_device_is_refused_up_front():
    with pytest.raises(SystemExit, match="no such CUDA device"):
        decode.parse_args(["--device", "cuda"])


def test_a_cuda_device_by_number_is_taken_as_the_other_scripts_take_it(monkeypatch, tmp_path):
    """train_step.py, layers.py and attention_memory.py take --device cuda:N; decode.py refused even
    cuda:0 ("invalid choice"). Taken, it is synchronised, and CTranslate2 runs, on that device (no GPU
    needed: the CUDA calls are recorded); the files are named by the device's type, not decode_cuda:1."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(decode, "LOCAL_RESULTS", tmp_path)
    args = decode.parse_args(["--device", "cuda:1"])
    assert args.device == "cuda:1" and args.out == tmp_path / "decode_cuda"
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(str(device)))
    assert decode.answer(lambda batch, beam: [[5]], (1, 1), "cuda:1")[1] == [[5]]
    assert synced == ["cuda:1", "cuda:1"]
    ctranslate2 = pytest.importorskip("ctranslate2")
    made = {}
    monkeypatch.setattr(ctranslate2, "Translator", lambda path, **options: made.update(options))
    monkeypatch.setattr(decode, "keep_freed_memory", lambda: None)
    threads = torch.get_num_threads()
    try:
        decode.make_engine("CT2 float32", 0, "cuda:1", {"float32": str(tmp_path)}, threads)
    finally:
        torch.set_num_threads(threads)
    assert made["device"] == "cuda" and made["device_index"] == 1
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 1)  # only cuda:0 for CTranslate2
    assert "CT2 float32" not in decode.engine_names("cuda:1")
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 2)
    assert "CT2 float32" in decode.engine_names("cuda:1")


def test_output_defaults_to_the_local_results_folder():
    assert decode.parse_args([]).out == decode.LOCAL_RESULTS / "decode_cpu"
    assert decode.LOCAL_RESULTS.name == "local" and decode.LOCAL_RESULTS.parent.name == "results"


@pytest.mark.parametrize("bad, message", [
    (["--settle", "inf"], "must be finite"),  # an OverflowError in time.sleep after the models were built
    (["--seed", str(10**23)], "must be within"),  # an overflow traceback
    (["--device", "meta"], "the benchmarks run on cpu or cuda"),
])
def test_values_it_cannot_use_are_refused_up_front(bad, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        decode.parse_args(bad)
    assert message in capsys.readouterr().err + str(stopped.value)  # argparse's usage line, or the exit's


def test_cells_are_chosen_by_name_in_the_tables_order(capsys):
    assert decode.parse_args(["--cells", "beam4-16,greedy-1"]).cells == [("greedy", 1, 1), ("beam 4", 4, 16)]
    assert decode.parse_args([]).cells == decode.CELLS
    with pytest.raises(SystemExit):
        decode.parse_args(["--cells", "greedy-2"])
    assert "greedy-2: not among greedy-1, greedy-16, beam4-1, beam4-16" in capsys.readouterr().err


@pytest.mark.parametrize("text, said", [
    ("", ("argument --engines: '': not among aiayn fp32, aiayn fp32 compiled, HF Marian fp32, aiayn int8, "
          "Linear floor, CT2 float32, CT2 int8")),
    ("CT2 float32,", "argument --engines: '': not among"),  # a stray comma
    ("CT2 float32, CT2 fp16", "argument --engines: 'CT2 fp16': not among"),
])
def test_engines_are_checked_when_the_arguments_are_read(text, said, capsys):
    """`--engines ""` was refused as "--engines:  not among those here", an empty name, after ~10 s of
    building the HuggingFace model."""
    with pytest.raises(SystemExit) as stopped:
        decode.parse_args(["--engines", text])
    assert stopped.value.code == 2 and said in capsys.readouterr().err
    chosen = decode.parse_args(["--engines", "CT2 float32, Linear floor"]).engines
    assert chosen == ["CT2 float32", "Linear floor"]


def test_an_engine_not_here_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """A known engine this machine lacks (CTranslate2's without ctranslate2) was refused after the model was
    built."""
    main = _scripted_main(monkeypatch, ["aiayn fp32", "HF Marian fp32"], {})
    monkeypatch.setattr(decode, "build_hf", lambda seed: pytest.fail("the model was built"))
    with pytest.raises(SystemExit, match=r"^--engines: CT2 int8 not among those here: aiayn fp32, HF Marian "
                                         r"fp32$"):
        main(["--engines", "CT2 int8", "--out", str(tmp_path / "decode")])


@pytest.mark.parametrize("refused", ["seed", "transformers", "engine"])
def test_a_refused_run_makes_no_output_folder(refused, tmp_path, monkeypatch):
    """--out's folders were made before --seed 99999999999999999999, a missing transformers or an engine
    not here refused the run, and were left behind."""
    main = _scripted_main(monkeypatch, ["aiayn fp32", "HF Marian fp32"], {})
    monkeypatch.setattr(decode, "build_hf", lambda seed: pytest.fail("the model was built"))
    argv = {"seed": ["--seed", str(10**20)], "transformers": [], "engine": ["--engines", "CT2 int8"]}[refused]
    if refused == "transformers":
        monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` then fails
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--out", str(tmp_path / "new" / "decode")])
    assert stopped.value.code != 0
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_one_cell_runs_end_to_end_and_compares_the_outputs(tmp_path):
    """The whole benchmark takes many minutes: one cell, two engines, one repeat, to see it run as written
    (the base-shaped model in each worker process) and record that HF translated as aiayn did."""
    out = tmp_path / "decode"
    decode.main(["--cells", "greedy-1", "--engines", "HF Marian fp32", "--repeats", "1", "--settle", "0",
                 "--out", str(out)])
    record = json.loads(decode.with_suffix_added(out, ".json").read_text())
    timed = record["tokens_per_second_by_threads"]["1"]["greedy, batch 1"]
    assert set(timed) == {"aiayn fp32", "HF Marian fp32"}
    assert record["environment"]["outputs_as_aiayn_fp32"] == {"greedy, batch 1": {"HF Marian fp32@1": 1.0}}


def test_an_output_prefix_keeps_its_dots_and_is_checked_before_timing(tmp_path, monkeypatch):
    """--out D/decode_v1.5 wrote decode_v1.{json,md} (over another run's); --out FILE/x failed after the
    run."""
    (tmp_path / "FILE").write_text("mine")
    main = _scripted_main(monkeypatch, ["aiayn fp32", "HF Marian fp32"], {})
    monkeypatch.setattr(decode, "build_hf", lambda seed: pytest.fail("the model was built"))
    with pytest.raises(SystemExit, match="is not a directory"):
        main(["--out", str(tmp_path / "FILE" / "x")])
    out = decode.parse_args(["--out", str(tmp_path / "decode_v1.5")]).out
    assert decode.with_suffix_added(out, ".json").name == "decode_v1.5.json"


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="no MKL")
def test_one_row_benchmark_times_each_kernel_and_names_aiayns_pick(tmp_path, monkeypatch):
    """benchmarks/one_row.py: every kernel at every thread count (the blocks from two threads up), each
    checked against F.linear before timing, and the kernel `one_row_blocks` picks there."""
    import one_row

    from aiayn.decoding import cpu

    threads = torch.get_num_threads()
    monkeypatch.setattr(one_row, "model_config", lambda *a, **k: model_config("tiny", vocab_size=501))
    monkeypatch.setattr(cpu, "_cpu_vendor", lambda: "AuthenticAMD")
    try:
        result = one_row.main(["--threads", "2,1", "--rounds", "1", "--out", str(tmp_path / "r")])
    finally:
        torch.set_num_threads(threads)
    assert list(result["ms"]) == [1, 2]
    onednn = {one_row.ONEDNN} if cpu.packing_available() else set()
    assert set(result["ms"][1]) == {one_row.WHOLE, one_row.SMALL_PAGES} | onednn
    assert set(result["ms"][2]) == {one_row.WHOLE, one_row.BLOCKS, one_row.SMALL_PAGES} | onednn
    assert all(t > 0 for t in result["ms"][2].values())
    assert result["picked"] == {1: one_row.WHOLE, 2: one_row.BLOCKS}
    assert (tmp_path / "r.json").exists() and "| 2 |" in (tmp_path / "r.md").read_text()
    with pytest.raises(SystemExit):
        one_row.main(["--threads", "0,2"])


CUBLAS = "RuntimeError: Library libcublas.so.12 is not found or cannot be loaded"  # CT2's error on a GPU


def _scripted_worker(conn, name: str, fails: dict[str, int]) -> None:
    """A worker answering as `serve` does (nothing timed). An engine of `fails` ({engine: batch}) fails when
    asked for that batch: at 16 it ends without a word, as a crashed process; at 1 it answers FAILED with
    cuBLAS's error, as a CTranslate2 wheel whose CUDA libraries do not load does at its first translation."""
    conn.send("ready")
    while (request := conn.recv()) is not None:
        if request == "memory":
            conn.send(100.0)
            continue
        if request == decode.KEPT:
            conn.send(True)
            continue
        batch, _ = request
        if fails.get(name) == batch == 16:
            os._exit(1)
        if fails.get(name) == batch == 1:
            conn.send((decode.FAILED, CUBLAS))
            raise SystemExit(1)
        conn.send((0.01, [[5] * decode.NEW_TOKENS for _ in range(batch)]))


class _ScriptedEngine(decode.Engine):
    """`decode.Engine` on a forked `_scripted_worker`: the parent's side as it runs, the models left out."""

    fails: ClassVar[dict[str, int]] = {}  # {engine: the batch it fails at}, `_scripted_worker`

    def __init__(self, name: str, seed: int, device: str, ct2_paths: dict, threads: int):
        self.label = f"{name} ({threads} thread{'s' if threads > 1 else ''})"
        ctx = multiprocessing.get_context("fork")  # the target needs no import in the child
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_scripted_worker, args=(child, name, self.fails), daemon=True)
        self.process.start()
        child.close()


def _scripted_main(monkeypatch, engines: list[str], fails: dict[str, int]):
    """`decode.main` on `_ScriptedEngine`s of `engines`, those of `fails` failing (`_scripted_worker`)."""
    monkeypatch.setattr(decode, "Engine", _ScriptedEngine)
    monkeypatch.setattr(_ScriptedEngine, "fails", fails)
    monkeypatch.setattr(decode, "build_hf", lambda seed: torch.nn.Linear(2, 2))
    monkeypatch.setattr(decode, "build_aiayn", lambda hf: None)
    monkeypatch.setattr(decode, "check_same_logits", lambda hf, model, src: 0.0)
    monkeypatch.setattr(decode, "convert_ct2", lambda hf, workdir: {})
    monkeypatch.setattr(decode, "engine_names", lambda device: engines)
    return decode.main


def test_a_worker_dying_mid_run_ends_it_in_one_line_and_keeps_the_cells_before(tmp_path, monkeypatch):
    """A worker that died: the parent's EOFError came as a second traceback, exit 1, and nothing was
    written although earlier cells had been measured. HF Marian fp32 is one the ratios are taken against:
    without it the run cannot go on."""
    engines = ["aiayn fp32", "HF Marian fp32", "CT2 float32"]
    main = _scripted_main(monkeypatch, engines, {"HF Marian fp32": 16})
    out = tmp_path / "decode"
    main(["--cells", "greedy-1,beam4-1", "--repeats", "1", "--settle", "0", "--out", str(out)])
    saved = json.loads(decode.with_suffix_added(out, ".json").read_text())  # a run that ends: as before
    assert list(saved["tokens_per_second_by_threads"]["1"]) == ["greedy, batch 1", "beam 4, batch 1"]
    assert saved["resident_mb_after_runs"] == {f"{e}@1": 100 for e in engines}
    assert "stopped" not in saved["environment"] and "failed_engines" not in saved["environment"]
    assert saved["environment"]["keeps_freed_memory"] is True  # the workers' keep_freed_memory()
    with pytest.raises(SystemExit) as stopped:
        main(["--cells", "greedy-1,greedy-16,beam4-1", "--repeats", "1", "--settle", "0", "--out", str(out)])
    message = str(stopped.value.code)
    assert message.startswith("decode.py: HF Marian fp32 (1 thread) failed: its worker ended without an "
                              "answer")
    assert "the 1 cell(s) measured before it are in" in message and "\n" not in message
    saved = json.loads(decode.with_suffix_added(out, ".json").read_text())
    assert list(saved["tokens_per_second_by_threads"]["1"]) == ["greedy, batch 1"]
    assert saved["environment"]["stopped"].startswith("HF Marian fp32 (1 thread) failed")
    assert "**Stopped: HF Marian fp32 (1 thread) failed" in decode.with_suffix_added(out, ".md").read_text()


@pytest.mark.parametrize("batch", [1, 16])
def test_a_failing_peer_is_left_out_and_the_run_goes_on(tmp_path, monkeypatch, capsys, batch):
    """A CTranslate2 wheel whose CUDA libraries do not load fails at its first translation (cuBLAS loads on
    first use), in the first cell's warm-up: the run ended with no cell measured and nothing written, so no
    aiayn-vs-HF figure either. Now CT2 is left out at every thread count, its figures of earlier cells too
    (batch 16: it fails in the second cell), and said so in one line and in the results."""
    engines = ["aiayn fp32", "HF Marian fp32", "CT2 float32", "CT2 int8"]
    main = _scripted_main(monkeypatch, engines, {"CT2 float32": batch})
    out = tmp_path / "decode"
    main(["--cells", "greedy-1,greedy-16", "--threads", "1,2", "--repeats", "1", "--settle", "0",
          "--out", str(out)])
    saved = json.loads(decode.with_suffix_added(out, ".json").read_text())
    for threads in ("1", "2"):
        cells = saved["tokens_per_second_by_threads"][threads]
        assert list(cells) == ["greedy, batch 1", "greedy, batch 16"]
        assert all(list(r) == ["aiayn fp32", "HF Marian fp32", "CT2 int8"] for r in cells.values())
    assert set(saved["resident_mb_after_runs"]) == {f"{e}@{t}" for e in engines if e != "CT2 float32"
                                                    for t in (1, 2)}
    shares = saved["environment"]["outputs_as_aiayn_fp32"]
    assert list(shares["greedy, batch 1"]) == ["HF Marian fp32@1", "HF Marian fp32@2"]
    why = saved["environment"]["failed_engines"]["CT2 float32"]
    assert why.startswith("CT2 float32 (") and "stopped" not in saved["environment"]
    assert (why.endswith(CUBLAS) if batch == 1 else "ended without an answer" in why)
    assert f"**Left out: {why}.**" in decode.with_suffix_added(out, ".md").read_text()
    left_out = [line for line in capsys.readouterr().err.splitlines() if "left out" in line]
    assert left_out == [f"decode.py: {why}; CT2 float32 is left out of this run"]


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None, reason="needs ctranslate2")
def test_a_worker_whose_engine_raises_is_named_with_its_error_line(tmp_path, capfd):
    """An engine that raises (here CTranslate2 on a model folder that is not there; on the GPU machine a
    cuBLAS it could not load) is reported as its name and its error's last line, no traceback from either
    process; so is a request that fails in a worker that started."""
    engine = decode.Engine("CT2 float32", 0, "cpu", {"float32": str(tmp_path / "missing")}, 1)
    with pytest.raises(decode.WorkerFailed, match=r"^CT2 float32 \(1 thread\) failed: RuntimeError: "):
        engine.wait_ready()
    engine.close()
    floor = decode.Engine(decode.FLOOR, 0, "cpu", {}, 1)
    floor.wait_ready()
    with pytest.raises(decode.WorkerFailed, match=r"^Linear floor \(1 thread\) failed: RuntimeError: "):
        floor(-1, 1)  # rows = -1: torch.randn raises for a negative dimension
    floor.close()
    assert engine.process.exitcode == floor.process.exitcode == 1
    assert "Traceback" not in capfd.readouterr().err


def _conversion_fails(hf, workdir):
    raise ValueError("No conversion is registered for the model configuration MarianConfig")


def test_a_failing_ctranslate2_conversion_leaves_its_engines_out_in_one_line(tmp_path, monkeypatch, capsys):
    """CTranslate2's conversion of the model (in the parent process, before any worker starts) failing was
    a traceback that ended the run: no aiayn or HF figure either."""
    engines = ["aiayn fp32", "HF Marian fp32", "CT2 float32", "CT2 int8"]
    main = _scripted_main(monkeypatch, engines, {})
    monkeypatch.setattr(decode, "convert_ct2", _conversion_fails)
    out = tmp_path / "decode"
    main(["--cells", "greedy-1", "--repeats", "1", "--settle", "0", "--out", str(out)])
    saved = json.loads(decode.with_suffix_added(out, ".json").read_text())
    timed = saved["tokens_per_second_by_threads"]["1"]["greedy, batch 1"]
    assert list(timed) == ["aiayn fp32", "HF Marian fp32"]
    why = "CTranslate2's model conversion failed: ValueError: No conversion is registered for the model"
    failed = saved["environment"]["failed_engines"]
    assert list(failed) == ["CT2 float32", "CT2 int8"]
    assert all(line.startswith(f"{name}: {why}") for name, line in failed.items())
    said = [line for line in capsys.readouterr().err.splitlines() if "conversion" in line]
    assert len(said) == 1 and said[0].startswith(f"decode.py: {why}")
    assert said[0].endswith("; CT2 float32 and CT2 int8 are left out of this run")


def test_ctranslate2_int8_alone_gets_its_model_converted(tmp_path, monkeypatch):
    """--engines "CT2 int8" without "CT2 float32": nothing was converted, and its worker failed."""
    converted = []
    main = _scripted_main(monkeypatch, ["aiayn fp32", "HF Marian fp32", "CT2 int8"], {})
    monkeypatch.setattr(decode, "convert_ct2", lambda hf, workdir: converted.append(workdir) or {})
    main(["--cells", "greedy-1", "--repeats", "1", "--settle", "0", "--out", str(tmp_path / "decode")])
    assert len(converted) == 1
