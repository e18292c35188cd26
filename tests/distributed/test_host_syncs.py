"""No host synchronisation in a training step's rotated ops, nor in a decode step's (issue 50, point 3).

On CUDA, an op whose result the host reads (a Python scalar, a boolean mask's size, a tensor as a list) waits
for everything queued on the device before it, and the transfers and kernels behind it stop overlapping. The
ops that would wait are counted here on the CPU: a TorchDispatchMode records `aten._local_scalar_dense`
(item(), int(), float(), bool()), `aten.item`, `aten.nonzero`, `aten.masked_select` and `index` / `index_put`
with a boolean mask, and a TorchFunctionMode `Tensor.tolist` (no aten op on the CPU; a backward runs beyond its
reach), each at the place whose code made it: its innermost frame outside torch, in hf_rtp or elsewhere.

One training step of a rotated Llama at 2 ranks, in 4 KB pieces so every walk has several (the embedding, every
linear, the LM head with the fused loss and without; backward, sync_grads, an AdamW step), and each forward of
a 2-token greedy decode, weights moved or tokens, make no such op in hf_rtp but at the places ALLOWED names,
and no more elsewhere than vanilla makes on the same batch in the same run. The same for GPT-2 (Conv1D, a
tied head). The whole step as users run it (issue 66: forward with labels, backward, sync_grads, clip_grad_norm_,
AdamW as torch picks it on the CPU and on CUDA) against vanilla under DDP, Llama and Mixtral, weights moving and
tokens moving; a profiled step there checks that the recorder missed no read inside DTensor's ops or torch's C++.
An op that sees more tokens than its forward brought (MLA's cached latents) reads its walk's count once on every
rank, and where one rank would read and another not, every rank fails. docs/reliability.md ("Host
synchronisations in a training step") lists each wait in a step and its cost.
"""

from __future__ import annotations

import collections
import os
import traceback

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks
from support.user_step import user_step
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PIECE = "4KB"
_TORCH = os.path.dirname(torch.__file__) + os.sep
_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "hf_rtp") + os.sep
_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "equal", "is_nonzero"}
_MASKED = {"index", "index_put_", "index_put", "_index_put_impl_"}
_RECORDING = {"_place", "record", "__torch_dispatch__", "__torch_function__"}  # the modes' own frames

# where hf_rtp may read on the host, with why; the most reads allowed per forward (None: any, host memory only)
ALLOWED = {
    "distributed/ranks/rendezvous.py": (
        None,
        "a forward's and generate's meeting: CPU tensors gathered on the gloo entry group, read in host memory",
    ),
    "layers/embedding.py __init__": (
        1,
        "the embedding's tokens sorted by id once per forward, their positions at the pieces' boundaries read in one "
        "transfer, where looking every token up in every piece would cost more (tokens x pieces > _FEW)",
    ),
    "model/equal_copies.py": (
        None,
        "replicated parameters compared across ranks once in their life, at the first sync_grads that averages them "
        "(or made rank 0's at the first forward that sees them): flags copied to the host in one transfer, read there",
    ),
    "model/forward.py of": (
        1,
        "the fused loss takes the tokens that have labels once per training forward, so the LM head's walks skip the "
        "ignored ones, by their count: counted at the forward's start and copied to host memory there without "
        "waiting (on CUDA, an event behind the batch alone); on the CPU the recorder cannot tell that from a read",
    ),
}
# an op that sees more tokens than its forward brought: every rank reads the walk's count, once per walk
SEES_A_CACHE = "distributed/transport/token_walk.py _largest"
# routing by the experts' token counts, once per MoE layer per forward (tolist of the experts' counts), so that each
# held expert runs its own rows: vanilla's eager experts read too (nonzero of the experts hit, then one per expert
# hit), its default grouped_mm reads nothing on CUDA (offsets on the device): against that, hf_rtp adds these
ROUTING = "layers/experts.py __init__"


class Reads(TorchDispatchMode):
    """Counts the ops that wait for a CUDA device, by (phase, op, place); `phase` is set by the caller."""

    def __init__(self):
        super().__init__()
        self.phase = "step"
        self.counts: collections.Counter = collections.Counter()
        self.asserts = 0  # torch._assert_async: on CUDA a device-side assertion, no wait; on the CPU it reads its flag
        self._tolist = _ToList(self)

    def __enter__(self):
        self._tolist.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._tolist.__exit__(*exc)

    def record(self, op: str) -> None:
        self.counts[self.phase, op, _place()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _READS or (name in _MASKED and _boolean(args[1])):
            self.record(name if name in _READS else f"{name}[bool]")
        self.asserts += name == "_assert_async"
        return func(*args, **(kwargs or {}))


class _ToList(TorchFunctionMode):
    def __init__(self, reads: Reads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "tolist":
            self.reads.record("tolist")
        return func(*args, **(kwargs or {}))


def _boolean(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _place() -> str:
    """'distributed/transport/token_walk.py token_walk' for a read hf_rtp's code makes; 'elsewhere' for one whose
    innermost frame outside torch is not hf_rtp's (transformers, the optimizer's caller, autograd's own backward)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_TORCH) or (frame.filename == __file__ and frame.name in _RECORDING):
            continue
        if frame.filename.startswith(_PACKAGE):
            return f"{frame.filename[len(_PACKAGE) :]} {frame.name}"
        return "elsewhere"
    return "elsewhere"


def _per_forward(model, reads: Reads) -> list:
    """Count each forward of `model` as a phase of its own ('forward 0', ...), and what runs between as 'loop'."""
    forwards = iter(range(1000))

    def before(*_):
        reads.phase = f"forward {next(forwards)}"

    def after(*_):
        reads.phase = "loop"

    return [model.register_forward_pre_hook(before), model.register_forward_hook(after)]


def _trained(model, batch, rotated: bool) -> collections.Counter:
    import hf_rtp

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Reads() as reads:
        model(input_ids=batch, labels=batch).loss.backward()
        if rotated:
            hf_rtp.sync_grads(model)
        optimizer.step()
    return reads.counts


def _decoded(model, prompts, ring=None):
    settings = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    reads = Reads()
    hooks = _per_forward(model, reads)
    walks = ring.token_walks if ring is not None else 0
    with reads, torch.no_grad():
        reads.phase = "loop"
        tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
    for hook in hooks:
        hook.remove()
    return reads.counts, tokens, (ring.token_walks - walks if ring is not None else 0)


def _step_and_decode(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world)[rank]
    # float64: greedy decoding is an argmax, which a float32 near-tie could flip on summation order alone
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)  # vanilla trains a step below
    prompts = global_batch(world, batch=1 + rank, seq=4 + rank, seed=7)[rank]  # each rank its own shapes
    found = {}
    found["decode vanilla"], expected, _ = _decoded(vanilla, prompts)
    found["train vanilla"] = _trained(vanilla.train(), batch, rotated=False)
    for fused in (True, False):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_piece_size=PIECE, fused_loss=fused).train()
        found[f"train fused_loss={fused}"] = _trained(model, batch, rotated=True)
        del model
    walks = {}
    for moves in ("weights", "activations"):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_piece_size=PIECE, rotation_moves=moves)
        if moves == "weights":  # outside a forward the embedding's weights walk, in pieces: every value vanilla's
            with torch.no_grad():
                embedded = model.get_input_embeddings()(batch)
            assert torch.equal(embedded, reference.get_input_embeddings()(batch)), f"rank {rank}: embedding differs"
        found[f"decode {moves}"], tokens, walks[moves] = _decoded(model, prompts, hf_rtp.state_of(model).topology.ring)
        assert torch.equal(tokens, expected), f"{moves}, rank {rank}: {tokens.tolist()} != {expected.tolist()}"
        del model
    assert walks["weights"] == 0 and walks["activations"] > 0, walks  # both ways were walked
    return {case: dict(counts) for case, counts in found.items()}


def _unexpected(found: dict, allowed: dict) -> list[str]:
    """What a rotated case reads beyond ALLOWED (and `allowed`, extra places for this test) and vanilla's reads."""
    wrong = []
    for case, counts in found.items():
        if "vanilla" in case:
            continue
        theirs = found[case.split()[0] + " vanilla"]
        for (phase, op, place), n in counts.items():
            if place == "elsewhere":
                if phase != "loop" and n > theirs.get((phase, op, place), 0):  # generate's own loop: synced_gpus
                    wrong.append(
                        f"{case}, {phase}: {n} x {op} outside hf_rtp, vanilla {theirs.get((phase, op, place))}"
                    )
                continue
            rule = next((r for prefix, r in {**ALLOWED, **allowed}.items() if place.startswith(prefix)), None)
            if rule is None or (rule[0] is not None and n > rule[0]):
                wrong.append(f"{case}, {phase}: {n} x {op} at {place}")
    return wrong


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_training_step_and_a_decode_step_wait_for_the_device_no_more_than_vanilla(tmp_path, arch):
    ckpt = make_tiny(arch, tmp_path / "ckpt")
    for rank, found in enumerate(run_on_ranks(_step_and_decode, 2, ckpt)):
        assert not _unexpected(found, {}), (rank, _unexpected(found, {}))
        # the training forward's one allowed read is there: the fused loss ran
        assert any(place.startswith("model/forward.py") for _, _, place in found["train fused_loss=True"]), rank


def _step_moving_tokens(ckpt):
    """A training step whose embedding and fused head move the tokens, forward and backward (rotation_moves
    "activations", a vocabulary whose chunk leaves the tokens room in the slots), beside vanilla's."""
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.distributed.transport.ring import Ring
    from hf_rtp.distributed.transport.token_walk import TOKEN_GRAD_TAG

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world)[rank]
    found = {
        "train vanilla": _trained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).train(), batch, False)
    }
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_moves="activations").train()
    tags: list[int] = []
    exchange = Ring.exchange

    def recorded(self, send, recv, tag):
        tags.append(tag)
        return exchange(self, send, recv, tag)

    Ring.exchange = recorded
    try:
        found["train activations"] = _trained(model, batch, rotated=True)
    finally:
        Ring.exchange = exchange
    # the embedding's tokens visited; weights walked only in the layers' backward, each with its gradients (a head
    # walking its weights forward would add a weights hop alone; test_tokens_in_backward.py counts each way)
    assert tags.count(TOKEN_GRAD_TAG) == world - 1 and tags.count(0) == tags.count(64), tags
    return {case: dict(counts) for case, counts in found.items()}


def test_a_training_step_that_moves_its_tokens_waits_for_the_device_no_more_than_vanilla(tmp_path):
    """The embedding's visiting gradients and the fused head's token walks, forward and backward, read nothing."""
    ckpt = make_tiny("llama", tmp_path / "ckpt", vocab_size=1009)
    for rank, found in enumerate(run_on_ranks(_step_moving_tokens, 2, ckpt)):
        assert not _unexpected(found, {}), (rank, _unexpected(found, {}))


# What the profiler names the ops that read on the host (it sees them inside DTensor's ops and C++ too)
_PROFILED = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero", "aten::masked_select"}


def _recorded_steps(model, batch, labels, foreach, rotated: bool) -> tuple[list[dict], int]:
    """Three steps of AdamW (`foreach`: torch's pick, None, or True, CUDA's pick): the first two recorded (the first
    one makes what a model does once in its life), the third profiled. Returns each recorded step's reads, and what the
    profiler saw beyond the second's reads and assertions (the recorder sees an op's arguments, not the ops an op
    runs inside it: DTensor's own, a C++ kernel's), which is 0 when the recorder saw every read."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    found = []
    for _ in range(2):
        with Reads() as reads:
            user_step(model, batch, labels, optimizer, rotated, reads, foreach)
        found.append(dict(reads.counts))
    seen = sum(n for (_, op, _), n in found[1].items() if op != "tolist") + reads.asserts  # tolist: no aten op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        user_step(model, batch, labels, optimizer, rotated, None, foreach)
    return found, sum(event.name in _PROFILED for event in profiler.events()) - seen


def _whole_steps(ckpt, dtype_name: str):
    """A training step as users run it (`user_step`), of hf_rtp's model with its weights moving and with its tokens
    moving, and of vanilla's under DDP on the same batch (a masked prompt), with AdamW as torch picks it on the CPU
    and as it picks it on CUDA (foreach): the reads of each step by phase, what the recorder did not see, and how
    many token walks the rotated steps made."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dtype = getattr(torch, dtype_name)
    batch = global_batch(world)[rank]
    labels = batch.clone()
    labels[:, :3] = -100  # a prompt without labels: the fused loss skips its tokens
    # weights in 4 KB pieces (several a walk); tokens in the default pieces' slots, which they fit
    pieces = {"weights": dict(rotation_piece_size=PIECE), "activations": {}}
    models = {
        moves: hf_rtp.from_pretrained(ckpt, dtype=dtype, rotation_moves=moves, **pieces[moves]).train()
        for moves in ("weights", "activations")
    }
    vanilla = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).train())
    found, unseen, walks = {}, {}, {}
    for foreach in (None, True):
        for name, model in (("vanilla", vanilla), *models.items()):
            rotated = name != "vanilla"
            ring = hf_rtp.state_of(model).topology.ring if rotated else None
            before = ring.token_walks if ring is not None else 0
            steps, unseen[foreach, name] = _recorded_steps(model, batch, labels, foreach, rotated)
            for i, counts in enumerate(steps):
                found[f"foreach={foreach},step={i} {name}"] = counts
            walks[foreach, name] = ring.token_walks - before if ring is not None else 0
    return found, unseen, walks


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_whole_training_step_waits_for_the_device_no_more_than_vanilla_ddps(tmp_path, arch):
    """Issue 66: a rotated model with its embedding and LM head rotated, at 2 ranks, weights moving and tokens
    moving, through the whole step users run (forward with labels, backward, sync_grads, clip_grad_norm_, AdamW),
    reads on the host only at the places ALLOWED names (the fused loss's count: a host copy), and elsewhere no
    more than vanilla transformers under DDP in the same step. clip_grad_norm_ over rotated gradients reads nothing
    (its norm's sum over the ring is one all-reduce of a scalar, queued on the device); the optimizer's reads are
    its CPU step counts, vanilla's too. Mixtral's routing reads the experts' counts once per MoE layer per forward
    (ROUTING), which vanilla's default grouped_mm does not. A profiled step finds no read the recorder missed."""
    dtype = "float32" if arch == "mixtral" else "float64"  # grouped_mm, vanilla's MoE default, takes no float64
    ckpt = make_tiny(arch, tmp_path / "ckpt", vocab_size=1009)  # the head's tokens fit a slot: they move too
    for rank, (found, unseen, walks) in enumerate(run_on_ranks(_whole_steps, 2, ckpt, dtype)):
        layers = 2  # tiny_config's num_hidden_layers
        routing = {ROUTING: (layers, "MoE routing, once a layer")} if arch == "mixtral" else {}
        assert not _unexpected(found, routing), (rank, _unexpected(found, routing))
        # hf_rtp's steps read nothing inside DTensor's ops or torch's C++ but their assertions (vanilla's grouped_mm
        # reads its offsets there, on the CPU only: CUDA's kernel takes them on the device)
        assert not any(n for (_, name), n in unseen.items() if name != "vanilla"), (rank, unseen)
        for foreach in (None, True):  # both ways walked: tokens moved in the activations steps only
            assert walks[foreach, "weights"] == 0 < walks[foreach, "activations"], (rank, walks)
        for case, counts in found.items():
            mine = {(phase, op, place): n for (phase, op, place), n in counts.items() if place != "elsewhere"}
            if "vanilla" in case:
                continue
            # the fused loss ran and read its count from host memory, not by nonzero; clip_grad_norm_ read nothing
            assert mine.get(("forward", "_local_scalar_dense", "model/forward.py of")) == 1, (rank, case, mine)
            assert not any(op == "nonzero" or phase == "clip_grad_norm_" for phase, op, _ in counts), (rank, case)
            routed = sum(n for (_, _, place), n in mine.items() if place == ROUTING)
            assert routed == (layers if arch == "mixtral" else 0), (rank, case, routed)


def _many_tokens(ckpt):
    """A training step on enough tokens that the embedding sorts them (tokens x pieces > _FEW): what it reads on
    the host, and its gradient's and output's distance from vanilla's (DDP's mean over both ranks' batches)."""
    from support.compare import backward_both, rows
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.layers.embedding import _FEW

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = list(global_batch(world, batch=8, seq=80, seed=5))
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_piece_size=PIECE, tie_word_embeddings=False)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, tie_word_embeddings=False)
    embed = model.model.embed_tokens
    pieces = hf_rtp.state_of(model).topology.ring.pieces(embed.layout, embed.weight)
    assert batches[rank].numel() * world * pieces > _FEW, pieces
    with Reads() as reads:
        reads.phase = "forward"
        embedded = model.get_input_embeddings()(batches[rank])
    assert torch.equal(embedded, ref.get_input_embeddings()(batches[rank])), rank  # bit for bit
    backward_both(model, ref, batches, rank)
    mine = embed.weight.grad.to_local()
    want = ref.model.embed_tokens.weight.grad[rows(embed.weight, world, rank)]
    return dict(reads.counts), (mine - want).abs().max().item(), want.abs().max().item()


def test_many_tokens_are_looked_up_by_one_read_a_forward_and_give_vanillas_gradient(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, (reads, gap, scale) in enumerate(run_on_ranks(_many_tokens, 2, ckpt)):
        assert reads == {("forward", "tolist", "layers/embedding.py __init__"): 1}, (rank, reads)
        assert gap <= 1e-12 * scale, (rank, gap, scale)


def _brought_on_a_grid(ckpt):
    """What each rank's ring records as its own forward's tokens, on 2 rings of 2 with every rank bringing its own
    count: the forward's meeting gathers the whole world, in global rank order, not the ring's."""
    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rtp_size=2)
    ring, seen = hf_rtp.state_of(model).topology.ring, []
    model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(ring.brought))
    with torch.no_grad():
        model(global_batch(4, batch=1 + rank, seq=3 + rank)[rank], logits_to_keep=1)  # the head: one a sequence
    return seen[0]


def test_on_a_two_dimensional_grid_each_rank_keeps_its_own_count(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, brought in enumerate(run_on_ranks(_brought_on_a_grid, 4, ckpt)):
        assert brought == ((1 + rank) * (3 + rank), 1 + rank), (rank, brought)


def _walks(wide: int, rows: int):
    """On each rank of a ring of two, an op that moves its tokens (F.linear on a rotated weight) with the counts a
    forward's start agreed on: how often it walked, what it read on the host, and its distance from vanilla's."""
    from hf_rtp.distributed.ranks.topology import setup
    from hf_rtp.distributed.tensors.sharding import ChunkLayout
    from hf_rtp.distributed.transport.weights_or_tokens import Traffic
    from hf_rtp.errors import CollectiveMisuseError
    from hf_rtp.layers.common import local, rotate_forward
    from hf_rtp.model.install import rotated_parameter
    from hf_rtp.settings import Settings

    topology = setup(Settings.resolve(device="cpu"))
    ring, rank = topology.ring, topology.rank
    whole = torch.randn(rows, wide, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layout = ChunkLayout((whole.shape,), ring.size)
    start, end = layout.bounds(rank)
    own = local(rotated_parameter(whole[start:end].clone(), whole.shape, topology)).detach()
    ring.plan(layout, own)

    def compute(tokens, into, rows_, chunk):
        into[:, rows_[0] : rows_[1]] = torch.nn.functional.linear(tokens[0], chunk[0])

    def run(tokens: int, bound: int, brought: int):
        x = torch.randn(tokens, wide, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
        out = torch.full((tokens, rows), float("nan"), dtype=torch.float64)
        ring.traffic = Traffic(bound=bound, head=bound, moves="activations", grad=False)
        ring.brought, walks = (brought, brought), ring.token_walks
        try:
            with Reads() as reads:
                rotate_forward(ring, [own], layout, [x], [0.0], out, compute, x.dtype)
        except (CollectiveMisuseError, RuntimeError) as err:
            return type(err).__name__, str(err)
        finally:
            ring.traffic, ring.brought = None, None
        error = (out - torch.nn.functional.linear(x, whole)).abs().max().item()
        return ring.token_walks - walks, dict(reads.counts), error

    return {
        # every op but one that sees a cache: no more than its forward brought, so no read
        "as brought": run(1 + rank, bound=2, brought=1 + rank),
        # MLA's expanded latents on every rank: each reads, and rank 1's 4 tokens make both walk again by 4
        "more than brought, everywhere": run(3 + rank, bound=2, brought=1 + rank),
        # rank 1 brings more than agreed to an op that, on rank 0, sees what its forward brought: rank 0 does not
        # read, so it cannot walk again; both fail, rank 0 by its device assertion
        "more than agreed, on one rank only": run(1 + 2 * rank, bound=2, brought=1),
        "after": run(1 + rank, bound=2, brought=1 + rank),  # nothing half-walked: the ring works on
    }


def test_a_walk_reads_its_count_only_where_an_op_sees_more_tokens_than_its_forward_brought():
    # 32 of 64 rows x 64 float64 per rank: a 16 KB slot, which holds a token walk of up to 4 rows per rank
    per_rank = run_on_ranks(_walks, 2, 64, 64)
    for rank, found in enumerate(per_rank):
        for case in ("as brought", "after"):
            walks, reads, error = found[case]
            assert walks == 1 and not reads and error < 1e-12, (rank, case, found[case])
        walks, reads, error = found["more than brought, everywhere"]
        assert walks == 2 and error < 1e-12, (rank, found)
        # one read: the walk again by the largest count, which no rank exceeds, reads nothing
        assert reads == {("step", "_local_scalar_dense", SEES_A_CACHE): 1}, (rank, reads)
        kind, message = found["more than agreed, on one rank only"]
        assert kind == ("RuntimeError" if rank == 0 else "CollectiveMisuseError"), (rank, kind, message)
        assert 'rotation_moves="weights"' in message and "[64, 64]" in message, message


def _decode_on_cached_latents(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    extra = dict(attn_implementation="eager", experts_implementation="eager")  # float64 kernels
    prompts = global_batch(world, batch=1 + rank, seq=4 + rank, seed=7)[rank]
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, **extra)
    found = {}
    found["decode vanilla"], expected, _ = _decoded(vanilla, prompts)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_moves="activations", **extra)
    found["decode activations"], tokens, walks = _decoded(model, prompts, hf_rtp.state_of(model).topology.ring)
    assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} != {expected.tolist()}"
    return {case: dict(counts) for case, counts in found.items()}, walks, model.config.num_hidden_layers


def test_an_op_on_cached_latents_reads_its_count_once_a_decode_step_on_every_rank(tmp_path):
    """DeepSeek-V3's kv_b_proj expands every cached latent at each decode step: more tokens than the step brought,
    on every rank, so each rank reads the walk's count (once: the walk again by that count cannot exceed it)."""
    from support.zoo import make_zoo_checkpoint

    ckpt = make_zoo_checkpoint("deepseek_v3", tmp_path / "ckpt")
    for rank, (found, walks, layers) in enumerate(run_on_ranks(_decode_on_cached_latents, 2, ckpt)):
        extra = {SEES_A_CACHE: (layers, "kv_b_proj, once a layer"), ROUTING: (None, "MoE routing")}
        assert walks > 0 and not _unexpected(found, extra), (rank, walks, _unexpected(found, extra))
        cached = {phase: n for (phase, _, place), n in found["decode activations"].items() if place == SEES_A_CACHE}
        assert cached == {"forward 1": layers}, (rank, cached)  # the prefill brings no cache: no read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch's sync debug mode watches CUDA's waits")
def test_the_embedding_looks_up_and_sums_on_cuda_without_waiting_for_the_device():
    """On CUDA, torch itself fails an op that waits for the device (set_sync_debug_mode): the embedding's lookup
    and its gradient sum on a ring of one (one piece, every id a hit, the padding row's gradient dropped) make
    none, and give vanilla's lookup bit for bit and its gradient."""
    import torch.nn.functional as F

    from hf_rtp.distributed.tensors.sharding import ChunkLayout
    from hf_rtp.distributed.transport.ring import Ring
    from hf_rtp.layers.embedding import _RotatedEmbeddingFn

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(101, 32, generator=generator).cuda().requires_grad_()
    vanilla = weight.detach().clone().requires_grad_()
    ids = torch.randint(0, 101, (4, 9), generator=generator).cuda()
    ids[0, :3] = 5  # the padding index, repeated
    grad = torch.randn(4, 9, 32, generator=generator).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _RotatedEmbeddingFn.apply(ids, weight, Ring(None), ChunkLayout((weight.shape,), 1), 5)
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = F.embedding(ids, vanilla, padding_idx=5)
    expected.backward(grad)
    assert torch.equal(out, expected)
    torch.testing.assert_close(weight.grad, vanilla.grad)
