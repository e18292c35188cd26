"""Run under torchrun by test_two_launchers.py: a rank of a multi-node job, one step against vanilla.

Loads `org/tiny` by Hub id from this node's own cache (HF_HUB_CACHE, offline) with rtp_size=2,
takes one AdamW step on its own batch while vanilla takes it on the global batch (support.compare
checks gradients and parameters), saves collectively, and writes what it saw to OUT/rank-R.json.

It exits without destroy_process_group, as most scripts do: hf_rtp made the world group, and tears it down at
exit after its own groups. OUT/exit-R.json says whether the world group was still up after hf_rtp's exit handler
(registered after this script's, so run before it). Left to interpreter shutdown, a gloo group once aborted a
process after its work succeeded ("terminate called without an active exception").
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_dir: str) -> None:
    import atexit

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    def at_exit() -> None:
        with open(os.path.join(out_dir, f"exit-{os.environ['RANK']}.json"), "w") as f:
            json.dump({"initialized": dist.is_initialized()}, f)

    atexit.register(at_exit)  # before hf_rtp makes the world group and registers its own handler

    import hf_rtp
    from hf_rtp.model.state import state_of
    from support.compare import DTYPE, adamw, save_and_check_reload, step_both
    from support.models import global_batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained("org/tiny", dtype=DTYPE, rtp_size=2).train()
    ref = AutoModelForCausalLM.from_pretrained("org/tiny", revision="a" * 40, dtype=DTYPE).train()
    topology = state_of(model).topology
    loss = step_both(model, ref, adamw(model, ref), global_batch(world), rank)
    save_and_check_reload(model, os.path.join(out_dir, "saved"), rank)
    seen = {"dp": topology.dp_rank, "rtp": topology.rtp_rank, "loss": loss, "read": model.config._name_or_path}
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
