"""PEFT paths that compute from a rotated layer's whole weight: refused by name on every rank, where they crashed
(LoRA initialisations that read the base weight: PiSSA, OLoRA, MiCA on an embedding, ...) or gave wrong weights
without an error (IA3's, OFT's and BOFT's merges, DoRA's on an embedding). LoHa's merge, which is left to PEFT,
equals vanilla PEFT's."""

import pytest
import torch
from support.models import make_tiny
from support.spawn import run_on_ranks


def _refusals(ckpt, mixtral):
    from peft import BOFTConfig, IA3Config, LoHaConfig, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_rtp

    said = {}
    # on a linear and on the embedding, whose LoRA layer has a mica_init of its own
    for init, target in (("pissa", "q_proj"), ("olora", "q_proj"), ("mica", "embed_tokens")):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
        with pytest.raises(hf_rtp.RotatedStateError) as refused:
            get_peft_model(model, LoraConfig(r=4, target_modules=[target], init_lora_weights=init))
        said[init] = str(refused.value)
    dora = get_peft_model(
        hf_rtp.from_pretrained(ckpt, dtype=torch.float64),
        LoraConfig(r=4, target_modules=["embed_tokens"], use_dora=True, init_lora_weights=False),
    )
    with pytest.raises(hf_rtp.RotatedStateError) as refused:  # DoRA on the embedding merged wrong weights
        dora.merge_and_unload()
    said["dora embedding"] = str(refused.value)
    # LoRA on the rotated experts' parameters: PEFT parametrizes them away from where the layer reads them
    experts = get_peft_model(
        hf_rtp.from_pretrained(mixtral, dtype=torch.float32, experts_implementation="eager"),
        LoraConfig(r=2, target_modules=[], target_parameters=["experts.gate_up_proj"]),
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(hf_rtp.RotatedStateError) as refused:
        experts(input_ids=ids, labels=ids)
    said["experts"] = str(refused.value)
    ia3 = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False)
    boft = BOFTConfig(target_modules=["q_proj"], boft_block_size=4, init_weights=False)
    for name, config in (("ia3", ia3), ("boft", boft)):
        model = get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), config)
        with pytest.raises(hf_rtp.RotatedStateError) as refused:
            model.merge_and_unload()
        said[name] = str(refused.value)
    # a user's LoRA layer class, defined after PEFT's import and hf_rtp's load, with a merge of its own
    from peft.tuners.lora.layer import Linear as LoraLinear

    class OwnMerge(LoraLinear):
        def merge(self, safe_merge=False, adapter_names=None):
            self.merged_adapters.extend(adapter_names or self.active_adapters)  # would add B @ A to the rows

    own = LoraConfig(r=4, target_modules=["q_proj"])
    own._register_custom_module({torch.nn.Linear: OwnMerge})
    custom = get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), own)
    with pytest.raises(hf_rtp.RotatedStateError) as refused:
        custom.merge_and_unload()
    said["own merge"] = str(refused.value)
    # LoHa: merged by PEFT itself, on the rows each rank holds, as vanilla merges the whole weight
    loha = LoHaConfig(r=4, target_modules=["q_proj", "down_proj"], init_weights=False)
    torch.manual_seed(0)
    ours = get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), loha).merge_and_unload()
    torch.manual_seed(0)
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), loha).merge_and_unload()
    merged = dict(theirs.named_parameters())
    gap = max(
        float((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().sub(merged[n].detach()).abs().max())
        for n, p in ours.named_parameters()
    )
    return said, gap


def test_peft_paths_that_need_the_whole_weight_are_refused_and_loha_merges_as_vanilla(tmp_path):
    mixtral = make_tiny("mixtral", tmp_path / "mixtral")
    for said, gap in run_on_ranks(_refusals, 2, make_tiny("llama", tmp_path / "ckpt"), mixtral):
        assert "init_lora_weights='pissa') on a rotated layer is not supported" in said["pissa"], said
        assert "init_lora_weights='olora')" in said["olora"], said
        assert "init_lora_weights='mica')" in said["mica"], said
        assert "merging DoraEmbeddingVariant adapters" in said["dora embedding"], said
        assert "adapters on rotated expert weights are not supported" in said["experts"], said
        assert "merging IA3" in said["ia3"] or "merging Linear (peft.tuners.ia3" in said["ia3"], said
        assert "peft.tuners.boft" in said["boft"], said
        assert "merging OwnMerge" in said["own merge"], said  # wrapped at its first layer, though defined late
        assert gap < 1e-12, gap
