"""Step time per rank of DDP, FSDP2 and RTP from config.json alone: `hf-rtp estimate MODEL --speed` (its options
and report: speed_report.py).

    hf-rtp estimate ./llama-3.1-8b --world-size 8 --batch 2 --seq 8192 --speed --recompute selective

One training step per rank of a Llama-shaped decoder, on hardware whose every constant is printed and can be
overridden (`HARDWARE`; H100 SXM with NVLink by default). Mixed precision as cost.py counts it: bf16 autocast over
float32 weights (weights travel in bf16, gradients in float32), or everything in float32 (`precision`).

compute   FLOPs as MFU figures count them (PaLM's appendix B; torchtitan's get_num_flop_per_token): 2 per weight per
          token for a matmul's forward, twice that in backward, attention's forward 4 x seq x heads x head_dim per
          token (the causal mask not discounted), over the FLOP rate. Recomputation adds the forward FLOPs it
          repeats: `full` (transformers' gradient checkpointing, the one hf_rtp runs) a decoder layer's whole
          forward; `selective` torchtitan's op policy (every second matmul of a layer recomputed, attention's output
          kept): k, o and up of a Llama layer, and on RTP's four walks o and down, each walking the ring again.
          hf_rtp's fused loss recomputes the head's logits in backward: a fourth head matmul.
bytes     cost.py's: weights in the dtype they travel in, gradients in float32.
overlap   DDP: gradient buckets (25 MiB, the first 1 MiB) all-reduced one after another as backward makes them,
          beside the rest of backward. FSDP2: a layer's all-gather runs during the previous layer's compute (forward
          and backward), its reduce-scatter during the next layer's backward; the root (embeddings, head) is gathered
          first and kept through backward. RTP as hf_rtp/distributed/transport/ring.py walks: a chunk larger than the
          piece size walks as several pieces, one walk each; a forward step's hop runs beside the matmul on the piece
          held and nothing else; a backward step's weight hop beside both of its matmuls, its gradient accumulator's
          hop beside the input-gradient matmul only; each step waits for its hops (a walk's serial dependence).
host      each ring hop costs the host `host_hop_s`, each collective `host_collective_s`. The host issues work ahead
          of the GPU, which waits only where the host is slower: simulated op by op for RTP.
Two kinds of hardware do not overlap: ranks time-slicing one GPU (`slice_s`: every message a rank waits for costs
time slices, as measured) and a CPU (`cores`: compute, messages and host work share the cores, one after another).
Not counted: kernel launches outside the ring's hops, the optimizer step, pointwise ops' recomputation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..settings import DEFAULT_PIECE_SIZE, parse_size
from .cost import GRAD_BYTES, WEIGHT_BYTES

MIB = 2**20
DDP_BUCKETS = (1 * MIB, 25 * MIB)  # DDP's first bucket, then bucket_cap_mb's default
NCCL_P2P_STEP = 4 * MIB  # NCCL_BUFFSIZE: point-to-point data moves in steps of this (a time slice each when shared)
GOAL_HOST_HOP_S = 50e-6  # the ring's goal for its host time per hop
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Hardware:
    """What a rank's device and link do; each field is a `--` option of `hf-rtp estimate --speed`."""

    name: str
    flop_s: float
    """FLOPs per second achieved, counted as MFU counts them"""
    link_bytes_s: float
    """a ring hop's bytes per second, one direction (point to point)"""
    collective_bytes_s: float
    """a collective's bus bandwidth (nccl-tests' busbw)"""
    latency_s: float
    """per message"""
    host_hop_s: float
    """host time per ring hop"""
    host_collective_s: float
    """host time per collective"""
    slice_s: float = 0.0
    """ranks take turns on one GPU: a message a rank waits for costs time slices of this"""
    cores: int = 0
    """a CPU with this many cores for every rank: nothing overlaps"""
    sources: tuple[tuple[str, str], ...] = ()


H100_SOURCES = (
    ("flop_s", "Llama 3 405B's main pre-training phase on 16,384 H100s in bf16: 400 TFLOP/s per GPU, 41% MFU "
     "(The Llama 3 Herd of Models, arXiv 2407.21783, Table 4)"),
    ("link_bytes_s", "NCCL sendrecv_perf between two NVLink H100s: 80 GB/s by default, up to 180 at large sizes "
     "(NVIDIA/nccl-tests#268); the lower figure"),
    ("collective_bytes_s", "H100 SXM NVLink, one direction: 376-380 GB/s measured of 450 (NVIDIA/nccl#1264)"),
    ("latency_s", "one NCCL call between NVLink GPUs: 9.9 us for 8 bytes (NVIDIA/nccl-tests#331)"),
    ("host_hop_s", "hf_rtp's watched NCCL hop, host time (benchmarks/results/hop-latency-h100.json: 0.40 ms; "
     "0.13 ms unwatched)"),
    ("host_collective_s", "an NCCL all-gather or all-reduce, host time (hop-latency-h100.json: 0.07-0.08 ms)"),
)  # fmt: skip
H100 = Hardware("H100 SXM, NVLink", 400e12, 80e9, 380e9, 10e-6, 0.40e-3, 0.075e-3, sources=H100_SOURCES)
H100_SHARED = replace(
    H100,
    name="two ranks time-slicing one H100 (no MPS)",
    flop_s=67e12 * 0.41,
    slice_s=2.26e-3,
    sources=(
        ("flop_s", "H100 SXM float32 without tensor cores, 67 TFLOP/s (NVIDIA's datasheet), at bf16's 41%"),
        ("slice_s", "a message waited for alone took a multiple of 2.26 ms (hop-latency-h100.json): one for up to "
         f"{NCCL_P2P_STEP // MIB} MiB of a point-to-point message (NCCL's steps), one more for the ring's header, "
         "one for an all-gather or reduce-scatter, two for an all-reduce (measured up to 16 MiB; beyond, assumed)"),
        *H100_SOURCES[1:],
    ),
)  # fmt: skip
CPU = Hardware(
    "this project's 2-core CPU machine, gloo, one thread per rank",
    flop_s=4.93e10,
    link_bytes_s=1.31e9,
    collective_bytes_s=1.29e9,
    latency_s=0.06e-3,
    host_hop_s=0.19e-3,
    host_collective_s=0.16e-3,
    cores=2,
    sources=(
        ("flop_s", "the single-process step of benchmarks/results/llama-90m-cpu.json (90M Llama, 2x128, float32)"),
        ("link_bytes_s", "a 16 MB hop at 2 ranks (benchmarks/results/gloo-link-cpu.json)"),
        ("collective_bytes_s", "a 16 MB all-reduce's bus bandwidth at 2 ranks (gloo-link-cpu.json; an all-gather's "
         "was 0.68 GB/s)"),
        ("latency_s", "an 8-byte hop at 2 ranks (gloo-link-cpu.json)"),
        ("host_hop_s", "a walk's CPU time per hop (benchmarks/results/hop-cost-ab-cpu.json, after)"),
        ("host_collective_s", "assumed: a bare gloo message's CPU time (hop-cost-ab-cpu.json)"),
    ),
)  # fmt: skip
HARDWARE = {"h100": H100, "h100-shared": H100_SHARED, "cpu": CPU}


@dataclass(frozen=True)
class Shape:
    """What the model needs of a config: a Llama-shaped decoder (q/k/v, o, gate/up, down)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config) -> Shape:
        needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [n for n in needed if not getattr(config, n, None)]
        experts = [n for n in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(config, n, None)]
        if missing or experts:
            raise ValueError(
                "the speed model knows dense Llama-shaped decoders (q/k/v, o, gate/up, down); this config "
                + (f"lacks {', '.join(missing)}" if missing else f"has experts ({experts[0]})")
            )
        heads = config.num_attention_heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
            config.vocab_size,
            bool(getattr(config, "tie_word_embeddings", False)),
        )

    def linears(self) -> list[tuple[str, int, int]]:
        """A layer's linears in call order: (name, rows, columns) of each weight."""
        d, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q), ("gate", i, d), ("up", i, d), ("down", d, i)]

    def walks(self, stacked: bool = True) -> list[tuple[str, int, int]]:
        """RTP's walks of a layer: q/k/v and gate/up stacked (layers/siblings.py's STACKED), or each alone."""
        lin = {n: (r, c) for n, r, c in self.linears()}
        if not stacked:
            return self.linears()
        qkv = lin["q"][0] + 2 * lin["k"][0]
        return [("q/k/v", qkv, self.hidden), ("o", *lin["o"]), ("gate/up", 2 * self.intermediate, self.hidden),
                ("down", *lin["down"])]  # fmt: skip

    @property
    def layer_params(self) -> int:
        return sum(r * c for _, r, c in self.linears()) + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """embeddings, the final norm and the head"""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


@dataclass(frozen=True)
class Run:
    world: int
    batch: int
    seq: int
    recompute: str = "none"
    precision: str = "bf16"
    """bf16 autocast over float32 weights, or float32 throughout"""
    piece_bytes: int = parse_size(DEFAULT_PIECE_SIZE)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def weight_bytes(self) -> int:
        return WEIGHT_BYTES if self.precision == "bf16" else 4


@dataclass
class Result:
    strategy: str
    step_s: float
    tokens_per_s: float
    compute_s: float
    comm_s: float
    """communication the compute did not cover"""
    host_s: float
    """time the device waited for the host"""
    host_total_s: float
    messages: int
    sent_gb: float
    detail: dict[str, Any]


@dataclass
class _Op:
    host: float
    compute: float
    device: float  # >= compute: the transfer beyond it is exposed communication
    kind: str = "compute"


class _Model:
    def __init__(self, shape: Shape, run: Run, hw: Hardware):
        self.shape, self.run, self.hw = shape, run, hw
        # ranks at their share of a CPU's cores, or of one GPU they take turns on
        share = max(1.0, run.world / hw.cores) if hw.cores else run.world if hw.slice_s else 1.0
        self.flop_s = hw.flop_s / share
        self.share = share
        self.host_share = share if hw.cores else 1.0  # a GPU's ranks each have their own host

    def t(self, flops: float) -> float:
        return flops / self.flop_s

    def xfer(self, nbytes: float, collective: float = 0.0) -> float:
        """A message's time (p2p), or a collective's moving `collective` x nbytes over the bus."""
        if nbytes <= 0:
            return 0.0
        bw = self.hw.collective_bytes_s if collective else self.hw.link_bytes_s
        return (self.hw.latency_s + nbytes * (collective or 1.0) / bw) * self.share

    def slices(self, nbytes: float, kind: str) -> int:
        """Time slices a message waited for costs on a shared GPU."""
        if kind == "hop":
            return math.ceil(nbytes / NCCL_P2P_STEP) + 1  # its data in NCCL's steps, and the watched ring's header
        return 2 if kind == "all-reduce" else 1

    # what every strategy computes
    def attention(self) -> float:
        s = self.shape
        return 4.0 * self.run.tokens * self.run.seq * s.heads * s.head_dim

    def matmul(self, rows: float, cols: float) -> float:
        return 2.0 * self.run.tokens * rows * cols

    def layer_forward(self) -> float:
        return sum(self.matmul(r, c) for _, r, c in self.shape.linears()) + self.attention()

    def recomputed(self, names: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """What a layer's backward recomputes: every op (full), every second matmul (selective), nothing."""
        mode = self.run.recompute
        return names if mode == "full" else names[1::2] if mode == "selective" else []

    def layer_backward(self) -> float:
        again = sum(self.matmul(r, c) for _, r, c in self.recomputed(self.shape.linears()))
        if self.run.recompute == "full":
            again += self.attention()
        return 2 * self.layer_forward() + again

    def head(self) -> float:
        return self.matmul(self.shape.vocab, self.shape.hidden)


def _collective_op(m: _Model, nbytes: float, kind: str) -> _Op:
    """One collective of `nbytes` (its buffer) that nothing overlaps."""
    factor = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0}[kind] * (m.run.world - 1) / m.run.world
    if m.hw.slice_s:
        return _Op(m.hw.host_collective_s, 0.0, m.slices(nbytes, kind) * m.hw.slice_s, kind)
    return _Op(m.hw.host_collective_s * m.host_share, 0.0, m.xfer(nbytes, factor), kind)


def _result(m: _Model, name: str, device: float, compute: float, host: float, messages: int, sent: float,
            detail: dict) -> Result:  # fmt: skip
    """`device`: when the device is done, had the host never held it up. A CPU's host work takes its cores too;
    elsewhere the host runs ahead of the device unless it is slower."""
    step = device + host if m.hw.cores else max(device, host)
    return Result(name, step, m.run.tokens / step, compute, device - compute, step - device, host, messages,
                  sent / 1e9, detail)  # fmt: skip


def ddp(m: _Model) -> Result:
    s, n = m.shape, m.run.world
    # backward in autograd's order: the head, the layers from the last, the embeddings. A gradient is ready when its
    # layer's backward ends; DDP fills its buckets with the parameters in reverse order.
    t = m.t(s.layers * m.layer_forward() + m.head()) + m.t(2 * m.head())
    ready = [(t, s.vocab * s.hidden * (0 if s.tied else 1)), (t, s.hidden)]
    layer = [r * c for _, r, c in reversed(s.linears())] + [s.hidden, s.hidden]
    for _ in range(s.layers):
        t += m.t(m.layer_backward())
        ready += [(t, p) for p in layer]
    ready.append((t, s.vocab * s.hidden))
    compute = t
    if n == 1:
        return _result(m, "ddp", compute, compute, 0.0, 0, 0.0, {"buckets": 0})
    buckets: list[tuple[float, float]] = []  # (ready, bytes)
    size, cap = 0.0, DDP_BUCKETS[0]
    for when, params in ready:
        size += params * GRAD_BYTES
        if size >= cap:
            buckets.append((when, size))
            size, cap = 0.0, DDP_BUCKETS[1]
    if size:
        buckets.append((ready[-1][0], size))
    ops = [_collective_op(m, b, "all-reduce") for _, b in buckets]
    if m.hw.slice_s or m.hw.cores:
        end = compute + sum(o.device for o in ops)
    else:
        end = 0.0
        for (when, _), op in zip(buckets, ops, strict=True):
            end = max(end, when) + op.device
        end = max(end, compute)
    sent = 2 * (n - 1) / n * s.params * GRAD_BYTES
    return _result(m, "ddp", end, compute, sum(o.host for o in ops), len(ops), sent, {"buckets": len(ops)})


def fsdp2(m: _Model) -> Result:
    s, n, wb = m.shape, m.run.world, m.run.weight_bytes
    units_fwd = [m.t(m.layer_forward())] * s.layers
    units_bwd = [m.t(m.layer_backward())] * s.layers
    head_fwd, head_bwd = m.t(m.head()), m.t(2 * m.head())
    compute = sum(units_fwd) + sum(units_bwd) + head_fwd + head_bwd
    if n == 1:
        return _result(m, "fsdp2", compute, compute, 0.0, 0, 0.0, {"collectives": 0})
    gather_root = _collective_op(m, s.root_params * wb, "all-gather")
    gather = _collective_op(m, s.layer_params * wb, "all-gather")
    scatter = _collective_op(m, s.layer_params * GRAD_BYTES, "reduce-scatter")
    scatter_root = _collective_op(m, s.root_params * GRAD_BYTES, "reduce-scatter")
    ops = [gather_root, *[gather] * (2 * s.layers), *[scatter] * s.layers, scatter_root]
    if m.hw.slice_s or m.hw.cores:
        end = compute + sum(o.device for o in ops)
    else:
        comm = gather_root.device  # the comm stream's clock; forward: layer i's gather while layer i-1 computes
        t, started = comm, comm
        for fwd in units_fwd:
            comm = max(comm, started) + gather.device
            started = max(t, comm)
            t = started + fwd
        t += head_fwd + head_bwd  # the root stays gathered through backward
        started, scatter_ready = t - head_bwd, None
        for bwd in units_bwd:  # layer i's gather while the unit after it runs backward, its scatter after its own
            comm = max(comm, started) + gather.device
            gathered = comm
            if scatter_ready is not None:
                comm = max(comm, scatter_ready) + scatter.device
            started = max(t, gathered)
            t = started + bwd
            scatter_ready = t
        comm = max(comm, t) + scatter.device
        end = max(t, comm) + scatter_root.device
    sent = (n - 1) / n * s.params * (2 * wb + GRAD_BYTES)
    return _result(m, "fsdp2", end, compute, sum(o.host for o in ops), len(ops), sent, {"collectives": len(ops)})


class _Ring:
    """RTP's step as a list of _Op, in the order the host issues them."""

    def __init__(self, m: _Model, stacked: bool = True, moves: str = "auto"):
        self.m, self.stacked, self.moves = m, stacked, moves
        self.ops: list[_Op] = []
        self.sent = 0.0
        self.hops = 0
        run, shape = m.run, m.shape
        walks = [*shape.walks(stacked), ("embeddings", shape.vocab, shape.hidden)]
        self.slot = max(self._piece(r, c)[1] * c * run.weight_bytes for _, r, c in walks)  # the pool's weight slot

    def _piece(self, rows: int, cols: int) -> tuple[int, float]:
        """(pieces, rows per piece) of rank 0's chunk (ring.py: cut by the float32 weight's bytes)."""
        from torch import Size

        from ..distributed.tensors.sharding import ChunkLayout

        layout = ChunkLayout((Size((rows, cols)),), self.m.run.world)
        pieces = layout.pieces_for(self.m.run.piece_bytes // 4)
        return pieces, math.ceil(rows / self.m.run.world) / pieces

    def _step(self, kind: str, before: float, after: float, w: float, g: float) -> None:
        """A step of a walk: `before` s of compute between its weight hop's post and its gradient hop's, `after`
        beside the gradient hop; hops of `w` and `g` bytes (0: none)."""
        m, hw = self.m, self.m.hw
        hops = (w > 0) + (g > 0)
        self.hops += hops
        self.sent += w + g
        compute = before + after
        if hw.slice_s:
            device = compute + sum(m.slices(b, "hop") for b in (w, g) if b) * hw.slice_s
        elif hw.cores:
            device = compute + m.xfer(w) + m.xfer(g)
        else:
            both = m.xfer(w + g) if w and g else 0.0
            device = max(compute, m.xfer(w), before + m.xfer(g), both)
        self.ops.append(_Op(hops * hw.host_hop_s * m.host_share, compute, device, kind))

    def _moves_tokens(self, rows: int, cols: int, row_bytes: float) -> bool:
        from ..distributed.transport.weights_or_tokens import Traffic

        run = self.m.run
        if self.moves == "weights" or run.world == 1:
            return False
        held = run.tokens * (row_bytes + 8) * max(run.world - 1, 3) + 64
        chunk = math.ceil(rows / run.world) * cols * 4
        return Traffic(run.tokens, run.tokens, self.moves, True).moves_tokens(
            run.tokens, chunk, int(row_bytes), int(held), int(self.slot), run.world
        )

    def forward(self, kind: str, rows: int, cols: int, flops_per_row: float, row_bytes: float = 0.0,
                recompute: bool = False) -> None:  # fmt: skip
        """A forward walk of weights [rows, cols] (`flops_per_row`: per row held), or of the tokens where
        hf_rtp would move them (`row_bytes` per token; never in a recomputation)."""
        m, n = self.m, self.m.run.world
        if not recompute and row_bytes and self._moves_tokens(rows, cols, row_bytes):
            for _ in range(n):  # every rank's tokens visit; the outputs go home: N hops
                self._step(kind, m.t(flops_per_row * rows / n), 0.0, m.run.tokens * row_bytes, 0.0)
            return
        pieces, piece_rows = self._piece(rows, cols)
        for _ in range(pieces):
            for step in range(n):
                w = piece_rows * cols * m.run.weight_bytes if step < n - 1 else 0.0
                self._step(kind, m.t(flops_per_row * piece_rows), 0.0, w, 0.0)

    def backward(self, kind: str, rows: int, cols: int, before_per_row: float, after_per_row: float,
                 weights: bool = True) -> None:  # fmt: skip
        m, n = self.m, self.m.run.world
        pieces, piece_rows = self._piece(rows, cols)
        for _ in range(pieces):
            for step in range(n):
                w = piece_rows * cols * m.run.weight_bytes if weights and step < n - 1 else 0.0
                g = piece_rows * cols * GRAD_BYTES if step > 0 else 0.0
                self._step(kind, m.t(before_per_row * piece_rows), m.t(after_per_row * piece_rows), w, g)

    def compute(self, flops: float) -> None:
        self.ops.append(_Op(0.0, self.m.t(flops), self.m.t(flops)))


def rtp(m: _Model, stacked: bool = True, moves: str = "auto") -> Result:
    s, run, n = m.shape, m.run, m.run.world
    ring = _Ring(m, stacked, moves)
    tok, act = run.tokens, run.weight_bytes
    mm = 2.0 * tok  # a matmul's forward FLOPs per weight
    walks = s.walks(stacked)
    ring.forward("embeddings", s.vocab, s.hidden, 0.0, 8 + 4 * s.hidden)
    for _ in range(s.layers):
        for i, (_, rows, cols) in enumerate(walks):
            ring.forward("decoder", rows, cols, mm * cols, (rows + cols) * act)
            if i == 0:
                ring.compute(m.attention())
    head_row = s.hidden * 4 + 16  # hidden states, targets and the loss's statistics
    ring.forward("head", s.vocab, s.hidden, mm * s.hidden, head_row)
    moved_head = ring._moves_tokens(s.vocab, s.hidden, head_row)
    if moved_head:  # backward moves the hidden states again; each rank's chunk gradient is made where it is
        for _ in range(n):
            ring._step("head", m.t(3 * mm * s.hidden * s.vocab / n), 0.0, tok * head_row, 0.0)
    else:  # the fused loss recomputes logits, then the weight and input gradients, all before the gradient hop
        ring.backward("head", s.vocab, s.hidden, 3 * mm * s.hidden, 0.0)
    for _ in range(s.layers):
        again = {name for name, _, _ in m.recomputed(walks)}
        for i, (name, rows, cols) in enumerate(walks):
            if name in again:
                ring.forward("recompute", rows, cols, mm * cols, recompute=True)
            if i == 0 and run.recompute == "full":
                ring.compute(m.attention())
        for i, (_, rows, cols) in reversed(list(enumerate(walks))):
            if i == 0:
                ring.compute(2 * m.attention())
            ring.backward("decoder", rows, cols, mm * cols, mm * cols)
    if ring._moves_tokens(s.vocab, s.hidden, 8 + 4 * s.hidden):  # the tokens' gradients visit each rank
        for _ in range(n - 1):
            ring._step("embeddings", 0.0, 0.0, 0.0, tok * (8 + GRAD_BYTES * s.hidden))
    else:
        ring.backward("embeddings", s.vocab, s.hidden, 0.0, 0.0, weights=False)
    replicated = s.layers * 2 * s.hidden + s.hidden  # the norms' gradients: one all-reduce
    if n > 1:
        ring.ops.append(_collective_op(m, replicated * GRAD_BYTES, "all-reduce"))
    return _simulate(m, ring)


def _simulate(m: _Model, ring: _Ring) -> Result:
    """The host issues each op after the ones before it; the device runs it once issued and once free (on a CPU,
    one after another)."""
    host = device = 0.0
    by_kind: dict[str, list[float]] = {}  # kind -> [host work, device time, compute]
    for op in ring.ops:
        sums = by_kind.setdefault(op.kind, [0.0, 0.0, 0.0])
        sums[0], sums[1], sums[2] = sums[0] + op.host, sums[1] + op.device, sums[2] + op.compute
        host += op.host
        device = device + op.device if m.hw.cores else max(device, host) + op.device
    busy = sum(op.device for op in ring.ops)
    detail = {
        "hops": ring.hops,
        "exposed_comm_by_walk_s": {k: v[1] - v[2] for k, v in by_kind.items() if v[1] > v[2]},
        "host_and_device_by_walk_s": {k: v[:2] for k, v in by_kind.items()},
        "latency_s": ring.hops * m.hw.latency_s * m.share,
    }
    compute = sum(op.compute for op in ring.ops)
    result = _result(m, "rtp", busy, compute, host, ring.hops, ring.sent, detail)
    if not m.hw.cores:  # the host's lead, op by op: the device waited `step - busy` for it
        result.step_s = device
        result.tokens_per_s = m.run.tokens / device
        result.host_s = device - busy
    return result


def estimate(config, run: Run, hw: Hardware = H100, stacked: bool = True, moves: str = "auto") -> dict[str, Result]:
    """Each strategy's step on `hw`. `stacked` and `moves`: RTP's walks as hf_rtp makes them (stacked siblings; the
    tokens moved where fewer bytes than the weights), or, to compare with runs of older code, each linear alone /
    only weights."""
    if run.recompute not in RECOMPUTE:
        raise ValueError(f"recompute is one of {', '.join(RECOMPUTE)}, not {run.recompute!r}")
    m = _Model(Shape.of(config), run, hw)
    return {"ddp": ddp(m), "fsdp2": fsdp2(m), "rtp": rtp(m, stacked, moves)}


def binds(result: Result, hw: Hardware) -> str:
    """What holds RTP's step beyond its compute, with the numbers."""
    d = result.detail
    hops, busy = d["hops"], result.compute_s + result.comm_s
    slower = [
        f"{k} {h:.3f} s vs {g:.3f} s"
        for k, (h, g) in d["host_and_device_by_walk_s"].items()
        if h > g and h > 1e-3 and not hw.cores
    ]
    idle = d["host_and_device_by_walk_s"].get("compute", [0.0, 0.0])[1]
    host = (
        f"host work {result.host_total_s:.3f} s ({hops} hops x {hw.host_hop_s * 1e6:.0f} us) is "
        f"{result.host_total_s / busy:.0%} of the device's {busy:.3f} s"
        + (f"; the host is slower than the device on the walks ({', '.join(slower)})" if slower else "")
        + (f" and catches up during attention's {idle:.3f} s without hops" if slower and idle > 1e-3 else "")
        + f"; above {busy / max(hops, 1) * 1e6:.0f} us a hop the host binds"
    )
    if result.host_s >= max(result.comm_s, 0.01 * result.step_s):
        waits = f"the device waits {result.host_s:.3f} s ({result.host_s / result.step_s:.0%} of the step)"
        return f"host time: {waits}; {host}"
    near = (
        "; within 10% of binding, and host work this model leaves out (kernel launches beside the hops) binds first"
        if result.host_total_s > 0.9 * busy and not hw.cores
        else ""
    )
    if hw.slice_s and result.comm_s >= 0.01 * result.step_s:
        return f"time slices: {hops} hops waited for cost {result.comm_s:.3f} s beyond compute; {host}"
    if result.comm_s >= 0.01 * result.step_s:
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in d["exposed_comm_by_walk_s"].items() if v >= 5e-4)
        return (
            f"a walk's serial dependence: {result.comm_s:.3f} s of transfers that no piece's compute covers ({parts}; "
            f"latency, {hops} hops x {hw.latency_s * 1e6:.0f} us, is {d['latency_s']:.3f} s at most); {host}{near}"
        )
    return f"compute: transfers and host time hide behind it; {host}{near}"


def step_flops(config, run: Run) -> float:
    """FLOPs of one process's step without a ring (DDP's compute), as this model counts them."""
    return ddp(_Model(Shape.of(config), replace(run, world=1), replace(H100, flop_s=1.0))).compute_s
