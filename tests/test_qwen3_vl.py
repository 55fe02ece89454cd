"""Qwen3-VL (dense and MoE) against transformers on tiny random checkpoints with identical weights (fp32): the vision
tower's tokens and DeepStack features, M-RoPE positions, prefill logits with images through the paged cache, paged
decode after them, prefill chunks that cut through an image, image prompts batched with text sequences, text-only
prompts, the released checkpoints' layout, and the fused RoPE kernels on the per-token M-RoPE table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers_tiny_models import (
    ATOL,
    PagedRunner,
    check_greedy_matches_generate,
    check_prefill_then_paged_decode,
    load_flotilla_model,
    random_tokens,
)
from helpers_vl import (
    IMAGE,
    MERGE,
    TEXT_VOCAB,
    VISION_START,
    hf_inputs,
    hf_vl_logits,
    load_hf_vl_model,
    prompt,
    random_pixels,
    write_tiny_qwen3_vl_model,
)
from safetensors.torch import load_file, save_file

from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.qwen3_vl import Qwen3VLForConditionalGeneration, mrope_positions


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def vl(request, tmp_path_factory) -> SimpleNamespace:
    path = write_tiny_qwen3_vl_model(tmp_path_factory.mktemp("qwen3_vl") / "m", moe=request.param)
    return SimpleNamespace(path=path, moe=request.param, model=load_flotilla_model(path), hf=load_hf_vl_model(path))


def text(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, vocab=TEXT_VOCAB)


@torch.inference_mode()
def image_inputs(model, token_ids: list[int], grids: list[tuple[int, int, int]], pixels: torch.Tensor):
    """What the engine hands a prompt's steps: the images' tokens and DeepStack features, the 3-row positions and
    the rope delta."""
    embeds, deepstack = model.encode_images(pixels, torch.tensor(grids))
    positions, delta = mrope_positions(token_ids, grids, MERGE, IMAGE, VISION_START)
    return embeds, deepstack, torch.from_numpy(positions), delta


def chunk_kwargs(token_ids: list[int], start: int, end: int, embeds, deepstack, positions, row: int = 0) -> dict:
    """forward's keyword arguments for tokens [start, end) of one sequence whose first token is row `row` of the
    step: its image rows, their slice of the image tokens and DeepStack features, its positions."""
    image_rows = [i for i, t in enumerate(token_ids) if t == IMAGE]
    mine = [k for k, i in enumerate(image_rows) if start <= i < end]
    chosen = torch.tensor(mine, dtype=torch.int64)
    return dict(mm_index=torch.tensor([image_rows[k] - start + row for k in mine], dtype=torch.int64),
                mm_embeds=embeds[chosen], deepstack=deepstack[:, chosen], mrope_positions=positions[:, start:end])


# ---- the vision tower and positions -----------------------------------------------------------------------------


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 4, 6), (1, 8, 4)], [(1, 8, 4), (2, 4, 4), (1, 4, 6)]],
                         ids=["one", "two", "three_with_two_frames"])
def test_encode_images_equals_transformers_image_features(vl, grids):
    pixels = random_pixels(grids, seed=len(grids))
    with torch.inference_mode():
        embeds, deepstack = vl.model.encode_images(pixels, torch.tensor(grids))
        ref = vl.hf.model.get_image_features(pixels, torch.tensor(grids))
    tokens = sum(t * h * w for t, h, w in grids) // MERGE**2
    assert embeds.shape == (tokens, 64)
    assert deepstack.shape == (1 if vl.moe else 2, tokens, 64)
    torch.testing.assert_close(embeds, torch.cat(ref.pooler_output), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(deepstack, torch.stack([torch.cat(f) for f in ref.deepstack_features]), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("parts", [
    [text(9, 1)],
    [text(5, 1), (1, 8, 4), text(4, 2)],
    [text(3, 1), (1, 4, 6), text(2, 2), (1, 8, 4), text(5, 3)],
    [text(2, 1), (2, 4, 6), (1, 4, 4)],  # two frames; an image right after another; nothing after the last
], ids=["text_only", "one_image", "two_images", "adjacent_images"])
def test_mrope_positions_equal_transformers_get_rope_index(vl, parts):
    ids = prompt(*parts)
    grids = [p for p in parts if isinstance(p, tuple)]
    positions, delta = mrope_positions(ids, grids, MERGE, IMAGE, VISION_START)
    ref, ref_delta = vl.hf.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == IMAGE).int(),
                                                torch.tensor(grids) if grids else None)
    assert positions.shape == (3, len(ids))
    assert positions.tolist() == ref[:, 0].tolist()
    assert delta == int(ref_delta)
    assert (delta < 0) == bool(grids)


def test_mrope_positions_refuse_placeholders_that_do_not_match_the_grids():
    ids = prompt(text(3, 1), (1, 4, 4), text(2, 2))
    with pytest.raises(ValueError, match=r"grid \(1, 4, 6\)\) needs exactly 6 image tokens at 4"):
        mrope_positions(ids, [(1, 4, 6)], MERGE, IMAGE, VISION_START)
    with pytest.raises(ValueError, match="placeholders for 1 image"):
        mrope_positions(ids, [(1, 4, 4), (1, 4, 4)], MERGE, IMAGE, VISION_START)
    with pytest.raises(ValueError, match="beyond its 0 image"):
        mrope_positions(ids, [], MERGE, IMAGE, VISION_START)
    with pytest.raises(ValueError, match="do not follow a vision-start token"):
        mrope_positions([5, IMAGE, IMAGE, IMAGE, IMAGE], [(1, 4, 4)], MERGE, IMAGE, VISION_START)


# ---- the multimodal step ----------------------------------------------------------------------------------------


def test_prefill_with_images_then_paged_decode_match_transformers(vl):
    grids = [(1, 4, 6), (1, 8, 4)]
    pixels = random_pixels(grids, seed=1)
    ids = prompt(text(5, 1), grids[0], text(3, 2), grids[1], text(4, 3))
    embeds, deepstack, positions, delta = image_inputs(vl.model, ids, grids, pixels)
    runner = PagedRunner(vl.model, block_size=4)
    prefill = runner.step([(0, ids)], **chunk_kwargs(ids, 0, len(ids), embeds, deepstack, positions))[0]
    tokens, decode = list(ids), []
    for _ in range(16):  # after the prompt, every component's position is the token's index + delta
        tokens.append(int((decode[-1] if decode else prefill[-1]).argmax()))
        decode.append(runner.step([(0, [tokens[-1]])], positions=torch.tensor([len(tokens) - 1 + delta]))[0][0])
    reference = hf_vl_logits(vl.hf, tokens, pixels, grids)
    torch.testing.assert_close(prefill, reference[:len(ids)], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(decode), reference[len(ids):], atol=ATOL, rtol=0)
    with torch.inference_mode():
        generated = vl.hf.generate(**hf_inputs(ids, pixels, grids), max_new_tokens=16, min_new_tokens=16,
                                   do_sample=False)  # fmt: skip
    assert tokens[len(ids):] == generated[0, len(ids):].tolist()
    # the images reach the logits through each of the three inputs
    kwargs = chunk_kwargs(ids, 0, len(ids), embeds, deepstack, positions)
    for changed in ({"deepstack": None}, {"mrope_positions": None}, {"mm_embeds": None, "deepstack": None}):
        other = PagedRunner(vl.model, block_size=4).step([(0, ids)], **{**kwargs, **changed})[0]
        assert (other - prefill).abs().max() > 1e-2, changed


def test_a_prefill_split_inside_an_image_equals_it_in_one_piece(vl):
    grids = [(1, 8, 4)]
    pixels = random_pixels(grids, seed=2)
    ids = prompt(text(5, 4), grids[0], text(4, 5))  # image tokens at rows 6 ... 13
    embeds, deepstack, positions, _ = image_inputs(vl.model, ids, grids, pixels)
    whole = PagedRunner(vl.model, block_size=4).step(
        [(0, ids)], **chunk_kwargs(ids, 0, len(ids), embeds, deepstack, positions))[0]
    runner = PagedRunner(vl.model, block_size=4, seed=5)
    # 3 image tokens | only image tokens | the last image token and the text after it
    parts = [runner.step([(0, ids[a:b])], **chunk_kwargs(ids, a, b, embeds, deepstack, positions))[0]
             for a, b in ((0, 9), (9, 13), (13, len(ids)))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, hf_vl_logits(vl.hf, ids, pixels, grids), atol=ATOL, rtol=0)


def test_an_image_prompt_batched_with_text_sequences_matches_transformers(vl):
    """Image rows are rows of the whole step (after another sequence's), and text rows in an M-RoPE step carry
    their position in all three rows."""
    grids = [(1, 4, 6)]
    pixels = random_pixels(grids, seed=3)
    image_ids = prompt(text(4, 6), grids[0], text(3, 7))
    text_a, text_c = text(7, 8), text(6, 9)
    embeds, deepstack, positions, delta = image_inputs(vl.model, image_ids, grids, pixels)
    runner = PagedRunner(vl.model, block_size=4, seed=6)
    runner.step([(0, text_a)])
    a_next = 11
    rows = torch.cat((torch.full((3, 1), len(text_a)), positions, torch.arange(len(text_c)).expand(3, -1)), dim=1)
    kwargs = chunk_kwargs(image_ids, 0, len(image_ids), embeds, deepstack, positions, row=1)
    a, b, c = runner.step([(0, [a_next]), (1, image_ids), (2, text_c)], **{**kwargs, "mrope_positions": rows})
    torch.testing.assert_close(a[0], hf_vl_logits(vl.hf, text_a + [a_next], None, [])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(b, hf_vl_logits(vl.hf, image_ids, pixels, grids), atol=ATOL, rtol=0)
    torch.testing.assert_close(c, hf_vl_logits(vl.hf, text_c, None, []), atol=ATOL, rtol=0)
    # a plain decode step for all three (1-D positions; the image prompt's shifted by its delta)
    steps = [int(x[-1].argmax()) for x in (a, b, c)]
    lens = [len(text_a) + 1, len(image_ids), len(text_c)]
    out = runner.step([(i, [t]) for i, t in enumerate(steps)], positions=torch.tensor(
        [lens[0], lens[1] + delta, lens[2]]))
    torch.testing.assert_close(out[1][0], hf_vl_logits(vl.hf, image_ids + [steps[1]], pixels, grids)[-1], atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(out[2][0], hf_vl_logits(vl.hf, text_c + [steps[2]], None, [])[-1], atol=ATOL, rtol=0)


def test_text_only_prompts_match_transformers(vl):
    check_prefill_then_paged_decode(vl.model, vl.hf)
    check_greedy_matches_generate(vl.model, vl.hf, num_tokens=16)


# ---- checkpoints ------------------------------------------------------------------------------------------------


def test_the_config_keeps_mrope_the_vision_tower_and_the_outer_lm_head_tie(vl):
    config = load_hf_config(vl.path)
    assert config.mrope_section == (6, 5, 5) and config.mrope_interleaved
    vision = config.vision
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (2 if vl.moe else 3, 32, 2,
                                                                                             64)
    assert vision.deepstack_visual_indexes == ((1,) if vl.moe else (0, 2))
    assert (vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id) == (300, 302, 303)
    raw = json.loads((vl.path / "config.json").read_text())
    # (transformers writes the MoE text_config's own default tie_word_embeddings=True: the outer False wins)
    assert not config.tie_word_embeddings and vl.model.lm_head is not None
    assert raw["text_config"].get("tie_word_embeddings", False) == vl.moe
    refused = {**raw, "text_config": {**raw["text_config"], "rope_parameters": {
        **raw["text_config"]["rope_parameters"], "mrope_interleaved": False}}}
    with pytest.raises(ValueError, match="interleaved"):
        Qwen3VLForConditionalGeneration(parse_hf_config(refused), attention_backend="torch")


def test_every_parameter_comes_from_the_checkpoint_in_either_expert_layout(vl, tmp_path):
    weights = load_file(str(vl.path / "model.safetensors"))
    params = dict(vl.model.named_parameters())
    assert any(name.startswith("visual.") for name in params)
    fresh = type(vl.model)(vl.model.config, attention_backend="torch")
    loaded = fresh.load_weights((k, v) for k, v in weights.items() if k != "model.visual.merger.linear_fc2.bias")
    assert set(params) - loaded == {"visual.merger.linear_fc2.bias"}
    if not vl.moe:
        return
    # the Hub's folders hold the stacked experts transposed: [E, H, 2I] and [E, I, H]
    hub = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
           for k, v in weights.items()}
    assert hub["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 96)
    (tmp_path / "config.json").write_text((vl.path / "config.json").read_text())
    save_file(hub, str(tmp_path / "model.safetensors"))
    from_hub = dict(load_flotilla_model(tmp_path).named_parameters())
    for name, param in params.items():
        assert torch.equal(from_hub[name], param), name


def test_the_fused_rope_kernels_read_the_per_token_mrope_table(vl):
    """(triton's norm + RoPE + KV-store kernels, under TRITON_INTERPRET on a CPU): the same logits as the torch ops."""
    pytest.importorskip("triton", reason="triton is not installed")
    fused = type(vl.model)(vl.model.config, attention_backend="torch", fused_ops="triton")
    fused.load_weights(load_file(str(vl.path / "model.safetensors")).items())
    assert fused.fused_ops_name == "triton"
    grids = [(1, 4, 6)]
    ids = prompt(text(3, 10), grids[0], text(2, 11))
    embeds, deepstack, positions, _ = image_inputs(vl.model, ids, grids, random_pixels(grids, seed=4))
    kwargs = chunk_kwargs(ids, 0, len(ids), embeds, deepstack, positions)
    want = PagedRunner(vl.model, block_size=4).step([(0, ids)], **kwargs)[0]
    torch.testing.assert_close(PagedRunner(fused.eval(), block_size=4).step([(0, ids)], **kwargs)[0], want, atol=1e-4,
                               rtol=0)


def test_the_vision_tower_loads_alone_from_the_checkpoint_and_encodes_as_the_whole_model(vl, tmp_path):
    """What a vision encoder of its own loads: only the `model.visual.` tensors; a text model has no tower to load."""
    from flotilla.models.loader import ModelLoadError, load_model
    from helpers_tiny_models import write_tiny_model

    tower = load_model(vl.path, dtype="float32", vision_only=True, progress=False).module
    assert {n.split(".")[0] for n, _ in tower.named_parameters()} == {"visual"}
    grids = [(1, 8, 4), (1, 4, 6)]
    pixels = random_pixels(grids, seed=3)
    with torch.inference_mode():
        for got, want in zip(tower.encode_images(pixels, torch.tensor(grids)),
                             vl.model.encode_images(pixels, torch.tensor(grids)), strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ModelLoadError, match="takes no images"):
        load_model(write_tiny_model(tmp_path / "text", "qwen3"), vision_only=True, progress=False)


def test_a_model_built_without_its_tower_reads_no_vision_tensor_and_refuses_to_encode(vl):
    from flotilla.models.loader import load_model

    model = load_model(vl.path, dtype="float32", model_kwargs={"vision_tower": False}, progress=False).module
    assert model.visual is None and not any(n.startswith("visual.") for n, _ in model.named_parameters())
    assert not model.checkpoint_filter()("model.visual.blocks.0.attn.qkv.weight")
    with pytest.raises(RuntimeError, match="built without its vision tower"):
        model.encode_images(random_pixels([(1, 4, 4)], seed=1), torch.tensor([(1, 4, 4)]))
    grids = [(1, 8, 4)]
    ids = prompt(text(5, 1), grids[0], text(3, 2))
    embeds, deepstack, positions, _ = image_inputs(vl.model, ids, grids, random_pixels(grids, seed=2))
    kwargs = chunk_kwargs(ids, 0, len(ids), embeds, deepstack, positions)
    torch.testing.assert_close(PagedRunner(model).step([(0, ids)], **kwargs)[0],
                               PagedRunner(vl.model).step([(0, ids)], **kwargs)[0], atol=0, rtol=0)
