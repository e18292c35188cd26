"""Bad input ends in a clear error that names the fix: never a traceback from deep inside, never a hang."""

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

import hf_rtp


def test_unknown_architecture_lists_supported(tmp_path):
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    config = Starcoder2Config(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    Starcoder2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(
        hf_rtp.UnsupportedModelError,
        match=r"model_type 'starcoder2'.*Supported: deepseek_v3, .*gpt2, .*"
        r"llama, .*qwen3_moe.*plan='auto'",
    ):
        hf_rtp.from_pretrained(tmp_path)


class _Boobytrap:
    """Unpickling this creates a marker file: proof that a loader ran pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_only_checkpoint_is_refused_unopened(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    os.remove(os.path.join(ckpt, "model.safetensors"))
    marker = tmp_path / "unpickled"
    with open(os.path.join(ckpt, "pytorch_model.bin"), "wb") as f:
        pickle.dump(_Boobytrap(str(marker)), f)
    with pytest.raises(hf_rtp.CheckpointError, match=r"only pickle weights \(pytorch_model.bin\).*safetensors"):
        hf_rtp.from_pretrained(ckpt)
    assert not marker.exists()


def test_truncated_safetensors(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    path = os.path.join(ckpt, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"model.safetensors .*truncated or corrupted.*download or save it again"
    ):
        hf_rtp.from_pretrained(ckpt)


def test_corrupt_safetensors_header(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    with open(os.path.join(ckpt, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage")
    with pytest.raises(hf_rtp.CheckpointError, match=r"not a valid safetensors file \(header is not JSON"):
        hf_rtp.from_pretrained(ckpt)


def test_shard_named_in_index_is_missing(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt", max_shard_size="12KB")
    shard = sorted(f for f in os.listdir(ckpt) if f.startswith("model-"))[1]
    os.remove(os.path.join(ckpt, shard))
    with pytest.raises(hf_rtp.CheckpointError, match=rf"missing file\(s\) {shard}: the download is incomplete"):
        hf_rtp.from_pretrained(ckpt)


def test_tensor_shape_disagrees_with_config(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    config_path = os.path.join(ckpt, "config.json")
    config = json.loads(Path(config_path).read_text())
    config["intermediate_size"] += 8
    Path(config_path).write_text(json.dumps(config))
    with pytest.raises(
        hf_rtp.CheckpointError,
        match=r"mlp\.\w+_proj\.weight has shape \[(40, 32|32, 40)\].*config.json gives \[(48, 32|32, 48)\]",
    ):
        hf_rtp.from_pretrained(ckpt)


def _topology_errors(ckpt):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    errors = []
    dist.init_process_group("gloo")
    mesh_2d = init_device_mesh(
        "cpu", (1, 2), mesh_dim_names=("replica", "shard")
    )  # a 2-D mesh must say which dim rings
    for mesh in (mesh_2d, mesh_2d["replica"]):
        try:
            hf_rtp.from_pretrained(ckpt, device_mesh=mesh)
        except hf_rtp.TopologyError as err:
            errors.append(str(err))
    os.environ["WORLD_SIZE"] = "3"  # a launcher that disagrees with the group already running
    try:
        hf_rtp.from_pretrained(ckpt)
    except hf_rtp.TopologyError as err:
        errors.append(str(err))
    return errors


def test_world_size_disagreeing_with_mesh_or_launcher(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    for errors in run_on_ranks(_topology_errors, 2, ckpt):
        assert len(errors) == 3
        assert "needs a 1-D mesh or a 2-D one with dims named ('dp', 'rtp'), got dims ('replica', 'shard')" in errors[0]
        assert "the device mesh has 1 ranks but the process group has 2" in errors[1]
        assert "WORLD_SIZE=3 but the initialised process group has 2 ranks" in errors[2]


def _rank1_dies_after_loading(ckpt):
    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    if rank == 1:
        os._exit(0)  # gone without a word, as a crashed or killed rank would be
    batch = global_batch(2)[rank]
    start = time.monotonic()
    try:
        for _ in range(3):
            model(input_ids=batch, labels=batch).loss.backward()
    except RuntimeError as err:
        return time.monotonic() - start, str(err)
    return None


def test_dead_rank_is_an_error_within_the_timeout(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    from support import spawn

    # rank 1 exits without reporting; collect rank 0's outcome directly
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = spawn.free_port()
    env = {"HF_RTP_TIMEOUT": "10"}
    procs = [
        ctx.Process(
            target=spawn._worker, args=(r, 2, port, _rank1_dies_after_loading, (ckpt,), dict(os.environ), env, results)
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    rank, ok, value = results.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert (rank, ok) == (0, True) and value is not None, value
    seconds, message = value
    assert seconds < 30, "the survivor waited longer than the collective timeout"
    # a peer that is gone is said to be gone, with the time actually waited, not blamed on a skipped call
    assert "lost another rank after" in message and "rank 1's process exited or was killed" in message, message
    assert "HF_RTP_ENTRY_TIMEOUT" not in message, message


def _on_another_host(name: str) -> None:
    """This process alone now runs on host `name`: a UTS namespace of its own (CAP_SYS_ADMIN, as root), so
    the other ranks see another host, whose processes they cannot look up."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x04000000) != 0 or libc.sethostname(name.encode(), len(name)) != 0:  # CLONE_NEWUTS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) needs CAP_SYS_ADMIN: run the suite as root")


def _rank2_on_another_host_leaves(ckpt, how):
    rank = int(os.environ["RANK"])
    if rank == 2:
        _on_another_host("node-b")
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    if rank == 2:
        if how == "exits":
            os._exit(0)
        time.sleep(600)  # lingers without calling forward; killed by run_on_ranks
    batch = global_batch(3)[rank]
    start = time.monotonic()
    with pytest.raises(hf_rtp.CollectiveMisuseError) as err:
        model(input_ids=batch, labels=batch)
    seconds = time.monotonic() - start
    # rank 0's process hosts the launcher's store (no torchrun agent here): it stays until rank 1 has its
    # error too, or a slow rank 1 would lose the store and rank 0, not rank 2, in its roll call
    store = torch.distributed.distributed_c10d._get_default_store()
    store.add("survivors done", 1)
    deadline = time.monotonic() + 120
    while rank == 0 and store.add("survivors done", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return seconds, str(err.value)


@pytest.mark.parametrize("how", ["exits", "lingers"])
def test_a_rank_gone_on_another_host_is_named(tmp_path, how):
    """Its process cannot be looked up from here: the ranks that came call the roll in the launcher's store."""
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    env = {"HF_RTP_ENTRY_TIMEOUT": "5"}
    for seconds, message in run_on_ranks(_rank2_on_another_host_leaves, 3, ckpt, how, env=env, survivors=(0, 1)):
        assert "rank 2 on node-b, which did not answer within 5 s" in message, message
        if how == "exits":
            assert "lost another rank after" in message and "exited or was killed" in message, message
        else:
            assert "waited 5 s" in message and "gone, stopped or in another call" in message, message
        assert seconds < 5 + 5 + 10, seconds  # the entry timeout, the roll call, and slack


def _rank0_elsewhere_rank3_exits(ckpt):
    rank = int(os.environ["RANK"])
    if rank == 0:
        _on_another_host("node-a")
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, rtp_size=2).train()  # 2 replicas of a 2-rank ring
    if rank == 3:
        os._exit(0)
    batch = global_batch(4)[rank]
    with pytest.raises(hf_rtp.CollectiveMisuseError) as err:
        model(input_ids=batch, labels=batch)
    return str(err.value)


def test_ranks_that_found_the_gone_rank_on_their_host_still_answer_the_roll_call(tmp_path):
    """Ranks 1 and 2 see rank 3's process gone on their own host; rank 0, on another, calls the roll: it must
    name rank 3 alone, which it can only if 1 and 2 answer although they need no roll call themselves."""
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    messages = run_on_ranks(
        _rank0_elsewhere_rank3_exits, 4, ckpt, env={"HF_RTP_ENTRY_TIMEOUT": "5"}, survivors=(0, 1, 2)
    )
    assert "the process of rank 3 on " in messages[0] and "did not answer within 5 s" in messages[0], messages[0]
    for message in messages[1:]:  # rank 2 may have failed and exited before rank 1 looks at /proc
        assert "rank 3's process exited or was killed" in message or "ranks 2, 3" in message, message


def test_path_that_is_neither_folder_nor_cached_hub_model(tmp_path):
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"is not a local directory and could not be fetched.*HF_HUB_OFFLINE"
    ):
        hf_rtp.from_pretrained(str(tmp_path / "no-such-model"))


def test_token_ids_outside_the_vocabulary_fail_like_vanilla(tmp_path):
    from support.models import VOCAB

    from hf_rtp.distributed.transport.ring import Ring
    from hf_rtp.layers import RotatedEmbedding

    vanilla = torch.nn.Embedding(VOCAB, 4)
    rotated = RotatedEmbedding(vanilla, ring=Ring(None), weight=vanilla.weight)
    with pytest.raises(RuntimeError, match=rf"token ids must lie in \[0, {VOCAB}\)"):
        rotated(torch.tensor([[1, VOCAB]]))
