"""torch's, transformers', accelerate's, bitsandbytes' and torchao's private names are reached only through
hf_rtp/private/, which fails with IntegrationError naming a name below the tested versions or once it is gone,
and warns once for a newer release (DESIGN.md, "Private names"). The checker is tried on a planted file too, so
that one that finds nothing cannot pass. torchao is kept out of the suite's environment (transformers imports it
in every process that imports PEFT): its names resolve in a fresh interpreter that puts .ci/torchao on its path,
as tests/distributed/test_torchao_optimizer.py's ranks do."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from transformers import LlamaConfig, LlamaForCausalLM

import hf_rtp
from hf_rtp.private import accelerate_names, bitsandbytes_names, gate, torch_names, torchao_names, transformers_names

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
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_version", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_schema",
    # bitsandbytes' optimizer internals and its state's keys
    "bitsandbytes.optim.optimizer", "Optimizer8bit", "initialized", "check_overrides", "get_config", "is_paged",
    "init_state", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2",
    # torchao's
    "torchao.optim.adam", "subclass_8bit", "OptimState8bit", "get_qmap_signed", "get_qmap_unsigned", "block_size",
    "bf16_stochastic_round",
}  # fmt: skip
LIBRARIES = ("torch", "transformers", "accelerate", "bitsandbytes", "torchao")
TORCHAO = ROOT.parent / ".ci" / "torchao"  # .ci/run installs torchao there, apart from the suite's environment


def touches(path: Path) -> list[str]:
    """Where the file spells a gated name, or imports from a private module of one of LIBRARIES."""
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
        "from torchao.optim.subclass_8bit import OptimState8bit\n"
        "moment = optimizer.state[p]['state1']\n"
        "from bitsandbytes._ops import x\n"
    )
    by_line = sorted(touches(planted), key=lambda hit: int(hit.split(":")[1].split()[0]))  # ast.walk's order differs
    assert by_line == [
        "planted.py:1 imports from torch._utils",
        "planted.py:1 _flatten_dense_tensors",
        "planted.py:3 _op_dispatcher",
        "planted.py:4 _loss_function",
        "planted.py:6 OptimState8bit",
        "planted.py:7 state1",
        "planted.py:8 imports from bitsandbytes._ops",
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
    assert torch_names.op_schema(torch.ops.aten.add.Tensor).name == "aten::add"
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight])
    optimizer.register_step_pre_hook(lambda *args: None)
    optimizer.register_step_post_hook(lambda *args: None)
    shadow = object.__new__(torch.optim.SGD)  # as integrations/torchao.py's copy
    shadow.__dict__.update(optimizer.__dict__)
    torch_names.clear_step_hooks(shadow)
    assert not shadow._optimizer_step_pre_hooks and not shadow._optimizer_step_post_hooks
    assert len(optimizer._optimizer_step_pre_hooks) == len(optimizer._optimizer_step_post_hooks) == 1


def _bitsandbytes_optimizer():
    bnb = pytest.importorskip("bitsandbytes")
    weight = torch.nn.Parameter(torch.randn(64, 64))  # 4096 elements: 8-bit state (bitsandbytes' min_8bit_size)
    return bnb, weight, bnb.optim.AdamW8bit([weight])


def test_bitsandbytes_names_resolve_under_the_installed_version():
    _, weight, optimizer = _bitsandbytes_optimizer()
    group = optimizer.param_groups[0]
    assert bitsandbytes_names.is_optimizer(optimizer)
    assert not bitsandbytes_names.is_optimizer(torch.optim.SGD([weight]))
    bitsandbytes_names.apply_overrides(optimizer)
    assert bitsandbytes_names.max_unorm(optimizer, 0, 0, group) == 0.0
    assert bitsandbytes_names.paged(optimizer) is False
    bitsandbytes_names.set_paged(optimizer, False)
    bitsandbytes_names.first_state(optimizer, group, weight, 0, 0)
    state = optimizer.state[weight]
    assert [state[k].dtype for k in bitsandbytes_names.MOMENTS] == [torch.uint8] * 2
    assert [state[k].shape for k in bitsandbytes_names.SCALES] == [(64 * 64 // 256,)] * 2  # blockwise.BLOCK
    assert [state[k].shape for k in bitsandbytes_names.CODE_MAPS] == [(256,)] * 2


def test_an_older_bitsandbytes_is_an_integration_error_naming_the_name(monkeypatch):
    """An older bitsandbytes than TESTED fails naming what hf_rtp would reach, for its own optimizers only."""
    bnb, weight, optimizer = _bitsandbytes_optimizer()
    monkeypatch.setattr(bnb, "__version__", "0.49.2")
    older = r"bitsandbytes's private {}, checked against bitsandbytes>=0.50,<0.51; bitsandbytes 0.49.2 is older"
    with pytest.raises(hf_rtp.IntegrationError, match=older.format("Optimizer8bit")):
        bitsandbytes_names.is_optimizer(optimizer)
    with pytest.raises(hf_rtp.IntegrationError, match=older.format("init_state")):
        bitsandbytes_names.first_state(optimizer, optimizer.param_groups[0], weight, 0, 0)
    assert not optimizer.state
    assert not bitsandbytes_names.is_optimizer(torch.optim.SGD([weight]))  # another optimizer steps as before


TORCHAO_SCRIPT = """
import json, sys
import torch
from hf_rtp.errors import IntegrationError
from hf_rtp.private import bitsandbytes_names, torchao_names

imported = sorted(m for m in ("bitsandbytes", "torchao") if m in sys.modules)  # lazy: neither yet
sys.path.insert(0, sys.argv[1])
import torchao.optim

optimizer = torchao.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))], bf16_stochastic_round=True)
signed = torchao_names.code_map(True)


def state():  # an 8-bit moment of zero codes, one block scale of 1 per 256 elements
    codes = torch.zeros(64, 64, dtype=torch.uint8)
    return torchao_names.state_8bit(codes, torch.ones(16), torch.tensor(signed), True, dtype=torch.float32)


moment, classes = state(), (torchao.optim.AdamW8bit, torchao.optim.Adam8bit)
found = dict(
    imported=imported,
    version=torchao.__version__,
    stepped=torchao_names.stepped_classes(("AdamW8bit", "Adam8bit")) == classes,
    block=torchao_names.scale_block(optimizer),
    rounding=torchao_names.stochastic_rounding(optimizer),
    maps=[len(signed), len(torchao_names.code_map(False)), signed[0]],
    state=[type(moment).__name__, list(moment.shape), moment.dequantize()[0, 0].item()],
)
torchao.__version__ = "0.17.0"  # an older torchao than TESTED
for name, call in (("OptimState8bit", state), ("AdamW8bit", lambda: torchao_names.stepped_classes(("AdamW8bit",)))):
    try:
        call()
    except IntegrationError as err:
        found[name] = str(err)
print(json.dumps(found))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None and not (TORCHAO / "torchao").is_dir(),
    reason="torchao is not installed (.ci/run installs it in .ci/torchao)",
)
def test_torchao_names_resolve_and_an_older_torchao_is_an_integration_error_naming_them():
    done = subprocess.run([sys.executable, "-c", TORCHAO_SCRIPT, str(TORCHAO)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["imported"] == []  # the private modules import neither library
    assert found["version"] in SpecifierSet(torchao_names.TESTED)
    assert found["stepped"] and found["block"] == 256 and found["rounding"] is True
    assert found["maps"][:2] == [256, 256] and found["maps"][2] < 0  # signed: from about -1
    assert found["state"] == ["OptimState8bit", [64, 64], found["maps"][2]]  # code 0 of the signed map, scale 1
    for name in ("OptimState8bit", "AdamW8bit"):
        assert f"torchao's private {name}, checked against torchao>=0.18,<0.19; torchao 0.17.0 is older" in found[name]


def test_an_older_version_or_a_missing_name_is_an_integration_error_naming_it():
    with pytest.raises(
        hf_rtp.IntegrationError, match=r"torch's private DTensor._op_dispatcher.*torch>=2.11,<2.16.*2.10.0 is older"
    ):
        gate.check_version("torch", "2.10.0", torch_names.TESTED, "DTensor._op_dispatcher")
    with pytest.raises(hf_rtp.IntegrationError, match=r"transformers>=5.23,<5.25; transformers 5.22.0 is older"):
        gate.check_version("transformers", "5.22.0", transformers_names.TESTED, "Trainer methods")
    gate.check_version("torch", "2.11.0+cu130", torch_names.TESTED, "DTensor._op_dispatcher")  # the oldest run
    gate.check_version("torch", "2.13.0+cpu", torch_names.TESTED, "DTensor._op_dispatcher")  # a local build
    gate.check_version("transformers", "5.23.0", transformers_names.TESTED, "Trainer methods")
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
    assert "torch>=2.11,<2.16; torch 2.99.0 is newer" in warned[0]


def test_the_docs_name_the_gates_ranges():
    """DESIGN.md ("Private names") and docs/testing.md ("Versions") name torch's and transformers' tested ranges
    as the gates hold them, and the README their floors: a gate moved alone fails here."""
    design, testing, readme = (
        " ".join((ROOT.parent / name).read_text().split()) for name in ("DESIGN.md", "docs/testing.md", "README.md")
    )
    floors = {}
    for library, tested in (("torch", torch_names.TESTED), ("transformers", transformers_names.TESTED)):
        assert f"(`private/{library}_names.py`, {library}{tested})" in design
        assert f"{library} `{tested}`" in testing
        floors[library] = re.fullmatch(r">=([0-9.]+)", tested.split(",")[0]).group(1)
    assert f"hf_rtp requires torch {floors['torch']} and transformers {floors['transformers']} or newer" in readme
    assert f"On a machine with PyTorch {floors['torch']} or newer installed" in readme


def test_the_gates_start_at_pyproject_lower_bounds():
    """pyproject.toml bounds torch and transformers from below only (a newer release is warned about, not
    downgraded by pip), at the gates' lower bounds: the oldest releases a check ran on (docs/testing.md,
    "Versions"), so neither can move without the other; accelerate keeps its tested range there. CI's pinned
    torch and transformers are inside the gates' ranges."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    bounds = {}
    for requirement in pyproject["project"]["dependencies"]:
        name, spec = re.fullmatch(r"([a-z_-]+)(.*)", requirement).groups()
        bounds[name] = spec
    assert bounds["torch"] == torch_names.TESTED.split(",")[0] == ">=2.11"
    assert bounds["transformers"].split(",")[0] == transformers_names.TESTED.split(",")[0] == ">=5.23"
    assert bounds["accelerate"] == accelerate_names.TESTED
    assert pyproject["project"]["optional-dependencies"]["bitsandbytes"] == ["bitsandbytes" + bitsandbytes_names.TESTED]
    # torchao is no dependency: CI's one release (.ci/run) and CI's bitsandbytes (.ci/pinned.txt) are in the ranges
    ci = ROOT.parent / ".ci"
    pinned = dict(re.findall(r"^([a-z_-]+)==(\S+)$", (ci / "pinned.txt").read_text(), re.M))
    assert pinned["torch"] in SpecifierSet(torch_names.TESTED)
    assert pinned["transformers"] in SpecifierSet(transformers_names.TESTED)
    assert re.search(r"torchao==(\S+)", (ci / "run").read_text()).group(1) in SpecifierSet(torchao_names.TESTED)
    assert re.search(r"bitsandbytes==(\S+)", (ci / "pinned.txt").read_text()).group(1) in SpecifierSet(
        bitsandbytes_names.TESTED
    )
