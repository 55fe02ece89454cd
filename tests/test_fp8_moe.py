"""FP8 routed experts (DeepSeek-V3's e4m3 experts with block scales): the triton grouped GEMMs
(triton_experts.fused_experts_fp8, under TRITON_INTERPRET=1 on CPU) against the W8A8 torch reference and near the
weight-only one, with mutated kernels failing the same check (tests/test_moe.py compiles the FP8 mode for sm_90); the torch path equal to the dequantize-then-
fused_experts definition; the backends' FP8 dispatch; and the tiny FP8 DeepSeek-V3 with its experts kept in
e4m3 (half of bf16's bytes): the dequantized model's tokens on the torch path, the W8A8 reference's logits on
the triton kernel, this rank's blocks under tensor parallelism (off-block splits refused) and this rank's
experts only under expert parallelism. `gpu` tests run DeepSeek-V3's expert sizes on a CUDA device.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

from helpers_tiny_models import PagedRunner, random_tokens, write_tiny_deepseek_fp8_pair  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_deepseek_v3 import HUB_V3  # noqa: E402

from flotilla.kernels import moe as moe_kernels  # noqa: E402
from flotilla.kernels.moe import MoEBackend, get_moe_backend, select_experts, torch_ref  # noqa: E402
from flotilla.kernels.quant import FP8_DTYPE, block_dequantize, block_quantize  # noqa: E402
from flotilla.models import parallel, qwen3_moe  # noqa: E402
from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from flotilla.models.deepseek_v3_moe import Fp8StackedExperts  # noqa: E402
from flotilla.models.hf_config import load_hf_config, parse_hf_config  # noqa: E402
from flotilla.models.loader import load_model  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA and not INTERPRET else "cpu")
needs_triton = pytest.mark.skipif(not HAS_TRITON or not (ON_CUDA or INTERPRET), reason="triton cannot run here")
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def gpu_test(fn):
    """Marked `gpu` and skipped unless triton compiles for a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA or INTERPRET, reason="needs a CUDA device")(fn))


def _fp8_case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, block: tuple[int, int],
              dtype: torch.dtype, seed: int, device: torch.device = DEVICE):  # fmt: skip
    """(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids): e4m3 experts quantized from random
    weights whose block columns differ in magnitude by up to 10^3 (so a misplaced scale shows), gate and up
    apart (their scales stacked, gate's block rows first)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def weights(*shape: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=gen, device=device) * shape[-1] ** -0.5
        return w * torch.logspace(-1.5, 1.5, shape[-1], device=device)[torch.randperm(shape[-1], generator=gen,
                                                                                      device=device)]  # fmt: skip

    w13, w13_scale = zip(*(torch_ref.w13_block_quantize(weights(2 * inter, hidden), block) for _ in range(experts)))
    w2, w2_scale = zip(*(block_quantize(weights(hidden, inter), block) for _ in range(experts)))
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    topk_weights, topk_ids = select_experts(torch.randn(tokens, experts, generator=gen, device=device), top_k, True)
    return (x, torch.stack(w13), torch.stack(w13_scale), torch.stack(w2), torch.stack(w2_scale), topk_weights,
            topk_ids)  # fmt: skip


def _check_against_references(run, case, block: tuple[int, int]) -> None:
    """run(*case, block) equals the W8A8 reference (float32: to accumulation order; half precision: to rounding)
    and is within the activations' quantization of the weight-only reference."""
    x = case[0]
    got = run(*case, block)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = torch_ref.fused_experts_fp8_w8a8(*case, block)
    scale = want.float().abs().max().item() if want.numel() else 1.0
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    else:  # a bf16 rounding that lands on the other side of an e4m3 step moves one value by one step
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2)
        assert (got == want).float().mean().item() >= 0.9
    weight_only = torch_ref.fused_experts_fp8(*case, block)
    torch.testing.assert_close(got.float(), weight_only.float(), atol=0.1 * scale, rtol=0)


# ---- the torch path and the layout helpers ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fp8_experts_are_the_dequantized_experts_to_the_bit(dtype: torch.dtype) -> None:
    block = (32, 16)
    case = _fp8_case(9, 64, 48, 5, 2, block, dtype, seed=1, device=torch.device("cpu"))
    x, w13, s13, w2, s2, weights, ids = case
    dense13 = torch.stack([torch_ref.w13_block_dequantize(w, s, block, dtype) for w, s in zip(w13, s13, strict=True)])
    dense2 = torch.stack([block_dequantize(w, s, block, dtype) for w, s in zip(w2, s2, strict=True)])
    assert torch.equal(torch_ref.fused_experts_fp8(*case, block), torch_ref.fused_experts(x, dense13, dense2, weights, ids))
    # gate's 48 rows are 1.5 blocks of 32: their scales keep gate's 2 block rows apart from up's 2
    assert s13.shape == (5, 4, 4) and s2.shape == (5, 2, 3)
    gate_q, gate_s = block_quantize(torch_ref.w13_block_dequantize(w13[0], s13[0], block)[:48], block)
    assert torch.equal(gate_s, s13[0, :2]) and torch.equal(gate_q.float(), w13[0, :48].float())
    with pytest.raises(ValueError, match=r"FP8 expert scales \(5, 3, 4\) and \(5, 2, 3\) do not fit"):
        torch_ref.fused_experts_fp8(x, w13, s13[:, :3], w2, s2, weights, ids, block)
    with pytest.raises(ValueError, match="FP8 experts take e4m3 weights"):
        torch_ref.fused_experts_fp8(x, w13.float(), s13, w2, s2, weights, ids, block)


def test_backends_offer_fp8_experts_or_are_refused_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_moe_backend("torch", fp8_weights=True).fused_experts_fp8 is torch_ref.fused_experts_fp8
    assert get_moe_backend("auto", device=torch.device("cpu"), fp8_weights=True).name == "torch"
    monkeypatch.setitem(moe_kernels._BACKENDS, "bf16_only", MoEBackend("bf16_only", torch_ref.fused_experts))
    assert get_moe_backend("bf16_only").name == "bf16_only"
    with pytest.raises(ValueError, match="MoE backend 'bf16_only' has no FP8 experts"):
        get_moe_backend("bf16_only", fp8_weights=True)
    if HAS_TRITON and (ON_CUDA or INTERPRET):
        from flotilla.kernels.moe import triton_experts

        assert get_moe_backend("triton", fp8_weights=True).fused_experts_fp8 is triton_experts.fused_experts_fp8


# ---- the triton kernel ----

TRITON_CASES = [
    # tokens, hidden, inter, experts, top_k, block, dtype, tiles (block_m, block_n, block_k)
    (1, 64, 32, 4, 2, (32, 32), torch.float32, (16, 16, 32)),  # one decode token: two blocks of one row
    (7, 96, 48, 6, 3, (32, 32), torch.float32, (16, 32, 16)),  # I 1.5 blocks; K steps of half a block
    (20, 64, 64, 8, 2, (16, 32), torch.float32, (16, 64, 32)),  # bn != bk: a tile spans 4 scale rows
    (40, 48, 40, 3, 2, (32, 16), torch.float32, (16, 16, 16)),  # experts with several blocks of rows
    (9, 80, 40, 5, 1, (16, 16), torch.float16, (32, 16, 16)),  # half, top-1, partial last blocks everywhere
    (0, 64, 32, 4, 2, (32, 32), torch.float32, (16, 16, 32)),  # an empty batch
    (4, 64, 48, 6, 3, (32, 16), torch.float32, (16, 16, 16)),  # 12 slots, each its own block, combined in the down pass
    (3, 80, 40, 5, 2, (16, 16), torch.float16, (16, 32, 16)),  # the same in half precision, partial blocks
]
"""Half precision is float16 here: the CPU interpreter converts float32 to bfloat16 by truncation, not rounding
(half of the values one bf16 step off), so bf16 is left to the GPU tests."""


def _triton_run(tiles: tuple[int, int, int], module=None):
    from flotilla.kernels.moe import triton_experts

    module = module or triton_experts
    block_m, block_n, block_k = tiles
    return lambda *args: module.fused_experts_fp8(*args, block_m=block_m, block_n=block_n, block_k=block_k)


@needs_triton
@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k", "block", "dtype", "tiles"), TRITON_CASES)
def test_triton_fp8_experts_match_the_w8a8_reference(tokens, hidden, inter, experts, top_k, block, dtype, tiles):
    case = _fp8_case(tokens, hidden, inter, experts, top_k, block, dtype, seed=tokens + hidden)
    _check_against_references(_triton_run(tiles), case, block)


@needs_triton
@pytest.mark.parametrize("tokens", [2, 4])
def test_slot_blocks_and_the_combine_in_the_down_pass_give_the_sorted_two_launch_result(tokens) -> None:
    """Up to SLOT_BLOCKS_MAX_TOKENS tokens every slot is a block of its own (no sorting launch) and the down pass
    sums each token's rows itself (arrival counters, kernels/arrivals.py). Both are the sorted path with the separate
    sum to float32 rounding, and leave the counters at zero."""
    from flotilla.kernels.arrivals import arrival_counters
    from flotilla.kernels.moe import triton_experts

    block = (16, 32)
    case = _fp8_case(tokens, 64, 48, 6, 3, block, torch.float32, seed=tokens)
    slots = triton_experts.slot_blocks(case[6], 16)
    assert slots is not None and slots.block_experts.tolist() == case[6].flatten().tolist()
    assert slots.sorted_slots.view(-1, 16)[:, 0].tolist() == list(range(tokens * 3))
    assert (slots.sorted_slots.view(-1, 16)[:, 1:] == tokens * 3).all() and slots.num_padded.item() == tokens * 48
    def run(x, w13, s13, w2, s2, weights, ids, *_, combine=True):
        return triton_experts._two_passes(x, w13, w2, weights, ids, 16, 16, 32, (s13, s2), block, combine=combine)

    got = run(*case)
    separate_sum = run(*case, combine=False)
    # the sum in the down pass against the separate one (same layout): float32 summation order at most
    torch.testing.assert_close(got, separate_sum, atol=1e-6 * separate_sum.abs().max().item(), rtol=1e-6)
    _check_against_references(lambda *_: got, case, block)  # (the run above, not a third one)
    assert not arrival_counters(case[0].device).any()


MUTATIONS = {
    "up rows scaled by gate's block scales": ("(UP_SCALE_ROW + offs_n // BLOCK_SCALE_N)", "(offs_n // BLOCK_SCALE_N)"),
    "weight scale row by block_k": ("(offs_n // BLOCK_SCALE_N) * stride_wsn", "(offs_n // BLOCK_SCALE_K) * stride_wsn"),
    "K group one step behind": ("group = (k_tile * BLOCK_K) // BLOCK_SCALE_K", "group = (k_tile * BLOCK_K) // BLOCK_SCALE_K // 2"),
    "activation scale dropped": ("acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]", "acc += tl.dot(a, w) * w_scale[None, :]"),
}  # fmt: skip


@pytest.fixture(scope="module")
def mutation_case():
    """(case, block) the mutated kernels are checked on, which the real kernel passes (checked here, once)."""
    block = (16, 32)
    case = _fp8_case(12, 64, 32, 4, 2, block, torch.float32, seed=5)
    _check_against_references(_triton_run((16, 32, 32)), case, block)
    return case, block


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # activations without their scales are huge
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_mutated_kernel_fails_the_check(mutation: str, tmp_path: Path, mutation_case) -> None:
    """The check above is sharp enough: the kernel with one scale index (or factor) wrong fails it."""
    from flotilla.kernels.moe import triton_experts

    case, block = mutation_case  # (the real kernel passes this case)
    old, new = MUTATIONS[mutation]
    source = Path(triton_experts.__file__).read_text()
    assert source.count(old) == 1
    path = tmp_path / "mutated_triton_experts.py"  # triton.jit reads the kernel's source from its file
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("mutated_triton_experts", path)
    mutated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutated)
    with pytest.raises(AssertionError):
        _check_against_references(_triton_run((16, 32, 32), mutated), case, block)


@gpu_test
@pytest.mark.parametrize("tokens", [1, 3, 16, 128, 2048])
def test_gpu_triton_fp8_experts_at_deepseek_v3_sizes(tokens: int) -> None:
    """H 7168, I 2048, 128x128 blocks, top-8 of 256 experts with only 16 of them routed to (a few active, most
    idle: their blocks are skipped), bf16 activations."""
    from flotilla.kernels.moe import triton_experts

    block, experts, used = (128, 128), 256, 16
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    w13 = torch.zeros(experts, 2 * 2048, 7168, device=DEVICE, dtype=FP8_DTYPE)  # the idle experts' stay zero
    w2 = torch.zeros(experts, 7168, 2048, device=DEVICE, dtype=FP8_DTYPE)
    w13[:used] = torch.randn(used, 2 * 2048, 7168, device=DEVICE, generator=gen).mul_(7168**-0.5).to(FP8_DTYPE)
    w2[:used] = torch.randn(used, 7168, 2048, device=DEVICE, generator=gen).mul_(2048**-0.5).to(FP8_DTYPE)
    s13 = torch.rand(experts, 32, 56, device=DEVICE, generator=gen) + 0.5
    s2 = torch.rand(experts, 56, 16, device=DEVICE, generator=gen) + 0.5
    x = torch.randn(tokens, 7168, device=DEVICE, generator=gen).bfloat16()
    logits = torch.full((tokens, experts), -1e4, device=DEVICE)
    logits[:, :used] = torch.randn(tokens, used, device=DEVICE, generator=gen)
    weights, ids = select_experts(logits, 8, True)
    case = (x, w13, s13, w2, s2, weights, ids)
    got = triton_experts.fused_experts_fp8(*case, block)
    # the reference rounds where the kernel rounds (bf16), so pass 2 quantizes the same bf16 activations
    want = torch_ref.fused_experts_fp8_w8a8(*case, block).float()
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


# ---- the tiny FP8 DeepSeek-V3 with FP8 experts ----


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_deepseek_fp8_pair(tmp_path_factory.mktemp("tiny_deepseek_fp8_experts"))


def _load(model_dir: Path, **kwargs: object) -> torch.nn.Module:
    kwargs = {"attention_backend": "torch", "fp8_backend": "torch", **kwargs}
    return load_model(model_dir, progress=False, model_kwargs=kwargs).module


def _greedy(model: torch.nn.Module, steps: int = 12) -> tuple[list[list[int]], torch.Tensor]:
    """Two sequences decoded greedily in one batch: their tokens and every step's last-position logits."""
    runner = PagedRunner(model, block_size=4)
    batch = [(0, random_tokens(11, seed=1)), (1, random_tokens(6, seed=2))]
    tokens: list[list[int]] = [[], []]
    logits = []
    for _ in range(steps):
        last = torch.stack([rows[-1] for rows in runner.step(batch)])
        logits.append(last)
        batch = [(i, [int(t)]) for i, t in enumerate(last.argmax(dim=-1))]
        for i, t in enumerate(last.argmax(dim=-1).tolist()):
            tokens[i].append(t)
    return tokens, torch.stack(logits)


def test_fp8_experts_stay_e4m3_and_decode_like_the_dequantized_model(fp8_dirs: tuple[Path, Path]) -> None:
    fp8_dir, float_dir = fp8_dirs
    model = _load(fp8_dir, moe_backend="torch")
    checkpoint = load_file(str(fp8_dir / "model.safetensors"))
    moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(moe_layers) == 2
    for i, moe in enumerate(moe_layers, start=1):
        experts = moe.experts
        assert isinstance(experts, Fp8StackedExperts)
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
        # half of bf16's bytes, scales included (one float32 per 32x32 block)
        weights = (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv)
        numel = experts.gate_up_proj.numel() + experts.down_proj.numel()
        assert sum(p.numel() * p.element_size() for p in weights) <= 0.51 * 2 * numel
        # loaded as the checkpoint holds them: expert 5's up rows and scales, its down_proj
        p = f"model.layers.{i}.mlp.experts.5"
        assert torch.equal(experts.gate_up_proj[5, 32:].float(), checkpoint[f"{p}.up_proj.weight"].float())
        assert torch.equal(experts.gate_up_proj_scale_inv[5, 1:], checkpoint[f"{p}.up_proj.weight_scale_inv"])
        assert torch.equal(experts.down_proj_scale_inv[5], checkpoint[f"{p}.down_proj.weight_scale_inv"])
    # the torch path dequantizes per call into the model dtype: the model whose experts were dequantized at load,
    # to the bit; and the dequantized checkpoint's float model (other layers' float linears) to rounding
    tokens, logits = _greedy(model)
    at_load = _load(fp8_dir, moe_backend="torch", fp8_experts=False)
    assert at_load.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    want_tokens, want_logits = _greedy(at_load)
    assert tokens == want_tokens and torch.equal(logits, want_logits)
    float_tokens, float_logits = _greedy(_load(float_dir))
    assert tokens == float_tokens
    torch.testing.assert_close(logits, float_logits, atol=1e-4, rtol=0)


def test_a_backend_without_fp8_experts_dequantizes_them_at_load_unless_fp8_is_asked_for(
        fp8_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(moe_kernels._BACKENDS, "bf16_only", MoEBackend("bf16_only", torch_ref.fused_experts))
    model = _load(fp8_dirs[0], moe_backend="bf16_only")
    assert not model.fp8_experts and model.model.layers[2].mlp.experts.down_proj.dtype == torch.float32
    with pytest.raises(ValueError, match="MoE backend 'bf16_only' has no FP8 experts"):
        DeepseekV3ForCausalLM(load_hf_config(fp8_dirs[0]), moe_backend="bf16_only", fp8_experts=True)


@needs_triton
def test_fp8_experts_on_the_triton_kernel_match_the_w8a8_reference_model(fp8_dirs: tuple[Path, Path]) -> None:
    """The tiny model with its experts on the triton FP8 kernel gives the logits of the same model with its
    experts on the W8A8 torch reference, and stays near the weight-only (dequantized) path: the random tiny
    model is sensitive to the activations' e4m3 rounding (its logits move by 16% of their norm with the experts'
    activations quantized, by 25% with the FP8 linears' instead), so that bound is loose."""
    fp8_dir, _ = fp8_dirs
    triton_model = _load(fp8_dir, moe_backend="triton")
    assert triton_model.moe_backend_name == "triton"
    reference = _load(fp8_dir, moe_backend="torch")
    w8a8 = MoEBackend("w8a8_reference", torch_ref.fused_experts, torch_ref.fused_experts_fp8_w8a8)
    for layer in reference.modules():
        if isinstance(layer, Fp8StackedExperts):
            layer.fp8_backend = w8a8
    tokens = random_tokens(9, seed=4)
    got = PagedRunner(triton_model).step([(0, tokens), (1, tokens[:1])])
    want = PagedRunner(reference).step([(0, tokens), (1, tokens[:1])])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    weight_only = PagedRunner(_load(fp8_dir, moe_backend="torch")).step([(0, tokens)])[0]
    assert (got[0] - weight_only).norm() < 0.25 * weight_only.norm()


def test_fp8_experts_dummy_weights(fp8_dirs: tuple[Path, Path]) -> None:
    dummy = load_model(fp8_dirs[0], dtype="bfloat16", load_format="dummy", progress=False).module
    experts = dummy.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_proj.float().abs().max() == 448
    assert experts.down_proj_scale_inv.dtype == torch.float32 and (experts.down_proj_scale_inv > 0).all()
    assert torch.isfinite(PagedRunner(dummy).step([(0, random_tokens(6, seed=3))])[0]).all()


# ---- tensor and expert parallelism ----


def test_a_tensor_parallel_rank_keeps_its_blocks_of_every_expert(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Rank 1 of 2 of the tiny FP8 model in 16x16 blocks: rows 16-31 of each expert's gate and up (block row 1
    of each), columns 16-31 of its down_proj (block column 1). (tests/test_deepseek_tp.py decodes it on 2
    ranks.)"""
    fp8_dir, _ = write_tiny_deepseek_fp8_pair(tmp_path, block=(16, 16))
    weights = load_file(str(fp8_dir / "model.safetensors"))
    monkeypatch.setattr(parallel, "_TP", parallel.TPGroup(rank=1, size=2))
    model = DeepseekV3ForCausalLM(load_hf_config(fp8_dir), fp8_backend="torch", moe_backend="torch")
    assert model.load_weights(weights.items()) == set(dict(model.named_parameters()))
    experts, p = model.model.layers[2].mlp.experts, "model.layers.2.mlp.experts"
    assert experts.gate_up_proj.shape == (8, 32, 64) and experts.gate_up_proj_scale_inv.shape == (8, 2, 4)
    for e in (0, 7):
        gate, up, down = (f"{p}.{e}.{proj}_proj.weight" for proj in ("gate", "up", "down"))
        assert torch.equal(experts.gate_up_proj[e].float(), torch.cat([weights[gate][16:], weights[up][16:]]).float())
        assert torch.equal(experts.gate_up_proj_scale_inv[e],
                           torch.cat([weights[f"{gate}_scale_inv"][1:], weights[f"{up}_scale_inv"][1:]]))
        assert torch.equal(experts.down_proj[e].float(), weights[down][:, 16:].float())
        assert torch.equal(experts.down_proj_scale_inv[e], weights[f"{down}_scale_inv"][:, 1:])


def test_an_off_block_expert_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's FP8 experts over 32 ranks: 2048 / 32 = 64 intermediate rows, half a 128-block."""
    monkeypatch.setattr(parallel, "_TP", parallel.TPGroup(rank=3, size=32))
    config = parse_hf_config({**HUB_V3, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                              "quantization_config": FP8_QUANT})  # fmt: skip
    with torch.device("meta"), pytest.raises(ValueError, match=r"the routed experts: tensor-parallel rank 3 of 32 "
                                                               r"would keep 64 of each expert's 2048 gate / up rows"):
        DeepseekV3ForCausalLM(config)
    monkeypatch.setattr(parallel, "_TP", parallel.TPGroup(rank=7, size=8))  # 256 rows: two blocks
    with torch.device("meta"):
        experts = DeepseekV3ForCausalLM(config).model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (256, 512, 7168) and experts.gate_up_proj.dtype == FP8_DTYPE
    assert experts.gate_up_proj_scale_inv.shape == (256, 4, 56) and experts.down_proj_scale_inv.shape == (256, 56, 2)


def test_an_expert_parallel_rank_keeps_only_its_experts_in_fp8(fp8_dirs: tuple[Path, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Rank 1 of 2 (the group faked: loading runs no collective) holds experts 4-7 whole, e4m3 as the checkpoint
    stores them, with their scales; nothing of experts 0-3 is read. (tests/test_dp_ep.py decodes on 2 ranks.)"""
    fp8_dir, _ = fp8_dirs
    monkeypatch.setattr(parallel, "_EP", parallel.EPGroup(rank=1, size=2, group=None))
    monkeypatch.setattr(qwen3_moe, "ExpertParallelExperts", lambda placement, group, backend: backend)
    model = DeepseekV3ForCausalLM(load_hf_config(fp8_dir), attention_backend="torch", fp8_backend="torch")
    weights = load_file(str(fp8_dir / "model.safetensors"))
    keep = model.checkpoint_filter()
    assert not any(keep(n) for n in weights if ".mlp.experts.3." in n) and keep("model.layers.1.mlp.experts.4."
                                                                                  "down_proj.weight_scale_inv")
    assert model.load_weights(weights.items()) == set(dict(model.named_parameters()))
    experts, p = model.model.layers[1].mlp.experts, "model.layers.1.mlp.experts"
    assert experts.placement.local_experts == range(4, 8) and experts.gate_up_proj.shape == (4, 64, 64)
    assert experts.gate_up_proj.dtype == FP8_DTYPE
    assert torch.equal(experts.down_proj[2].float(), weights[f"{p}.6.down_proj.weight"].float())
    assert torch.equal(experts.gate_up_proj_scale_inv[0, :1], weights[f"{p}.4.gate_proj.weight_scale_inv"])
    # the dispatch layer gets a backend whose fused_experts runs this layer's FP8 weights with their scales
    dispatch_backend = experts.ep_experts
    hidden = torch.randn(3, 64)
    ids = torch.tensor([[0], [3], [1]], dtype=torch.int32)
    ones = torch.ones(3, 1)
    want = torch_ref.fused_experts_fp8(hidden, experts.gate_up_proj, experts.gate_up_proj_scale_inv,
                                       experts.down_proj, experts.down_proj_scale_inv, ones, ids, (32, 32))  # fmt: skip
    assert torch.equal(dispatch_backend.fused_experts(hidden, experts.gate_up_proj, experts.down_proj, ones, ids), want)


@gpu_test
@pytest.mark.parametrize("tokens", [1, 4])
def test_gpu_slot_blocks_with_the_down_pass_combine_replay_in_a_cuda_graph(tokens: int) -> None:
    """The batch-1 path (every slot its own block, the combine inside the down pass) at DeepSeek-V3's expert sizes:
    over several replays of one CUDA graph with new activations and routes, each output is the eager one bit for
    bit (the arrival counters are back at zero after every replay)."""
    from flotilla.kernels.arrivals import arrival_counters
    from flotilla.kernels.moe import triton_experts

    block, experts = (128, 128), 16
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    w13 = torch.randn(experts, 2 * 2048, 7168, device=DEVICE, generator=gen).mul_(7168**-0.5).to(FP8_DTYPE)
    w2 = torch.randn(experts, 7168, 2048, device=DEVICE, generator=gen).mul_(2048**-0.5).to(FP8_DTYPE)
    s13 = torch.rand(experts, 32, 56, device=DEVICE, generator=gen) + 0.5
    s2 = torch.rand(experts, 56, 16, device=DEVICE, generator=gen) + 0.5
    inputs = []
    for _ in range(3):
        weights, ids = select_experts(torch.randn(tokens, experts, device=DEVICE, generator=gen), 8, True)
        inputs.append((torch.randn(tokens, 7168, device=DEVICE, generator=gen).bfloat16(), weights, ids))
    want = [triton_experts.fused_experts_fp8(x, w13, s13, w2, s2, wt, ids, block) for x, wt, ids in inputs]
    static = [t.clone() for t in inputs[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_experts.fused_experts_fp8(static[0], w13, s13, w2, s2, static[1], static[2], block)
    for (x, wt, ids), w in [*zip(inputs, want), *zip(inputs, want)]:
        for dst, src in zip(static, (x, wt, ids)):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, w)
    assert not arrival_counters(DEVICE).any()
