"""Context parallelism across the families of the zoo: each one trains as vanilla does on the whole sequence, or is
refused by name on every rank. A family whose attention ring attention does not reproduce (a sliding window shorter
than the sequence, soft-capping, sinks, a model that calls SDPA itself) must never train silently on each rank's
chunks alone."""

from __future__ import annotations

import pytest
import torch
from support.compare import GRAD_ATOL, GRAD_RTOL, assert_matches
from support.spawn import run_on_ranks
from support.zoo import AUTO, ZOO, make_zoo_checkpoint

REFUSED = {
    "mistral": "sliding window of 4 tokens, shorter than the sequence",
    "gemma3_text": "sliding window of 4 tokens",
    "starcoder2": "sliding window of 4 tokens",
    "gemma2": "transformers has no SDPA attention for it",
    "gpt_oss": "transformers has no SDPA attention for it",
    "falcon": "call SDPA themselves",
    "qwen2_moe": "output_router_logits=True is not supported",
    "qwen3_moe": "output_router_logits=True is not supported",
    "mixtral": "output_router_logits=True is not supported",
}
EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def _families(paths: dict) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    seen = {}
    for name, path in paths.items():
        extra: dict = {"experts_implementation": "eager"} if name in EXPERTS else {}
        sdpa = {} if name in ("gemma2", "gpt_oss") else {"attn_implementation": "sdpa"}  # vanilla refuses sdpa there
        plan = {"plan": "auto"} if name in AUTO else {}
        model = hf_rtp.from_pretrained(path, dtype=torch.float64, **sdpa, **plan, **extra).train()
        ids = torch.randint(3, 101, (2, 11), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids.clone()}
        try:
            with hf_rtp.context_parallel(model, batch):
                loss = model(**batch).loss
                loss.backward()
        except hf_rtp.SettingError as refused:
            seen[name] = str(refused)
            continue
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **sdpa, **extra).train()
        ref_loss = ref(input_ids=ids, labels=ids)["loss"]
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, atol=1e-7, rtol=1e-6, msg=name)
        hf_rtp.sync_grads(model)
        assert_matches(model, ref, dist.get_world_size(), dist.get_rank(), "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)
        seen[name] = "equal"
    return seen


FAMILIES = sorted(ZOO)


@pytest.mark.parametrize("half", [0, 1], ids=["first-half", "second-half"])
def test_every_family_trains_as_vanilla_or_is_refused_by_name(tmp_path, half):
    names = FAMILIES[half::2]
    paths = {name: make_zoo_checkpoint(name, tmp_path / name) for name in names}
    for seen in run_on_ranks(_families, 2, paths):
        for name in names:
            if name in REFUSED:
                assert REFUSED[name] in seen[name], (name, seen[name])
            else:
                assert seen[name] == "equal", (name, seen[name])
