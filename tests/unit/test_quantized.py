"""hf_rtp/checkpoint/quantized.py: a checkpoint vanilla saved quantized by bitsandbytes, checked before a byte
of weights is read. The 4-bit checkpoint is vanilla's own save of a tiny Llama (bitsandbytes on CPU); damaged
copies change one stored tensor. Loading such checkpoints on a ring is tests/distributed/test_qlora.py's."""

import copy
import json
import os

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file
from support.models import make_tiny, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

from hf_rtp import plans
from hf_rtp.checkpoint.keys import wants_for
from hf_rtp.checkpoint.quantized import _quant_state, read_stored, stored_specs
from hf_rtp.checkpoint.safetensors_io import read_header
from hf_rtp.distributed.ranks.topology import setup
from hf_rtp.errors import CheckpointError
from hf_rtp.integrations.bitsandbytes import stored_config
from hf_rtp.layers.linear4bit import Quant4bit, piece_of
from hf_rtp.layers.linear8bit import Quant8bit
from hf_rtp.settings import Settings

pytest.importorskip("bitsandbytes")

WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # rows of whole 64-element blocks
LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
           "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]  # fmt: skip
STATE = "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"
CHOSEN = {name: Quant4bit("nf4", 64, torch.bfloat16, torch.float32) for name in LINEARS}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama as vanilla saves it after quantizing it at load to 4-bit NF4 (a `*-bnb-4bit` repository)."""
    root = tmp_path_factory.mktemp("nf4")
    ckpt = make_tiny("llama", root / "ckpt", **WIDE)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=config)
    model.save_pretrained(root / "saved")
    return str(root / "saved")


@pytest.fixture(scope="module")
def config(saved):
    """The BitsAndBytesConfig the checkpoint's config.json records, as the loader reads it."""
    return stored_config(AutoConfig.from_pretrained(saved))


def _entries(folder):
    return read_header(os.path.join(folder, "model.safetensors"))


def _damaged(saved, tmp_path, **replaced):
    """The saved checkpoint's tensors with `replaced` ({name: tensor or bytes}) in a file of their own."""
    tensors = load_file(os.path.join(saved, "model.safetensors"))
    for name, value in replaced.items():
        tensors[name] = torch.tensor(list(value), dtype=torch.uint8) if isinstance(value, bytes) else value
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return _entries(tmp_path)


def _state(saved, **changes) -> bytes:
    stored = json.loads(bytes(load_file(os.path.join(saved, "model.safetensors"))[STATE].tolist()))
    return json.dumps({**stored, **changes}).encode()


def test_vanillas_4bit_save_gives_each_chosen_module_the_spec_its_quant_state_records(saved, config):
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    specs = stored_specs(CHOSEN, config, _entries(saved))
    # quantized from float32 as stored, whatever the load's dtype: dequantizing gives what vanilla's gives
    assert specs == {name: Quant4bit("nf4", 64, torch.float32, torch.float32) for name in LINEARS}


def test_the_dtype_it_was_quantized_from_comes_from_the_quant_state(saved, config, tmp_path):
    entries = _damaged(saved, tmp_path, **{STATE: _state(saved, dtype="bfloat16")})
    specs = stored_specs(CHOSEN, config, entries)
    assert specs["model.layers.1.mlp.up_proj"].dtype == torch.bfloat16
    assert specs["model.layers.1.mlp.down_proj"].dtype == torch.float32


def test_a_quant_type_other_than_the_configs_is_refused_naming_both(saved, config):
    fp4 = copy.deepcopy(config)
    fp4.bnb_4bit_quant_type = "fp4"
    with pytest.raises(CheckpointError, match=r"quant_type='nf4', but the checkpoint's config says "
                       r"bnb_4bit_quant_type='fp4': it is damaged"):  # fmt: skip
        stored_specs(CHOSEN, fp4, _entries(saved))


def test_a_quant_state_whose_type_disagrees_with_its_own_name_is_refused(saved, config, tmp_path):
    entries = _damaged(saved, tmp_path, **{STATE: _state(saved, quant_type="fp4")})
    with pytest.raises(CheckpointError, match=rf"{STATE} says quant_type='fp4', but the checkpoint's config says "
                       r"bnb_4bit_quant_type='nf4'"):  # fmt: skip
        stored_specs(CHOSEN, config, entries)


@pytest.mark.parametrize(
    "changes",
    [
        {"blocksize": 128},
        {"blocksize": "64"},
        {"dtype": "float33"},
        {"dtype": "Tensor"},
        {"dtype": None},
        {"dtype": "int8"},  # a torch dtype, but no float a weight was quantized from: a damaged quant state
        {"dtype": "bool"},
    ],
)
def test_a_block_size_other_than_64_or_a_dtype_torch_lacks_is_refused(saved, config, tmp_path, changes):
    entries = _damaged(saved, tmp_path, **{STATE: _state(saved, **changes)})
    with pytest.raises(CheckpointError, match=r"hf_rtp reads 4-bit weights of blocksize 64 quantized from a float "
                       r"dtype, not \{") as refused:  # fmt: skip
        stored_specs(CHOSEN, config, entries)
    assert str(refused.value).startswith(STATE) and repr(next(iter(changes.values()))) in str(refused.value)


def test_modules_stored_quantized_but_not_chosen_are_named(saved, config):
    chosen = {name: spec for name, spec in CHOSEN.items() if "down_proj" not in name}
    with pytest.raises(CheckpointError, match=r"stored quantized but not chosen: \['model.layers.0.mlp.down_proj', "
                       r"'model.layers.1.mlp.down_proj'\]; chosen but stored unquantized: \[\]"):  # fmt: skip
        stored_specs(chosen, config, _entries(saved))


def test_modules_chosen_but_stored_unquantized_are_named(saved, config):
    chosen = {**CHOSEN, "lm_head": CHOSEN[LINEARS[0]]}
    with pytest.raises(CheckpointError, match=r"not chosen: \[\]; chosen but stored unquantized: \['lm_head'\]\. "
                       "It was saved by other code or with other llm_int8_skip_modules"):  # fmt: skip
        stored_specs(chosen, config, _entries(saved))


@pytest.mark.parametrize(
    "stored", [b"x" * 77, b"\xff\xfe not UTF-8", b"[1, 2]", b'"nf4"', b""], ids=["x", "utf8", "list", "str", "empty"]
)
def test_a_quant_state_that_is_not_bitsandbytes_json_is_refused_naming_tensor_and_file(saved, config, tmp_path,
                                                                                     stored):  # fmt: skip
    entries = _damaged(saved, tmp_path, **{STATE: stored})
    message = rf"{STATE} in {tmp_path / 'model.safetensors'} is not bitsandbytes' quant state JSON"
    with pytest.raises(CheckpointError, match=message):
        _quant_state(entries[STATE])
    with pytest.raises(CheckpointError, match=message):
        stored_specs(CHOSEN, config, entries)


def test_8bit_modules_are_those_stored_with_row_scales(tmp_path):
    tensors = {
        "a.weight": torch.zeros(4, 8, dtype=torch.int8),
        "a.SCB": torch.ones(4),
        "b.weight": torch.zeros(4, 8),  # stored unquantized
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    entries, config = _entries(tmp_path), BitsAndBytesConfig(load_in_8bit=True)
    chosen = {"a": Quant8bit(6.0)}
    assert stored_specs(chosen, config, entries) == chosen
    with pytest.raises(CheckpointError, match=r"stored quantized but not chosen: \[\]; chosen but stored "
                       r"unquantized: \['b'\]"):  # fmt: skip
        stored_specs({**chosen, "b": Quant8bit(6.0)}, config, entries)


def _wants(saved):
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", **WIDE), dtype=torch.float32)
    entries = _entries(saved)
    wants, _ = wants_for(model, plans.get("llama").resolve(model), setup(Settings.resolve()), entries)
    return model, wants, entries


def test_a_stored_4bit_weight_reads_as_vanillas_packed_rows_and_absmax(saved, config):
    model, wants, entries = _wants(saved)
    read_stored(stored_specs(CHOSEN, config, entries), model, wants, entries)
    key = "model.layers.1.mlp.up_proj.weight"
    assert wants[key].source.names == [key, f"{key}.absmax", f"{key}.quant_map", f"{key}.quant_state.bitsandbytes__nf4"]
    stored = load_file(os.path.join(saved, "model.safetensors"))
    packed, absmax = stored[key].view(128, 32), stored[f"{key}.absmax"].view(128, 1)
    assert torch.equal(wants[key].source.read(entries, (0, 128)), piece_of(packed, absmax))
    assert torch.equal(wants[key].source.read(entries, (5, 9)), piece_of(packed[5:9], absmax[5:9]))


def test_a_stored_4bit_weight_missing_a_part_is_named(saved, config):
    model, wants, entries = _wants(saved)
    specs = stored_specs(CHOSEN, config, entries)
    del entries["model.layers.0.self_attn.k_proj.weight.absmax"]
    with pytest.raises(CheckpointError, match=r"the quantized checkpoint lacks model.layers.0.self_attn.k_proj.weight"
                       r".absmax, which model.layers.0.self_attn.k_proj needs"):  # fmt: skip
        read_stored(specs, model, wants, entries)
