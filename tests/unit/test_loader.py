"""hf_rtp/loader.py: from_pretrained's named steps, each called on its own in one process (world size 1: no
process group), on tiny checkpoints vanilla saved here. The whole load is the distributed tests' subject."""

import copy
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.folders import snapshot
from support.models import fake_hub_cache, make_tiny_llama
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, BitsAndBytesConfig

import hf_rtp
from hf_rtp import faults, keywords, loader, plans
from hf_rtp.checkpoint.quantized import NOT_QUANTIZED
from hf_rtp.checkpoint.safetensors_io import read_header
from hf_rtp.errors import CheckpointError, KeywordError, SettingError, UnsupportedModelError
from hf_rtp.folders.commit import JOURNAL
from hf_rtp.integrations.bitsandbytes import BitsAndBytesLoad, quantized_load
from hf_rtp.settings import Settings

HUB = dict(revision=None, token=None, cache_dir=None, local_files_only=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "ckpt")


@pytest.fixture(scope="module")
def one():
    """The start step in one process: a ring of one, no process group."""
    topology = loader.start(Settings.resolve(), None, None)
    assert topology.world_size == topology.rtp_size == 1 and topology.control is None
    return topology


def _options(**kwargs) -> keywords.LoadOptions:
    return keywords.resolve(kwargs, "auto", None)


@pytest.fixture
def hf_rtp_log(caplog):
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        yield caplog


# named_plan


def test_no_plan_is_the_one_registered_for_the_model_type(ckpt):
    assert loader.named_plan(None, AutoConfig.from_pretrained(ckpt)) is plans.get("llama")


def test_a_registered_name_auto_or_a_plan_are_taken_as_they_are(ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    assert loader.named_plan("gpt2", config) is plans.get("gpt2")  # the name given, not config.model_type
    assert loader.named_plan("auto", config) == "auto"  # resolved on the model, in build
    mine = plans.get("qwen2")
    assert loader.named_plan(mine, config) is mine


def test_a_model_type_without_a_plan_fails_before_anything_is_read_listing_the_supported(ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    config.model_type = "starcoder2"
    with pytest.raises(UnsupportedModelError, match=r"no plan for model_type 'starcoder2'\. Supported: .*llama"):
        loader.named_plan(None, config)
    with pytest.raises(UnsupportedModelError, match=r"no plan for model_type 'llama3'.*plan='auto'"):
        loader.named_plan("llama3", AutoConfig.from_pretrained(ckpt))


@pytest.mark.parametrize("plan", [3, {"model_type": "llama"}, ["auto"], b"auto"])
def test_anything_else_as_a_plan_is_a_keyword_error_naming_its_type(ckpt, plan):
    with pytest.raises(KeywordError, match=rf"plan must be a Plan, a registered model_type or 'auto', got "
                       rf"{type(plan).__name__}$"):  # fmt: skip
        loader.named_plan(plan, AutoConfig.from_pretrained(ckpt))


# the dtype (the find step)


def _entries(tmp_path, files: dict) -> dict:
    """The entries of safetensors files written here: {file name: {tensor name: tensor}}."""
    entries = {}
    for filename, tensors in files.items():
        save_file(tensors, str(tmp_path / filename))
        entries.update(read_header(str(tmp_path / filename)))
    return entries


def test_auto_is_the_configs_dtype(ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    config.dtype = torch.bfloat16
    assert loader._resolve_dtype("auto", config, {}) == torch.bfloat16


def test_auto_without_a_config_dtype_is_the_first_floating_dtype_of_the_first_weight_file(ckpt, tmp_path):
    config = AutoConfig.from_pretrained(ckpt)
    config.dtype = None
    entries = _entries(
        tmp_path,
        {
            "b.safetensors": {"a": torch.zeros(1, dtype=torch.float64)},
            "a.safetensors": {  # the first file: its first floating tensor by name is b's
                "a": torch.zeros(1, dtype=torch.int64),
                "b": torch.zeros(1, dtype=torch.bfloat16),
                "c": torch.zeros(1, dtype=torch.float16),
            },
        },
    )
    assert loader._resolve_dtype("auto", config, entries) == torch.bfloat16


def test_the_stored_dtype_passes_over_float8_and_falls_back_to_whatever_is_stored(tmp_path):
    float8 = {"a": torch.zeros(1).to(torch.float8_e4m3fn), "b": torch.zeros(1, dtype=torch.float16)}
    assert loader._stored_dtype(_entries(tmp_path, {"x.safetensors": float8})) == torch.float16
    integers = {"a": torch.zeros(1, dtype=torch.int32), "b": torch.zeros(1, dtype=torch.int8)}
    assert loader._stored_dtype(_entries(tmp_path, {"y.safetensors": integers})) == torch.int32
    assert loader._stored_dtype({}) == torch.float32


@pytest.mark.parametrize(("given", "expected"), [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                                  (torch.float32, torch.float32)])  # fmt: skip
def test_a_dtype_given_by_name_or_as_a_dtype_is_that_dtype(ckpt, given, expected):
    assert loader._resolve_dtype(given, AutoConfig.from_pretrained(ckpt), {}) == expected


@pytest.mark.parametrize("given", ["bf16", "Tensor", "nn", "", 16, None, torch.zeros(1)])
def test_a_dtype_that_is_no_dtype_is_a_setting_error(ckpt, given):
    with pytest.raises(SettingError, match=r"dtype must be 'auto'"):
        loader._resolve_dtype(given, AutoConfig.from_pretrained(ckpt), {})


def test_find_reads_the_headers_and_records_the_dtype_on_the_config_as_vanilla_does(ckpt, one):
    source = loader.resolve(ckpt, _options(), HUB, AutoModelForCausalLM, one)
    assert source.entries == {}
    assert loader.find(source, keywords.resolve({}, "bfloat16", None), one) == torch.bfloat16
    assert source.config.dtype == torch.bfloat16
    assert set(source.entries) == set(load_file(os.path.join(ckpt, "model.safetensors")))


# the folder


def test_a_subfolder_is_read_as_the_folder_config_and_weights_alike(ckpt, tmp_path):
    shutil.copytree(ckpt, tmp_path / "base" / "sub")
    path = str(tmp_path / "base")
    assert loader._folder(path, "sub", HUB, None) == (os.path.join(path, "sub"), None)
    assert loader._folder(os.path.join(path, "sub"), "", HUB, None) == (os.path.join(path, "sub"), None)


def test_a_subfolder_without_a_config_is_refused(ckpt, tmp_path):
    (tmp_path / "base" / "sub").mkdir(parents=True)
    shutil.copy(os.path.join(ckpt, "config.json"), tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"base/sub has no config.json"):
        loader._folder(str(tmp_path / "base"), "sub", HUB, None)


def test_a_local_folder_without_the_subfolder_is_refused_naming_it_not_looked_up_on_the_hub(ckpt, tmp_path):
    base = shutil.copytree(ckpt, tmp_path / "base")
    with pytest.raises(OSError, match=r"base has no subfolder 'nope'"):  # vanilla's OSError, not a Hub id's error
        loader._folder(str(base), "nope", HUB, None)


def test_a_peft_adapter_beside_the_base_weights_is_refused_not_left_unapplied(ckpt, tmp_path):
    folder = shutil.copytree(ckpt, tmp_path / "with_adapter")
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(CheckpointError, match=r"holds a PEFT adapter \(adapter_config.json\) beside the base weights"
                       r".*merge_and_unload"):  # fmt: skip
        loader._folder(str(folder), "", HUB, None)


def test_a_hub_snapshot_is_its_commit_and_its_subfolder_comes_with_it(ckpt, tmp_path):
    commit = "c" * 40
    shutil.copytree(ckpt, tmp_path / "repo" / "sub")
    cache = fake_hub_cache(str(tmp_path / "cache"), "org/tiny", {commit: tmp_path / "repo"})
    hub = {**HUB, "cache_dir": cache}
    snapshot_dir = os.path.join(cache, "models--org--tiny", "snapshots", commit)
    assert loader._folder("org/tiny", "sub", hub, None) == (os.path.join(snapshot_dir, "sub"), commit)
    with pytest.raises(CheckpointError, match=r"org/tiny has no config.json in subfolder 'other'"):
        loader._folder("org/tiny", "other", hub, None)


# the config


def test_config_overrides_go_on_the_config_and_an_unknown_keyword_is_named(ckpt):
    config = loader._config(ckpt, _options(num_hidden_layers=1, rms_norm_eps=1e-3))
    assert (config.num_hidden_layers, config.rms_norm_eps) == (1, 1e-3)
    with pytest.raises(KeywordError, match=r"unexpected keyword arguments: no_such_keyword, other_typo$"):
        loader._config(ckpt, _options(other_typo=2, no_such_keyword=1, num_hidden_layers=1))


def test_a_config_passed_is_copied_never_changed(ckpt):
    mine = AutoConfig.from_pretrained(ckpt)
    before = mine.to_dict()
    config = loader._config(ckpt, _options(config=mine))
    assert config is not mine and config.to_dict() == before
    config.num_hidden_layers = 7
    config.rope_parameters["rope_theta"] = 1.0  # nested too
    assert mine.to_dict() == before


def test_a_config_passed_as_a_path_is_read_from_there(ckpt, tmp_path):
    other = tmp_path / "other"
    AutoConfig.from_pretrained(ckpt, num_hidden_layers=1).save_pretrained(other)
    assert loader._config(ckpt, _options(config=str(other))).num_hidden_layers == 1


# remote code


def _with_auto_map(ckpt, tmp_path, auto_map):
    folder = shutil.copytree(ckpt, tmp_path / "remote")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = auto_map
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_trust_remote_code_where_vanilla_would_run_the_repositorys_code_is_refused(ckpt, tmp_path):
    folder = _with_auto_map(ckpt, tmp_path, {"AutoConfig": "mine.Config", "AutoModelForCausalLM": "mine.Model"})
    with pytest.raises(KeywordError, match=r"maps AutoConfig, AutoModelForCausalLM to the repository's own code "
                       r"\(mine.Config, mine.Model\)"):  # fmt: skip
        loader._refuse_remote_code(folder, _options(trust_remote_code=True), AutoModelForCausalLM)
    loader._refuse_remote_code(folder, _options(), AutoModelForCausalLM)  # not trusted: vanilla runs none either


def test_trust_remote_code_on_a_builtin_architecture_is_accepted(ckpt, tmp_path):
    loader._refuse_remote_code(ckpt, _options(trust_remote_code=True), AutoModelForCausalLM)
    # the repository's code for another head only: this load builds transformers' own class
    folder = _with_auto_map(ckpt, tmp_path, {"AutoModelForSequenceClassification": "mine.Classifier"})
    loader._refuse_remote_code(folder, _options(trust_remote_code=True), AutoModelForCausalLM)
    with pytest.raises(KeywordError, match=r"maps AutoModelForSequenceClassification to"):
        loader._refuse_remote_code(folder, _options(trust_remote_code=True), AutoModelForSequenceClassification)


def test_trust_remote_code_reads_the_auto_map_of_a_config_passed(ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    config.auto_map = {"AutoConfig": "mine.Config"}
    with pytest.raises(KeywordError, match=r"maps AutoConfig to the repository's own code \(mine.Config\)"):
        loader._refuse_remote_code(ckpt, _options(trust_remote_code=True, config=config), AutoModelForCausalLM)


# the load's quantization


def test_no_quantization_is_not_quantized_and_its_steps_do_nothing(ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    assert quantized_load(config, None) is NOT_QUANTIZED
    assert getattr(config, "quantization_config", None) is None
    model = object()  # the steps look at nothing
    assert NOT_QUANTIZED.config is None
    assert NOT_QUANTIZED.plan(model, None, torch.float32, 1) is None
    assert NOT_QUANTIZED.transforms(model, {}, {}) is None
    assert NOT_QUANTIZED.finish(model, {}, None) is None
    assert NOT_QUANTIZED.install(model) is None


def test_a_requested_4bit_config_is_quantized_as_it_is_read(ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    requested = BitsAndBytesConfig(load_in_4bit=True)
    load = quantized_load(config, requested)
    assert isinstance(load, BitsAndBytesLoad) and load.stored is False and load.config is requested
    assert config.quantization_config is requested  # recorded as vanilla records it (and fingerprinted)


def test_a_checkpoint_bitsandbytes_saved_is_read_as_stored_and_its_config_wins(ckpt, hf_rtp_log):
    saved = json.loads(json.dumps(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4").to_dict()))
    assert type(saved["quant_method"]) is str  # "bitsandbytes", as config.json holds it
    config = AutoConfig.from_pretrained(ckpt)
    config.quantization_config = saved
    load = quantized_load(copy.deepcopy(config), None)
    assert isinstance(load, BitsAndBytesLoad) and load.stored is True
    assert isinstance(load.config, BitsAndBytesConfig) and load.config.bnb_4bit_quant_type == "nf4"
    assert "already quantized" not in hf_rtp_log.text
    load = quantized_load(config, BitsAndBytesConfig(load_in_8bit=True))
    assert load.stored is True and load.config.load_in_4bit and not load.config.load_in_8bit
    assert config.quantization_config is load.config
    assert "already quantized by bitsandbytes: its own quantization_config is used" in hf_rtp_log.text


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_a_checkpoint_another_method_quantized_is_refused_naming_the_method(ckpt, method):
    config = AutoConfig.from_pretrained(ckpt)
    config.quantization_config = {"quant_method": method, "bits": 4}
    with pytest.raises(CheckpointError, match=rf"this checkpoint is quantized .*quant_method='{method}'"):
        quantized_load(config, None)
    with pytest.raises(CheckpointError, match=rf"quant_method='{method}'"):  # a request does not make it readable
        quantized_load(config, BitsAndBytesConfig(load_in_4bit=True))


def test_resolve_gives_the_folder_config_and_quantization_of_a_local_checkpoint(ckpt, one):
    source = loader.resolve(ckpt, _options(num_hidden_layers=1), HUB, AutoModelForCausalLM, one)
    assert (source.directory, source.commit, source.config.num_hidden_layers) == (ckpt, None, 1)
    assert source.quantization is NOT_QUANTIZED
    requested = BitsAndBytesConfig(load_in_4bit=True)
    source = loader.resolve(ckpt, _options(quantization_config=requested), HUB, AutoModelForCausalLM, one)
    assert isinstance(source.quantization, BitsAndBytesLoad) and not source.quantization.stored


# the recovery step


def _interrupted_save(ckpt, folder):
    """`folder` as a crash leaves it mid-commit of a save_pretrained over an earlier one: half the new files moved
    in, the journal there. The weights that save wrote."""
    model = hf_rtp.from_pretrained(ckpt)
    model.save_pretrained(folder, max_shard_size="12KB")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    faults.point("load.read")  # reached while HF_RTP_FAULT is unset: the fault counts from zero (faults.py)
    os.environ["HF_RTP_FAULT"] = "raise@save.commit.mid"
    try:
        with pytest.raises(CheckpointError, match=r"injected by HF_RTP_FAULT at save\.commit\.mid"):
            model.save_pretrained(folder)  # sharded -> one file: the old shards must go
    finally:
        del os.environ["HF_RTP_FAULT"]
    assert os.path.exists(os.path.join(folder, JOURNAL))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("step", ["recover", "resolve"])  # the step, and the resolve step that runs it first
def test_a_save_a_crash_interrupted_in_a_local_folder_is_finished(ckpt, tmp_path, one, hf_rtp_log, step):
    folder = str(tmp_path / "out")
    expected = _interrupted_save(ckpt, folder)
    if step == "recover":
        loader.recover(folder, one)
    else:
        assert loader.resolve(folder, _options(), HUB, AutoModelForCausalLM, one).directory == folder
    assert f"found the journal of a save_pretrained a crash interrupted in {folder}: finishing it" in hf_rtp_log.text
    assert f"finished the interrupted save in {folder}" in hf_rtp_log.text
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert stored.keys() == expected.keys() and all(torch.equal(stored[n], expected[n]) for n in expected)


def test_recover_leaves_a_folder_without_a_journal_as_it_is(ckpt, tmp_path, one, hf_rtp_log):
    folder = shutil.copytree(ckpt, tmp_path / "plain")
    (folder / "notes.txt").write_text("the user's")
    before = snapshot(folder)
    loader.recover(str(folder), one)
    assert snapshot(folder) == before and "journal" not in hf_rtp_log.text


def test_a_hub_snapshot_is_never_recovered(ckpt, tmp_path, one, hf_rtp_log):
    commit = "d" * 40
    _interrupted_save(ckpt, str(tmp_path / "out"))
    hf_rtp_log.clear()
    cache = fake_hub_cache(str(tmp_path / "cache"), "org/tiny", {commit: str(tmp_path / "out")})
    before = snapshot(cache)
    source = loader.resolve("org/tiny", _options(), {**HUB, "cache_dir": cache}, AutoModelForCausalLM, one)
    assert source.commit == commit
    assert snapshot(cache) == before and "journal" not in hf_rtp_log.text and "did not touch" not in hf_rtp_log.text
