"""An image-text-to-text model (Qwen2-VL, tiny config) loaded with hf_rtp.AutoModelForImageTextToText.

The language model and head rotate, the vision tower stays whole (plan "qwen2_vl"). Against vanilla in
the same processes, float64: logits and every gradient of a forward with an image and labels (each rank
its own image and text, vanilla on both), and greedy `generate` with the image.
"""

import os

import torch
from support.compare import GRAD_ATOL, GRAD_RTOL
from support.spawn import run_on_ranks

IMAGE, START, END = 97, 95, 96
GRID = torch.tensor([[1, 4, 4]])  # 16 patches of 2x2x2 pixels in 3 channels, merged 2x2: 4 image tokens


def make_qwen2_vl(path) -> str:
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=IMAGE,
        video_token_id=98,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return str(path)


def _inputs(rank):
    gen = torch.Generator().manual_seed(10 + rank)
    text = torch.randint(3, 90, (1, 7), generator=gen)
    ids = torch.cat([torch.tensor([[START] + [IMAGE] * 4 + [END]]), text], dim=1)
    # what the processor returns beside the ids: the image's pixels in patches, and which tokens are image tokens
    return ids, dict(
        pixel_values=torch.randn(16, 24, generator=gen, dtype=torch.float64),
        image_grid_thw=GRID,
        mm_token_type_ids=(ids == IMAGE).to(torch.int64),
    )


def _check(ckpt, world):
    from transformers import AutoModelForImageTextToText

    import hf_rtp

    rank = int(os.environ["RANK"])
    kw = dict(dtype=torch.float64, attn_implementation="eager")
    vanilla = AutoModelForImageTextToText.from_pretrained(ckpt, **kw)
    model = hf_rtp.AutoModelForImageTextToText.from_pretrained(ckpt, **kw)
    state = hf_rtp.state_of(model)
    rotated = state.resolution.rotated_params
    logits = []
    for r in range(world):  # vanilla on every rank's sample: its mean loss is DDP's
        ids, pixels = _inputs(r)
        out = vanilla(input_ids=ids, **pixels, labels=ids)
        (out.loss / world).backward()
        logits.append(out.logits.detach())
    ids, pixels = _inputs(rank)
    with torch.no_grad():
        mine = model.eval()(input_ids=ids, **pixels).logits
    model.train()(input_ids=ids, **pixels, labels=ids).loss.backward()
    hf_rtp.sync_grads(model)
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        ref = vanilla.get_parameter(name).grad
        worst = max(worst, ((grad - ref).abs() - GRAD_RTOL * ref.abs()).max().item())
    model.eval(), vanilla.eval()
    generated = model.generate(input_ids=ids, **pixels, max_new_tokens=5, do_sample=False)
    expected = vanilla.generate(input_ids=ids, **pixels, max_new_tokens=5, do_sample=False)
    return (
        (mine - logits[rank]).abs().max().item(),
        worst,
        torch.equal(generated, expected),
        generated.shape[1],
        sorted(rotated),
        [n for n, _ in model.named_parameters() if n.startswith("model.visual.")],
    )


def test_qwen2_vl_language_model_rotated_vision_whole_matches_vanilla(tmp_path):
    ckpt = make_qwen2_vl(tmp_path / "ckpt")
    for logits, worst, same_generation, length, rotated, visual in run_on_ranks(_check, 2, ckpt, 2):
        assert "lm_head.weight" in rotated and "model.language_model.embed_tokens.weight" in rotated
        assert "model.language_model.layers.1.mlp.down_proj.weight" in rotated
        assert visual and not set(visual) & set(rotated)  # the vision tower: whole
        assert logits < 1e-12, logits
        assert worst < GRAD_ATOL, worst
        assert same_generation and length == 13 + 5
