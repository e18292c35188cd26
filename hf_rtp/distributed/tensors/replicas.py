"""On a 2-D grid: the sum of rotated gradients over the replicas, off the backward's critical path.

A ring sums its own ranks' gradients as they walk. The replicas (the other rings holding the same
rows, with other data) must still be summed, as DDP sums its buckets. Like DDP, hf_rtp does that
once autograd has accumulated a parameter's gradient (a post-accumulate-grad hook): the all-reduce
starts there and runs while autograd goes on with earlier layers' backward. One callback at the end
of the backward waits for all of them, so `.grad` is complete when `backward()` returns: before any
optimizer step, clipping, or the next micro-batch's accumulation into it.

As in DDP, what is all-reduced is the whole accumulated `.grad`, divided by the replica count first:
earlier micro-batches' parts are already equal on every replica, so they come out unchanged.

Where autograd does not accumulate into `.grad` (torch.autograd.grad, backward(inputs=) without the
parameter) there is no hook to run, so the layer's backward sums in place and waits (`now`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ... import faults
from ...private.torch_names import current_graph_task_id, queue_callback, will_engine_execute_node
from ..transport.pending import Pending

_WAITED = "waited for the other replicas' gradients"


def _accumulator(local: torch.Tensor | None):
    """The AccumulateGrad node of the parameter `local` is the chunk of (via
    distributed.tensors.rotated.local_chunk)."""
    node = getattr(local, "grad_fn", None)
    if node is None or not node.next_functions:
        return None
    acc = node.next_functions[0][0]
    return acc if type(acc).__name__ == "AccumulateGrad" else None


def _will_accumulate(acc) -> bool:
    try:
        return will_engine_execute_node(acc)
    except RuntimeError:  # torch.autograd.grad(): the engine returns gradients instead of accumulating them
        return False


class ReplicaSum:
    """Sums the gradients of one ring's rotated parameters over `group`, the replicas of its rows."""

    def __init__(self, group: dist.ProcessGroup, count: int):
        self.group, self.count = group, count
        self.reduced_bytes = 0
        self._tasks: dict[int, dict] = {}  # per backward (graph task): parameters expected, work in flight

    @property
    def in_flight(self) -> int:
        """All-reduces started and not yet waited for (0 whenever no backward is running)."""
        return sum(len(task["works"]) for task in self._tasks.values())

    def deferred(self, local: torch.Tensor | None) -> bool:
        """True when the sum for `local`'s parameter will start after autograd accumulates its `.grad`
        in this backward (its hook is then registered); False when the caller must call `now`."""
        acc = _accumulator(local)
        if acc is None or not _will_accumulate(acc):
            return False
        param = acc.variable
        handle = getattr(param, "_hf_rtp_replica_hook", None)
        if handle is None or handle.id not in (getattr(param, "_post_accumulate_grad_hooks", None) or {}):
            # checked by the hook's id, not a flag: a copy of the parameter (PEFT's modules_to_save) has no hooks
            param._hf_rtp_replica_hook = param.register_post_accumulate_grad_hook(self._start)
        self._task()["expected"].add(id(param))
        return True

    def now(self, grad: torch.Tensor) -> None:
        """Sum `grad` over the replicas in place and wait (the path without accumulation)."""
        faults.point("replicas.reduce")
        self.reduced_bytes += grad.numel() * grad.element_size()
        Pending([dist.all_reduce(grad, group=self.group, async_op=True)], _WAITED).wait()

    def _task(self) -> dict:
        task_id = current_graph_task_id()
        task = self._tasks.get(task_id)
        if task is None:
            task = self._tasks[task_id] = {"expected": set(), "works": []}
            queue_callback(lambda: self._finish(task_id))
        return task

    def _start(self, param: torch.Tensor) -> None:
        task = self._task()
        if id(param) not in task["expected"]:
            return  # accumulated by another path only (a replicated use): nothing of the ring's to sum
        task["expected"].discard(id(param))
        assert isinstance(param.grad, DTensor)  # this hook runs after autograd accumulated a rotated gradient
        grad = param.grad.to_local()
        faults.point("replicas.reduce")
        grad.div_(self.count)  # then summed: the mean over replicas, and earlier micro-batches' parts unchanged
        self.reduced_bytes += grad.numel() * grad.element_size()
        task["works"].append(dist.all_reduce(grad, group=self.group, async_op=True))

    def _finish(self, task_id: int) -> None:
        task = self._tasks.pop(task_id)
        Pending(task["works"], _WAITED).wait()
        if task["expected"]:  # a hook that never ran would leave replicas apart without a word
            raise RuntimeError(
                f"hf_rtp: {len(task['expected'])} rotated gradient(s) were not summed over the replicas: autograd "
                "did not accumulate them as it said it would. Please report this with your torch version."
            )
