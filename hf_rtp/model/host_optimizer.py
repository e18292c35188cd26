"""Optimizer state and step in host memory: `hf_rtp.CPUOffloadOptimizer(params, torch.optim.AdamW, lr=...)`.

Each rank keeps, in host memory, a float32 master copy of the rows it owns of every trainable parameter (a rotated
parameter's local chunk, a replicated parameter whole) and their gradients' copies (both pinned where the
parameters are on CUDA), and the wrapped optimizer's state, and steps torch's CPU optimizer there; the updated rows
are copied back into the device parameter before the next forward reads them. On the device stay only the parameter
and its gradient. On a CPU device the path runs the same (host memory is then the same memory).

Why not torchao's `CPUOffloadOptimizer`: it asserts a CUDA or XPU device ("CPU Offload currently only supports
CUDA & XPU"), and its `state_dict()` is `{"offloaded": [one optimizer's state dict per parameter]}`, with neither
parameter names nor torch's layout, which torch.distributed.checkpoint's `get_state_dict` (hf_rtp's training
state) cannot map to the model's parameters.

What it keeps of torch's optimizer contract:
- `param_groups` hold the model's own parameters with the wrapped class's full options, so LR schedulers,
  `clip_grad_norm_`, GradScaler and Trainer see the usual optimizer; the options are copied to the host
  optimizer at every step;
- gradients are read at `step()`, after accumulation, clipping and unscaling changed them;
- `state` maps each parameter to its state (host tensors of this rank's rows), and `state_dict()` presents a
  rotated parameter's state as rotated tensors on its mesh (`load_state_dict` takes them back), so
  `save_training_state` / `load_training_state` save, resume and reshard it like torch's AdamW's; a parameter whose
  dtype is narrower than its master's also saves the master as `master`;
- only the parameters that require a gradient get a master (PEFT: the adapters); one that starts to require it
  later gets its master at its first step.

Masters are float32, or float64 for a float64 parameter (vanilla's AdamW steps it in float64). At every step each
parameter's rows are copied to the host before its step, so that whatever wrote them since the last one (a load, a
user's edit, `.data` or not) is where its step starts: a parameter in its master's dtype into its master; a narrower
one (bf16) into a staging buffer of its own dtype, and every element that differs from its master rounded is taken
from the rows (an unchanged element keeps its float32 master). Version counters cannot say this: in-place ops on a
DTensor leave its local tensor's counter as it was, and foreach ops leave the DTensor's own too.

The step is a pipeline over buckets of parameters (`bucket_bytes` of masters each, in the groups' order): every
bucket's copies to the host (rows, then gradients) are queued at once on a side stream, and each bucket is stepped
on the host as soon as its copies land, its updated rows queued back at once on a second one (the two directions
run at once on the GPU's copy engines). So the copies each way overlap the host's step of the other buckets, and
the host waits for no copy back: the compute stream waits for them (an event) before the next forward, and the
next step's host waits for them before it writes a master again.

Gradients are copied at `step()`, not by post-accumulate-grad hooks during backward: clipping, GradScaler's unscale
and a user's own edits change them after backward, and no counter would show it on a rotated gradient (see above),
so an early copy could not be known stale. The moments stay in pageable host memory: they never cross to the device
(a training state is saved from host memory), so pinning them would only lock pages, rounded up by torch's pinned
allocator to powers of two.

Refused by name: optimizer classes other than torch's element-wise ones (`ELEMENTWISE`): 8-bit optimizers
(bitsandbytes', torchao's) keep device state that the host step cannot hold, a factored one (Adafactor) would
compute its statistics over a rank's rows where vanilla's span the whole weight, and LBFGS re-evaluates its
closure inside the step.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from .. import log
from ..distributed.tensors.rotated import RotatedTensor, rotated_rows
from ..errors import KeywordError
from ..private.torch_names import local_tensor

# torch's optimizers whose state and step are element by element: a rank's rows step as vanilla's whole tensor does
ELEMENTWISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta")
FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")  # torch's fused CPU kernels
# masters per host step: small enough that the first bucket's copies land early and the last one's copy back is
# short, large enough that a host step's fixed cost (tens of microseconds) stays a small part of a bucket's work
BUCKET_BYTES = 64 << 20

_FEW_THREADS = (
    "hf_rtp.CPUOffloadOptimizer steps on the host with torch's intra-op threads, and this rank has 1 "
    "(torch.get_num_threads(); torchrun and accelerate launch set OMP_NUM_THREADS=1 unless told otherwise), where "
    "{cores} cores are free per rank of this node: the host step then takes several times as long. Set "
    "OMP_NUM_THREADS={cores} (or call torch.set_num_threads({cores}) in each rank) before training"
)

_REFUSED = (
    "hf_rtp.CPUOffloadOptimizer(optimizer_class={name}): the offloaded step runs torch's element-wise CPU "
    "optimizers ({allowed}), and {why}"
)


def _refusal(optimizer_class) -> str | None:
    name = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
    module = getattr(optimizer_class, "__module__", "") or ""
    if module.startswith(("bitsandbytes", "torchao")):
        why = (
            f"{module.split('.')[0]}'s {name} keeps 8-bit state and steps it with its own device kernels, which "
            "a host step cannot hold: use it without offload, or offload torch.optim.AdamW"
        )
    elif not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        why = "it is not a torch.optim.Optimizer class"
    elif module.startswith("torch.optim") and name in ELEMENTWISE:
        return None
    elif name == "LBFGS":
        why = "LBFGS re-evaluates its closure inside the step, where only the host copies would change"
    else:
        why = (
            f"{module}.{name} is not one of them: a step over a rank's rows equals vanilla's over the whole "
            "weight only for element-wise state (Adafactor's factored moments, for one, span every row), and "
            "it may have no CPU step"
        )
    return _REFUSED.format(name=name, allowed=", ".join(ELEMENTWISE), why=why)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter or gradient: a rotated one's local rows, a plain one whole."""
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor.detach()


def thread_advice(on_cuda: bool, threads: int, cores: int) -> str | None:
    """The warning for a CUDA run whose host step has one thread where the node has more cores per rank (on a CPU
    device the host step shares the cores with the model's own work, as any optimizer does)."""
    return _FEW_THREADS.format(cores=cores) if on_cuda and threads == 1 and cores > 1 else None


def cores_per_rank(environ=os.environ) -> int:
    """The cores this process may run on, shared by the node's ranks (LOCAL_WORLD_SIZE, as launchers set it)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(environ.get("LOCAL_WORLD_SIZE", "1"))))


def _index_of(by_id: dict, p: torch.Tensor):
    return next((index for index, q in by_id.items() if q is p), None)


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """`optimizer_class(**kwargs)` stepped in host memory on this rank's rows; see the module's docstring."""

    def __init__(self, params, optimizer_class: type = torch.optim.AdamW, **kwargs) -> None:
        refused = _refusal(optimizer_class)
        if refused:
            raise KeywordError(refused)
        if optimizer_class.__name__ in FUSED_ON_CPU and "fused" not in kwargs and "foreach" not in kwargs:
            kwargs["fused"] = True  # torch's fused CPU kernel, as torchao's CPUOffloadOptimizer defaults to
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # device parameter -> host master (float32 or float64)
        self._grads: dict[torch.Tensor, torch.Tensor] = {}  # device parameter -> host gradient, in its master's dtype
        self._staged: dict[torch.Tensor, torch.Tensor] = {}  # narrower parameter -> host copy of its rows, its dtype
        self._streams: tuple | None = None  # CUDA side streams, to the host and back: copies both ways at once
        self._back: torch.cuda.Event | None = None  # the last step's copies back to the device, queued
        self.bucket_bytes = BUCKET_BYTES
        self._threads_checked = False
        host_groups = [{**g, "params": [self._master(p) for p in g["params"] if p.requires_grad]} for g in groups]
        self._host = optimizer_class(host_groups, **kwargs)
        self._host_group: dict[int, dict] = {}  # id(device group) -> host group
        self._built = False
        options = [{k: v for k, v in hg.items() if k != "params"} for hg in self._host.param_groups]
        device_groups = [{**o, "params": g["params"]} for o, g in zip(options, groups, strict=True)]
        super().__init__(device_groups, self._host.defaults)
        for group, host in zip(self.param_groups, self._host.param_groups, strict=True):
            self._host_group[id(group)] = host
        self._built = True

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        self._wait_back()  # a new master's first copy must not race a copy back into the same rows
        rows = _rows(p)
        pin = rows.is_cuda and torch.cuda.is_available()
        dtype = torch.promote_types(rows.dtype, torch.float32)  # float32, or a float64 parameter's own
        master = torch.empty(rows.shape, dtype=dtype, device="cpu", pin_memory=pin)
        master.copy_(rows)
        self._masters[p] = master
        self._grads[p] = torch.empty(rows.shape, dtype=dtype, device="cpu", pin_memory=pin)
        if rows.dtype != dtype:
            self._staged[p] = torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=pin)
        return master

    def add_param_group(self, param_group: dict) -> None:
        if not self._built:  # Optimizer.__init__'s own calls: the host groups exist already
            super().add_param_group(param_group)
            return
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        masters = [self._master(p) for p in group["params"] if p.requires_grad]
        self._host.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self._host_group[id(group)] = self._host.param_groups[-1]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_back()  # the host writes the masters the last step's copies back read from
        stepped: list[torch.Tensor] = []
        for group in self.param_groups:
            host = self._host_group[id(group)]
            host.update({k: v for k, v in group.items() if k != "params"})  # a scheduler's lr, say
            for p in group["params"]:
                if p not in self._masters:
                    if p.grad is None:
                        continue
                    host["params"].append(self._master(p))  # trainable since the optimizer was made
                self._masters[p].grad = None  # each bucket's host step sees its own gradients only
                stepped.append(p)
        buckets = self._buckets(stepped)
        cuda = [p for p in stepped if _rows(p).is_cuda]
        streams = self._side_streams(_rows(cuda[0]).device) if cuda else None
        stream, back = streams if streams is not None else (None, None)
        if not self._threads_checked:
            self._threads_checked = True
            advice = thread_advice(stream is not None, torch.get_num_threads(), cores_per_rank())
            if advice:
                log.warning(advice)
        if stream is not None and back is not None:
            for side in (stream, back):  # backward, clipping, unscaling and whatever else reads the rows: done
                side.wait_stream(torch.cuda.current_stream(stream.device))
        landed = [self._copy_to_host(bucket, stream) for bucket in buckets]
        for bucket, event in zip(buckets, landed, strict=True):
            if event is not None:
                event.synchronize()
            for p in bucket:
                self._follow_rows(p)
                if p.grad is not None:  # else skipped, as torch's optimizers skip a parameter without a gradient
                    self._masters[p].grad = self._grads[p]
            self._host.step()
            for p in bucket:
                self._masters[p].grad = None
            self._copy_back(bucket, back)
        if back is not None:
            self._back = back.record_event()
            torch.cuda.current_stream(back.device).wait_event(self._back)  # the next forward reads the new rows
        self._mirror_state()
        return loss

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """`params` in order, cut where a bucket's masters reach `bucket_bytes`."""
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in params:
            if buckets[-1] and size >= self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            master = self._masters[p]
            size += master.numel() * master.element_size()
        return [b for b in buckets if b]

    def _side_streams(self, device: torch.device) -> tuple:
        if self._streams is None or self._streams[0].device != device:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    def _copy_to_host(self, bucket: list[torch.Tensor], stream) -> torch.cuda.Event | None:
        """Queue the bucket's rows (into their masters, or staged) and gradients to the host; on CUDA the event that
        says they landed."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in bucket:
                rows = _rows(p)
                (self._staged.get(p, self._masters[p])).copy_(rows, non_blocking=True)
                if p.grad is not None:
                    grad = _rows(p.grad)
                    self._grads[p].copy_(grad, non_blocking=True)
                    if grad.is_cuda:
                        grad.record_stream(stream)  # a zero_grad(set_to_none) must not free it under the copy
            return stream.record_event() if stream is not None else None

    def _follow_rows(self, p: torch.Tensor) -> None:
        """A narrower parameter's master takes every element its rows changed since the last step's rounding."""
        staged = self._staged.get(p)
        if staged is not None:
            master = self._masters[p]
            changed = staged != master.to(staged.dtype)
            if changed.any():
                master[changed] = staged[changed].to(master.dtype)

    def _copy_back(self, bucket: list[torch.Tensor], stream) -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in bucket:
                _rows(p).copy_(self._masters[p], non_blocking=True)

    def _wait_back(self) -> None:
        """The host may write the masters again: the last step's copies back from them are done."""
        if self._back is not None:
            self._back.synchronize()
            self._back = None

    def _mirror_state(self) -> None:
        """`self.state` maps each device parameter to its host state (the same dicts): torch.distributed.checkpoint
        reads an optimizer without state as a fresh one, and steps it once at lr=0 to make some."""
        self.state = defaultdict(dict)
        for p, master in self._masters.items():
            if master in self._host.state:
                self.state[p] = self._host.state[master]

    def state_dict(self) -> dict:
        """torch's layout, keyed by the device parameters' positions; a rotated parameter's state as rotated
        tensors of this rank's rows on its mesh, their local tensors in host memory (as FSDP2's CPUOffloadPolicy keeps
        its shards: nothing is copied to the device for a save), replicated ones' as host tensors."""
        self._mirror_state()
        shown: defaultdict = defaultdict(dict)
        for p, state in self.state.items():
            shown[p] = {key: self._shown(p, value) for key, value in state.items()}
            if p.dtype != self._masters[p].dtype:
                shown[p]["master"] = self._shown(p, self._masters[p])
        kept, self.state = self.state, shown
        try:
            return super().state_dict()
        finally:
            self.state = kept

    def _shown(self, p: torch.Tensor, value):
        if isinstance(value, torch.Tensor) and isinstance(p, RotatedTensor) and value.shape == self._masters[p].shape:
            return rotated_rows(p, value)
        return value

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's layout, as `state_dict()` gives it (or torch.distributed.checkpoint hands it back, rows resharded):
        the options into `param_groups`, every state tensor's rows into host memory in its master's dtype."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise KeywordError(
                "CPUOffloadOptimizer.load_state_dict: the state dict's parameter groups hold "
                f"{[len(g['params']) for g in groups]} parameters, this optimizer's "
                f"{[len(g['params']) for g in self.param_groups]}: build the optimizer as the run that saved it did"
            )
        self._wait_back()
        by_id: dict[int, torch.Tensor] = {}
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
            by_id.update(zip(saved["params"], group["params"], strict=True))
        for index, saved in state_dict["state"].items():
            p = by_id[index]
            if p not in self._masters:
                self._master(p)
                self._host_group_of(p)["params"].append(self._masters[p])
            master = self._masters[p]
            host = {}
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    host[key] = value
                    continue
                value = _rows(value)
                if key == "step":
                    host[key] = value.detach().to("cpu", copy=True)
                elif key == "master":
                    master.copy_(value)
                else:
                    host[key] = value.detach().to("cpu", master.dtype, copy=True)
            self._host.state[master] = host
        for p, master in self._masters.items():  # the model's rows are loaded already (set_state_dict does them first)
            if not any(key == "master" for key in state_dict["state"].get(_index_of(by_id, p), {})):
                master.copy_(_rows(p))
        self._mirror_state()

    def _host_group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return self._host_group[id(group)]
        raise KeyError(p)
