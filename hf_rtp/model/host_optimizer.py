"""Optimizer state and step in host memory: `hf_rtp.CPUOffloadOptimizer(params, torch.optim.AdamW, lr=...)`.

Each rank keeps, in host memory (pinned where the parameters are on CUDA), a float32 master copy of the rows it
owns of every trainable parameter (a rotated parameter's local chunk, a replicated parameter whole), their
gradients' copies and the wrapped optimizer's state, and steps torch's CPU optimizer there; the updated rows are
copied back into the device parameter before `step()` returns. On the device stay only the parameter and its
gradient. On a CPU device the path runs the same (host memory is then the same memory).

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

Masters are float32, or float64 for a float64 parameter (vanilla's AdamW steps it in float64). A parameter in its
master's dtype has its rows copied into the master at every step, so whatever wrote them (a load,
a user's edit) the host step starts from them. A bf16 parameter's float32 master is more than its rows: it follows
them where their version counter shows a write, and at `load_state_dict` (the saved master, or the loaded rows); a
write that bypasses the counter (torch.distributed.checkpoint's reader copies bytes straight into the storage) is
seen only there. Gradients are copied at `step()`, not by post-accumulate-grad hooks during backward: clipping and
GradScaler's unscale change them after backward, and a hook's copy would miss that.

Refused by name: optimizer classes other than torch's element-wise ones (`ELEMENTWISE`): 8-bit optimizers
(bitsandbytes', torchao's) keep device state that the host step cannot hold, a factored one (Adafactor) would
compute its statistics over a rank's rows where vanilla's span the whole weight, and LBFGS re-evaluates its
closure inside the step.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from ..distributed.tensors.rotated import RotatedTensor, rotated_rows
from ..errors import KeywordError
from ..private.torch_names import local_tensor, version

# torch's optimizers whose state and step are element by element: a rank's rows step as vanilla's whole tensor does
ELEMENTWISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta")
FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")  # torch's fused CPU kernels

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
        self._grads: dict[
            torch.Tensor, torch.Tensor
        ] = {}  # device parameter -> host gradient buffer, in the master's dtype
        self._seen: dict[torch.Tensor, int] = {}  # device parameter -> its rows' version when master last matched
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
        rows = _rows(p)
        pin = rows.is_cuda and torch.cuda.is_available()
        dtype = torch.promote_types(rows.dtype, torch.float32)  # float32, or a float64 parameter's own
        master = torch.empty(rows.shape, dtype=dtype, device="cpu", pin_memory=pin)
        master.copy_(rows)
        self._masters[p] = master
        self._seen[p] = version(rows)
        self._grads[p] = torch.empty(rows.shape, dtype=dtype, device="cpu", pin_memory=pin)
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
        stepped = []
        for group in self.param_groups:
            host = self._host_group[id(group)]
            host.update({k: v for k, v in group.items() if k != "params"})  # a scheduler's lr, say
            for p in group["params"]:
                if p not in self._masters:
                    if p.grad is None:
                        continue
                    host["params"].append(self._master(p))  # trainable since the optimizer was made
                master = self._masters[p]
                if p.dtype == master.dtype or version(_rows(p)) != self._seen[p]:
                    master.copy_(_rows(p), non_blocking=True)  # see "Masters" in the module's docstring
                if p.grad is None:
                    master.grad = None  # skipped, as torch's optimizers skip a parameter without a gradient
                    continue
                self._grads[p].copy_(_rows(p.grad), non_blocking=True)
                master.grad = self._grads[p]
                stepped.append(p)
        if any(_rows(p).is_cuda for p in stepped):
            torch.cuda.synchronize()  # the gradients' copies are in host memory before the host step reads them
        self._host.step()
        for p in stepped:
            _rows(p).copy_(self._masters[p], non_blocking=True)
            self._seen[p] = version(_rows(p))
        if any(_rows(p).is_cuda for p in stepped):
            torch.cuda.synchronize()  # the rows are on the device before the next forward, and the host may write
        self._mirror_state()
        return loss

    def _mirror_state(self) -> None:
        """`self.state` maps each device parameter to its host state (the same dicts): torch.distributed.checkpoint
        reads an optimizer without state as a fresh one, and steps it once at lr=0 to make some."""
        self.state = defaultdict(dict)
        for p, master in self._masters.items():
            if master in self._host.state:
                self.state[p] = self._host.state[master]

    def state_dict(self) -> dict:
        """torch's layout, keyed by the device parameters' positions; a rotated parameter's state as rotated
        tensors of this rank's rows on its mesh (on CUDA copied to the device for the call), replicated ones' as
        host tensors."""
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
                    self._seen[p] = version(_rows(p))
                else:
                    host[key] = value.detach().to("cpu", master.dtype, copy=True)
            self._host.state[master] = host
        for p, master in self._masters.items():  # the model's rows are loaded already (set_state_dict does them first)
            if not any(key == "master" for key in state_dict["state"].get(_index_of(by_id, p), {})):
                master.copy_(_rows(p))
                self._seen[p] = version(_rows(p))
        self._mirror_state()

    def _host_group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return self._host_group[id(group)]
        raise KeyError(p)
