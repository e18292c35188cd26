"""Tiled MLP (model/tiled_mlp.py) on vanilla transformers models in one process: the same outputs and gradients as the
whole MLP, no [tokens, intermediate] activation kept for backward, and what it refuses or leaves whole, by name."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from support.models import VOCAB, tiny_config
from torch import nn
from transformers import AutoModelForCausalLM

from hf_rtp.errors import SettingError
from hf_rtp.model import tiled_mlp
from hf_rtp.settings import Settings


def _pair(arch: str, **overrides):
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float64)
    return whole, copy.deepcopy(whole)


def _intermediates(model, ids) -> tuple[torch.Tensor, list[torch.Size]]:
    """The loss, and the shapes of what autograd saves for backward in the forward that has it."""
    shapes: list[torch.Size] = []

    def pack(t):
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    return loss, shapes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_tiles_give_the_whole_mlps_outputs_and_gradients_and_keep_no_intermediate(arch):
    whole, tiled = _pair(arch, resid_pdrop=0.0) if arch == "gpt2" else _pair(arch)
    assert tiled_mlp.install(tiled, 4) == 2  # both layers' MLPs
    wide = tiled.config.n_inner or 4 * tiled.config.n_embd if arch == "gpt2" else tiled.config.intermediate_size
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))  # 22 tokens: tiles of 4 and 2
    losses = []
    for model in (whole, tiled):
        loss, shapes = _intermediates(model.train(), ids)
        loss.backward()
        losses.append(loss)
        kept = [s for s in shapes if len(s) and s[-1] == wide and s.numel() >= 2 * 11 * wide]
        assert bool(kept) == (model is whole), (arch, kept)  # [2, 11, intermediate]: kept only by the whole MLP
    torch.testing.assert_close(losses[1], losses[0], atol=1e-13, rtol=0)
    for (name, p), q in zip(whole.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-13, rtol=1e-12, msg=name)


def test_without_gradients_and_below_the_threshold_it_is_the_whole_mlp():
    whole, tiled = _pair("llama")
    tiled_mlp.install(tiled, 8)
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(tiled(input_ids=ids).logits, whole(input_ids=ids).logits, atol=1e-13, rtol=0)
        mlp = tiled.model.layers[0].mlp
        x = torch.randn(2, 4, tiled.config.hidden_size, dtype=torch.float64)
        assert torch.equal(mlp(x), type(mlp).forward(mlp, x))  # 8 tokens: one tile, the plain forward


def test_auto_tiles_long_inputs_only_and_leaves_experts_whole_while_asked_tiling_refuses_them():
    _, llama = _pair("llama")
    assert tiled_mlp.install(llama, "auto") == 2
    mlp = llama.model.layers[0].mlp
    short = torch.randn(2, tiled_mlp.AUTO_FROM // 2, llama.config.hidden_size, dtype=torch.float64)
    assert torch.equal(mlp(short), type(mlp).forward(mlp, short))
    _, mixtral = _pair("mixtral")
    assert tiled_mlp.install(mixtral, "auto") == 0
    for setting in (True, 64):
        with pytest.raises(SettingError, match=r"model.layers.0.mlp \(MixtralSparseMoeBlock\) is not a token-wise"):
            tiled_mlp.install(copy.deepcopy(mixtral), setting)
    assert tiled_mlp.install(mixtral, False) == 0


def test_an_active_dropout_runs_the_mlp_whole_with_a_warning(caplog):
    whole, tiled = _pair("gpt2", resid_pdrop=0.5)
    tiled_mlp.install(tiled, 4)
    ids = torch.randint(0, VOCAB, (2, 11))
    outs = []
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        for model in (whole, tiled):
            torch.manual_seed(5)
            outs.append(model.train()(input_ids=ids).logits)
    assert torch.equal(outs[0], outs[1])  # vanilla's masks: the MLP ran whole
    assert caplog.text.count("tiled_mlp runs this MLP whole while its dropout is active") == 1


@pytest.mark.parametrize("bad", [0, -8, "yes", 2.5, None])
def test_a_tiled_mlp_setting_that_means_nothing_is_refused_by_name(bad):
    with pytest.raises(SettingError, match=r"tiled_mlp must be \"auto\", True, False or a positive number of tokens"):
        Settings.resolve(tiled_mlp=bad)


def _saved(model, ids) -> list[tuple[torch.Size, torch.dtype]]:
    saved: list[tuple[torch.Size, torch.dtype]] = []

    def pack(t):
        saved.append((t.shape, t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return saved


def test_tiled_norms_keep_no_float32_copy_of_a_bf16_models_tokens():
    """Llama's RMSNorm saves float32 copies of its bf16 input for backward (4 bytes a value beside the input's 2):
    tiled, a norm keeps its input's tiles and recomputes their copies, one tile at a time, in backward."""
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    tiled = copy.deepcopy(whole)
    tiled_mlp.install(tiled, 4)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    hidden = whole.config.hidden_size
    for model in (whole, tiled):
        copies = [
            s
            for s, d in _saved(model.train(), ids)
            if d == torch.float32 and len(s) and s[-1] == hidden and s.numel() >= 22 * hidden
        ]
        assert bool(copies) == (model is whole), copies  # [2, 11, hidden] in float32: the whole norms' only


def test_every_norm_outside_attention_is_tiled_and_gives_the_whole_norms_gradients():
    from transformers import Gemma3TextConfig, Qwen3Config

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=VOCAB)  # fmt: skip
    expected = {
        "qwen3": ["input_layernorm", "post_attention_layernorm"],  # not self_attn.q_norm, k_norm: a head's width
        "gemma3": [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ],
    }
    for arch, config in (("qwen3", Qwen3Config(**shape)), ("gemma3", Gemma3TextConfig(**shape))):
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        tiled = copy.deepcopy(whole)
        tiled_mlp.install(tiled, 4)
        norms = [n for n, m in tiled.named_modules() if "forward" in vars(m) and not n.endswith(".mlp")]
        per_layer = [f"model.layers.{i}.{name}" for i in range(2) for name in expected[arch]]
        assert sorted(norms) == sorted([*per_layer, "model.norm"]), (arch, norms)
        ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
        losses = []
        for model in (whole, tiled):
            loss = model.train()(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], atol=1e-13, rtol=0)
        for (name, p), q in zip(whole.named_parameters(), tiled.parameters(), strict=True):
            # Gemma's norms compute in float32 whatever the model's dtype (x.float(), weight.float()): their
            # weights' gradients, summed over tiles, round in float32 (2e-9 of 2e-2 here; a wrong tile is 1e-2)
            float32 = arch == "gemma3" and name.endswith("norm.weight")
            tolerance = dict(atol=1e-8, rtol=1e-6) if float32 else dict(atol=1e-13, rtol=1e-12)
            torch.testing.assert_close(q.grad, p.grad, **tolerance, msg=f"{arch} {name}")
        tiled_mlp.uninstall(tiled)
        assert not any("forward" in vars(m) for m in tiled.modules())


def test_an_mlp_calling_functional_dropout_runs_whole_in_training_with_a_warning(caplog):
    """Starcoder2's MLP draws its mask with F.dropout(p=self.residual_dropout) inside forward, no nn.Dropout child:
    tiled, each tile would draw its own mask. With p > 0 in training it runs whole (vanilla's one draw); with p = 0,
    or in eval, it tiles."""
    from transformers import Starcoder2Config

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB)  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    for p in (0.5, 0.0):
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(Starcoder2Config(**shape, residual_dropout=p), dtype=torch.float64)
        tiled = copy.deepcopy(whole)
        tiled_mlp.install(tiled, 4)
        outs = []
        with caplog.at_level(logging.WARNING, logger="hf_rtp"):
            caplog.clear()
            for model in (whole, tiled):
                torch.manual_seed(5)
                outs.append(model.train()(input_ids=ids).logits)
        warned = "tiled_mlp runs this MLP whole while its dropout is active" in caplog.text
        assert warned == (p > 0), p
        if p > 0:
            assert torch.equal(outs[0], outs[1])  # vanilla's masks: the MLP ran whole
        else:
            torch.testing.assert_close(outs[1], outs[0], atol=1e-13, rtol=0)
            mlp = tiled.model.layers[0].mlp
            assert not tiled_mlp._dropping(mlp)


def test_a_norm_over_channels_or_another_dimension_is_left_whole():
    """GOT-OCR2's vision neck normalizes [B, C, H, W] over C (data_format="channels_first"): tiling its rows would
    cut the wrong dimension. Only norms over one last dimension are tiled, and only inputs whose last dimension it
    is."""
    from transformers.models.got_ocr2.modeling_got_ocr2 import GotOcr2LayerNorm

    model = nn.Module()
    model.over_channels = GotOcr2LayerNorm(8, data_format="channels_first")
    model.over_last = GotOcr2LayerNorm(8, data_format="channels_last")
    model.over_two = nn.LayerNorm((4, 8))
    model.double()
    tiled_mlp.install(model, 4)
    assert [n for n, m in model.named_modules() if "forward" in vars(m)] == ["over_last"]
    image = torch.randn(2, 8, 4, 4, dtype=torch.float64)
    assert torch.equal(model.over_channels(image), type(model.over_channels).forward(model.over_channels, image))
    rows = torch.randn(3, 11, 8, dtype=torch.float64).requires_grad_()
    torch.testing.assert_close(
        model.over_last(rows), type(model.over_last).forward(model.over_last, rows), atol=1e-15, rtol=0
    )
    other = torch.randn(2, 8, 3, dtype=torch.float64)  # a last dimension it does not normalize: its own forward
    with pytest.raises(RuntimeError):
        model.over_last(other)
