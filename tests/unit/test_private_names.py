"""torch's, transformers' and accelerate's private names are reached only through hf_rtp/private/, which
fails with IntegrationError naming a name below the tested versions or once it is gone, and warns once for a
newer release (DESIGN.md, "Private names"). The checker is tried on a planted file too, so that one that finds
nothing cannot pass."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_rtp
from hf_rtp.private import accelerate_names, gate, torch_names, transformers_names

ROOT = Path(hf_rtp.__file__).parent
# Gated names: only hf_rtp/private/ may spell them (as an attribute, an imported name or a string)
GATED = {
    "_op_dispatcher", "_allow_implicit_replication", "_foreach_supported_types", "_will_engine_execute_node",
    "_current_graph_task_id", "_execution_engine", "_flatten_dense_tensors", "_unflatten_dense_tensors",
    "_assert_async", "_local_tensor", "_ddp_params_and_buffers_to_ignore", "_init_weights",
    "_get_resized_embeddings", "_get_resized_lm_head", "_loss_function", "_apply_gate", "_attn_implementation",
    "_no_split_modules", "_models", "_optimizers", "_shared_state", "_amp_foreach_non_finite_check_and_unscale_",
    "_keep_in_fp32_modules", "_validate_accelerator", "_supports_sdpa", "_prepare_cp",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_version",
}  # fmt: skip
LIBRARIES = ("torch", "transformers", "accelerate")


def touches(path: Path) -> list[str]:
    """Where the file spells a gated name, or imports from a private module of torch/transformers/accelerate."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno} imports from {node.module}")
            names = [a.name for a in node.names]
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n in GATED]
    return found


def test_no_module_outside_private_touches_a_private_name():
    found = [hit for path in sorted(ROOT.rglob("*.py")) if "private" not in path.parts for hit in touches(path)]
    assert found == []


def test_the_checker_finds_an_attribute_a_string_and_a_private_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from torch._utils import _flatten_dense_tensors\n"
        "from torch.distributed.tensor import DTensor\n"
        "flag = DTensor._op_dispatcher\n"
        "own = model.__dict__.get('_loss_function')\n"
        "fine = model._parameters\n"
    )
    assert touches(planted) == [
        "planted.py:1 imports from torch._utils",
        "planted.py:1 _flatten_dense_tensors",
        "planted.py:3 _op_dispatcher",
        "planted.py:4 _loss_function",
    ]


def test_every_gated_name_resolves_under_the_installed_versions():
    assert torch_names.implicit_replication() is False  # torch's default, outside a rotated op
    assert torch_names.will_engine_execute_node and torch_names.current_graph_task_id and torch_names.queue_callback
    flat = torch_names.flatten_dense_tensors([torch.ones(2), torch.zeros(3)])
    assert [t.tolist() for t in torch_names.unflatten_dense_tensors(flat, [torch.empty(2), torch.empty(3)])] == [
        [1.0, 1.0],
        [0.0, 0.0, 0.0],
    ]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    transformers_names.init_weights(model, model.lm_head)
    assert transformers_names.resized_embeddings(model, model.model.embed_tokens, 20).weight.shape == (20, 8)
    assert transformers_names.resized_lm_head(model, model.lm_head, 20).weight.shape == (20, 8)
    assert transformers_names.own_loss_function(model) is None
    assert transformers_names.attention_implementation(model.config) in ("eager", "sdpa")
    assert transformers_names.no_split_modules(model) == ("LlamaDecoderLayer",)
    assert transformers_names.keep_in_fp32_modules(model) == set()
    assert transformers_names.supports_sdpa(model)
    assert accelerate_names.state_exists() in (True, False)


def test_an_older_version_or_a_missing_name_is_an_integration_error_naming_it():
    with pytest.raises(
        hf_rtp.IntegrationError, match=r"torch's private DTensor._op_dispatcher.*torch>=2.6,<2.16.*older"
    ):
        gate.check_version("torch", "2.5.1", torch_names.TESTED, "DTensor._op_dispatcher")
    gate.check_version("torch", "2.13.0+cpu", torch_names.TESTED, "DTensor._op_dispatcher")  # a local build
    gate.check_version("torch", "2.15.0+cu132", torch_names.TESTED, "DTensor._op_dispatcher")
    with pytest.raises(hf_rtp.IntegrationError, match=r"private _apply_gate, which transformers \S+ does not have"):
        transformers_names.experts_gate(torch.nn.Linear(2, 2))


def test_a_newer_version_is_warned_about_once_and_still_looked_up_by_name(caplog):
    """A release out after hf_rtp's (a nightly too) is not refused: one warning per library, then every name
    is looked up as usual, and one that is gone still fails naming it."""
    with caplog.at_level("WARNING", logger="hf_rtp"):
        for name in ("a", "b"):
            gate.check_version("torch", "2.99.0", torch_names.TESTED, name)
        gate.check_version("torch", "2.98.0.dev20270101+cu140", torch_names.TESTED, "a")
        assert gate.lookup(torch, "_assert_async", "torch", "2.99.0", torch_names.TESTED) is torch._assert_async
        with pytest.raises(hf_rtp.IntegrationError, match=r"private _gone_name, which torch 2.99.0 does not have"):
            gate.lookup(torch, "_gone_name", "torch", "2.99.0", torch_names.TESTED)
    warned = [r.getMessage() for r in caplog.records if r.name == "hf_rtp"]
    assert len(warned) == 2, warned  # one per installed version, not per name
    assert "torch>=2.6,<2.16; torch 2.99.0 is newer" in warned[0]


def test_the_gates_start_at_pyproject_lower_bounds():
    """pyproject.toml bounds torch and transformers from below only (a newer release is warned about, not
    downgraded by pip); accelerate keeps its tested range there."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    bounds = {}
    for requirement in pyproject["project"]["dependencies"]:
        name, spec = re.fullmatch(r"([a-z_-]+)(.*)", requirement).groups()
        bounds[name] = spec
    assert bounds["torch"] == torch_names.TESTED.split(",")[0] == ">=2.6"
    assert bounds["transformers"].split(",")[0] == transformers_names.TESTED.split(",")[0]
    assert bounds["accelerate"] == accelerate_names.TESTED
