"""Which auto class hf_rtp builds a checkpoint with, and which parameters a checkpoint lacks that it initialises
as vanilla does (model/heads.py), in one process against vanilla transformers' classes and loading info. The
same at 2 ranks (a new head drawn on rank 0 and sent, then trained under TRL and DDP) is
tests/distributed/test_model_classes.py's."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from support.models import make_tiny_llama, tiny_llama_config
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import hf_rtp
from hf_rtp import plans
from hf_rtp.model.heads import SUPPORTED, fresh_head, is_causal_lm, model_class

SUPPORTED_NAMES = (
    "AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification, "
    "AutoModelForImageTextToText"
)


def _saved_as(auto_class, **overrides):
    """The config vanilla's save_pretrained writes for a model built by `auto_class`: its architectures."""
    config = tiny_llama_config(**overrides)
    with init_empty_weights():
        model = auto_class.from_config(config)
    config.architectures = [type(model).__name__]  # what save_pretrained records
    return config, type(model)


def test_a_causal_checkpoint_and_one_of_unknown_class_are_built_as_causal_lms():
    assert model_class(None, tiny_llama_config()) is AutoModelForCausalLM  # no architectures recorded
    config, _ = _saved_as(AutoModelForCausalLM)
    assert config.architectures == ["LlamaForCausalLM"] and model_class(None, config) is AutoModelForCausalLM
    for auto_class in SUPPORTED:  # asked for by name: taken, whatever the checkpoint was saved as
        assert model_class(auto_class, config) is auto_class


@pytest.mark.parametrize("auto_class", [AutoModelForSequenceClassification, AutoModelForTokenClassification])
def test_a_classifiers_checkpoint_is_refused_as_a_causal_lm_naming_the_class_that_builds_vanillas(auto_class):
    config, vanilla_class = _saved_as(auto_class, num_labels=3)
    ours = getattr(hf_rtp, auto_class.__name__)
    with pytest.raises(
        hf_rtp.UnsupportedModelError,
        match=rf"this checkpoint is a {vanilla_class.__name__} \(config.architectures\), not a causal LM: load it "
        rf"with hf_rtp.{auto_class.__name__}.from_pretrained\(...\). Supported classes: {SUPPORTED_NAMES}$",
    ):
        model_class(None, config)
    assert model_class(ours.auto_class, config) is auto_class
    with init_empty_weights():
        assert type(ours.auto_class.from_config(config)) is vanilla_class


def test_an_image_text_checkpoint_without_a_causal_lm_class_is_refused_naming_the_class_that_loads_it():
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig()
    with pytest.raises(
        hf_rtp.UnsupportedModelError,
        match=r"model_type 'qwen2_vl' has no causal-LM class in transformers: load it with "
        r"hf_rtp.AutoModelForImageTextToText.from_pretrained\(...\)",
    ):
        model_class(None, config)
    assert model_class(hf_rtp.AutoModelForImageTextToText.auto_class, config) is AutoModelForImageTextToText
    with pytest.raises(ValueError, match="Unrecognized configuration class"):  # vanilla's, naming no class
        AutoModelForCausalLM.from_config(config)


def test_a_head_hf_rtp_does_not_load_is_refused_by_name():
    config, vanilla_class = _saved_as(AutoModelForQuestionAnswering)
    with pytest.raises(
        hf_rtp.UnsupportedModelError,
        match=rf"is a {vanilla_class.__name__} .*hf_rtp does not load ForQuestionAnswering heads. Supported classes",
    ):
        model_class(None, config)
    for unsupported in (AutoModelForQuestionAnswering, AutoModelForMaskedLM):
        with pytest.raises(
            hf_rtp.UnsupportedModelError,
            match=rf"^hf_rtp does not load {unsupported.__name__}; supported classes: {SUPPORTED_NAMES}$",
        ):
            model_class(unsupported, tiny_llama_config())
    assert AutoModelForImageTextToText in SUPPORTED


def _empty(auto_class, **overrides):
    with init_empty_weights():
        return auto_class.from_config(tiny_llama_config(**overrides))


def test_only_a_missing_head_outside_the_backbone_of_a_classifier_is_fresh(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "causal")
    for auto_class in (AutoModelForSequenceClassification, AutoModelForTokenClassification):
        _, info = auto_class.from_pretrained(ckpt, num_labels=3, output_loading_info=True)
        missing = sorted(info["missing_keys"])  # what vanilla initialises newly
        model = _empty(auto_class, num_labels=3)
        rotated = plans.get("llama").resolve(model).rotated_params
        assert missing and fresh_head(model, missing, rotated) == missing, auto_class.__name__
        # a checkpoint that also lacks backbone weights is not a causal LM's: nothing is invented, the load fails
        assert fresh_head(model, [*missing, "model.norm.weight"], rotated) == []
        # nor is a rotated parameter ever drawn whole on one rank
        assert fresh_head(model, missing, rotated | {missing[0]}) == []
        assert fresh_head(model, [], rotated) == []
    causal = _empty(AutoModelForCausalLM)
    assert is_causal_lm(causal) and not is_causal_lm(model)
    assert fresh_head(causal, ["lm_head.weight"], set()) == []  # a causal LM's head is never invented


def test_a_fresh_head_at_world_size_1_is_vanillas_draw(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "causal")
    torch.manual_seed(0)
    vanilla = AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=2, dtype=torch.float64)
    torch.manual_seed(0)
    model = hf_rtp.AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=2, dtype=torch.float64)
    assert model.score.weight.dtype == torch.float64
    assert torch.equal(model.score.weight, vanilla.score.weight)
    ids = torch.tensor([[3, 5, 7, 9]])
    torch.testing.assert_close(model(ids).logits, vanilla(ids).logits, rtol=0, atol=0)
