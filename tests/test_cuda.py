"""What only a CUDA GPU shows: the model's numbers there, SDPA's fused kernels, cached decoding and search,
training in bf16 and fp16, and resuming with the GPU's random state. Skipped without a GPU (CI has none);
`benchmarks/gpu.sh` runs them on a lent machine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import padded_batch, tiny_model
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from train_helpers import tiny_config

from aiayn.cli import main
from aiayn.decoding import DecodeConfig, generate
from aiayn.train.config import with_train
from aiayn.train.loop import train
from aiayn.train.loss import block_rows, label_smoothed_nll
from aiayn.train.state import checkpoint_dirs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def true_float32():
    """Float32 products in full float32 (PyTorch's default), whatever another test set: TF32 would
    round to 10-bit mantissas and hide an error of that size."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("norm_first", [False, True])
def test_float32_logits_on_the_gpu_equal_a_float64_reference_on_a_padded_batch(norm_first):
    torch.manual_seed(0)
    reference = tiny_model(norm_first=norm_first).double()
    model = tiny_model(norm_first=norm_first).to(CUDA)
    model.load_state_dict(reference.state_dict())  # cast to float32 on the GPU
    src, tgt = padded_batch([7, 3, 5, 1], 50), padded_batch([6, 6, 2, 4], 50)
    with torch.no_grad():
        expected = reference(src, tgt)
        got = model(src.to(CUDA), tgt.to(CUDA))
    assert got.isfinite().all()
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("norm_first", [False, True])
def test_bf16_training_pass_runs_on_fused_sdpa_kernels_and_stays_near_float64(norm_first):
    """With SDPA's math fallback ruled out, forward and backward in bf16 autocast must find a fused
    kernel (flash or memory-efficient) for every attention of a padded batch, and the logits stay
    within bf16's rounding of the float64 ones."""
    torch.manual_seed(0)
    reference = tiny_model(norm_first=norm_first, d_model=64, n_heads=2).double()
    model = tiny_model(norm_first=norm_first, d_model=64, n_heads=2).to(CUDA)
    model.load_state_dict(reference.state_dict())
    src, tgt = padded_batch([9, 3, 16, 1], 50), padded_batch([8, 12, 2, 5], 50)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src.to(CUDA), tgt.to(CUDA))
        logits.float().square().mean().backward()
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    with torch.no_grad():
        expected = reference(src, tgt)
    assert relative_error(logits, expected) < 2e-2


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpointed_activations_on_the_gpu_draw_the_same_dropout_and_keep_less(bf16):
    """On a GPU dropout is F.dropout's Philox kernel, drawn from the CUDA generator: the recompute must
    restore that generator (a CPU-only restore gave other masks: gradients off by far more than rounding),
    and the step's peak memory falls. Gradients within rounding, not bit for bit: a fused attention's
    backward may add in any order."""
    def step(checkpointed: bool) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = tiny_model(dropout=0.3, d_model=64, n_heads=2, d_ff=256).to(CUDA).train()
        model.checkpoint_activations = checkpointed
        src, tgt = padded_batch([32] * 16, 50).to(CUDA), padded_batch([32] * 16, 50).to(CUDA)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.cuda.manual_seed(5)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(src, tgt)
        logits.float().square().mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        return {n: p.grad.float() for n, p in model.named_parameters()}, peak

    (kept, kept_peak), (recomputed, recomputed_peak) = step(False), step(True)
    for name, grad in kept.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=2e-2 if bf16 else 1e-4, atol=1e-6, msg=name)
    assert recomputed_peak < 0.7 * kept_peak


def test_cached_decoding_on_the_gpu_equals_full_recomputation():
    torch.manual_seed(0)
    model = tiny_model().to(CUDA)
    src, tgt = padded_batch([6, 3], 50).to(CUDA), padded_batch([7, 7], 50).to(CUDA)
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        full = model.decode(tgt, memory, mask)  # (B, T, V)
        cache = model.new_cache(2, tgt.shape[1])
        for t in range(tgt.shape[1]):
            step = model.decode(tgt[:, t : t + 1], memory, mask, cache)  # (B, 1, V)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_search_on_the_gpu_finds_what_it_finds_on_the_cpu(beam):
    torch.manual_seed(0)
    model = tiny_model()
    src = padded_batch([5, 2, 7, 4], 50)
    config = DecodeConfig(beam=beam, n_best=beam, max_len_a=1.0, max_len_b=6)
    on_cpu = generate(model, src, config)
    on_gpu = generate(model.to(CUDA), src.to(CUDA), config)
    for a, b in zip(on_cpu, on_gpu):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def last_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_dirs(run_dir)[-1] / "model.safetensors"))


def assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_on_the_gpu_learns_and_resumes_with_its_random_state(precision, tmp_path, monkeypatch):
    """10 updates straight against 5, a stop and 5 more with --resume: dropout's masks come from the
    GPU's generator, so the weights only match if the checkpoint restored its state (a resume that
    skips restoring it is shown to differ). Not bit for bit: GPU kernels that accumulate with atomics
    (index_add in the embedding's backward) may round in another order."""
    straight = tmp_path / "straight"
    (tmp_path / "data").mkdir()
    config, _ = tiny_config(tmp_path / "data", straight, "train.max_updates=10", "train.device=cuda",
                            f"train.precision={precision}")
    result = train(config)
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    validations = [r["valid_loss"] for r in records if "valid_loss" in r]
    assert result["step"] == 10 and len(validations) == 3 and validations[-1] < validations[0]
    for name, restore in (("resumed", True), ("without_gpu_rng", False)):
        run = tmp_path / name
        run.mkdir()
        shutil.copy(straight / "spm.model", run / "spm.model")  # the same tokenizer, not a retrained one
        train(with_train(config, run_dir=str(run), max_updates=5))
        with monkeypatch.context() as m:
            if not restore:
                m.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None)
            train(with_train(config, run_dir=str(run)), resume=True)
    assert_close_weights(last_weights(tmp_path / "resumed"), last_weights(straight))
    with pytest.raises(AssertionError):
        assert_close_weights(last_weights(tmp_path / "without_gpu_rng"), last_weights(straight))


def test_short_demo_on_the_gpu(tmp_path, capsys):
    """`aiayn demo --device cuda`: every stage (training, beam search, attention maps) with the GPU."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--size", "tiny", "--steps", "12", "--train-pairs", "600",
                 "--test-pairs", "12", "--beam", "2", "--device", "cuda"]) == 0
    assert "held-out exact match" in capsys.readouterr().out
    assert len((out / "test.hyp.de").read_text(encoding="utf-8").splitlines()) == 12
    assert (out / "run" / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_loss_on_the_gpu_equals_a_float64_reference(dtype):
    """The GPU's whole-tensor loss kernels (`block_rows` None) for every training dtype: the float64 loss of
    the same logits within float32 rounding, the float64 gradient within one rounding to `dtype`. The NLL
    is a statistic without a gradient (0336a69): what it adds to a backward is nothing."""
    g = torch.Generator().manual_seed(6)
    z = (torch.randn(300, 1000, generator=g) * 4).to(CUDA, dtype).requires_grad_()
    y = torch.randint(0, 1000, (300,), generator=g).to(CUDA)
    assert block_rows(z) is None
    smoothed, nll = label_smoothed_nll(z, y, 0.1, ignore_index=None)
    w = torch.rand((), generator=g).item()
    (smoothed * w + nll).backward()
    z64 = z.detach().cpu().double().requires_grad_()
    ref = F.cross_entropy(z64, y.cpu(), label_smoothing=0.1, reduction="sum")
    ref_nll = F.cross_entropy(z64, y.cpu(), reduction="sum")
    (ref * w).backward()
    assert not nll.requires_grad
    assert smoothed.item() == pytest.approx(ref.item(), rel=1e-6)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    assert z.grad.dtype == dtype
    # relative: one rounding; absolute: float16's subnormal spacing, where small probabilities land
    rtol, atol = {torch.bfloat16: (2**-7, 1e-9), torch.float16: (2**-10, 2**-24),
                  torch.float32: (1e-6, 1e-9)}[dtype]
    torch.testing.assert_close(z.grad.cpu().double(), z64.grad, rtol=rtol, atol=atol)
