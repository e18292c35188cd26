"""What a rotated causal LM does when it is called: its forward, read top to bottom.

from_pretrained gives every rotated causal LM this forward (`install_forward`); it takes one keyword of its own,
`return_logits=`. A call runs three steps, each a function below, in this order:

1. Context dispatch (`forward`). Inside a context-parallel block (model/context/) each rank holds chunks of one
   sequence: the inputs are checked on every rank together, the forward keeps no cache, a forward with labels is
   given the sequence's divisor, and its loss is the sequence's (model/context/loss.py). Outside a block the call
   goes on as it came.
2. Fused routing (`routed`). A training forward with labels, on a model whose LM head the fused loss reproduces
   (model/fused_head.py's `read_head`), runs vanilla's forward with the head holding its input (`FusedLoss.hold`)
   and returning an empty [batch, seq, 0] tensor: the model's own transforms run on that empty tensor, and no
   [tokens, vocab] logits are made. Every other forward is vanilla's, unchanged. Everything else the forward
   does (the backbone, MoE's aux loss added to the loss, the output class) stays vanilla's own code.
3. The loss (`loss`, reached as the model's `loss_function`, a `FusedLoss`, while the fused loss is on): in a
   routed forward, the loss of the held hidden states through the ring (fused_head.token_losses), over the tokens
   that have labels only (`Labelled`: counted at step 2's start, so that taking them makes the host wait for the
   device's queue no further than the forward's start); in any other, transformers' ForCausalLMLoss.

`num_items_in_batch`, what the summed token losses are divided by, flows one way, down: the caller's when given,
else the block's label count, set in step 1 for every step below, else the label tokens step 3 counts. `divisor`
makes that choice, for this forward and for TRL's fused one (integrations/trl.py).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from .. import log
from ..layers import RotatedLinear
from ..layers.common import cast_for_matmul
from ..private.transformers_names import own_loss_function
from . import context
from .fused_head import read_head, token_losses

FUSED = "_hf_rtp_fused_loss"
"""the model's attribute holding its FusedLoss while the fused loss is on (absent otherwise)"""


def install_forward(model: PreTrainedModel, fused: bool) -> bool:
    """Give `model` hf_rtp's forward: it takes `return_logits=`, and with `fused` it routes the loss of
    training forwards with labels through the fused head when the family qualifies (see the module
    docstring). Returns whether the fused loss is on."""
    transforms, reason = read_head(model) if fused else ([], None)
    if fused and reason is not None:
        log.warning(
            f"{type(model).__name__}: the fused LM-head loss is off, because {reason}; "
            "the loss is computed from full logits"
        )
    fused = fused and reason is None
    vars(model).pop(FUSED, None)  # installed again: only this installation's loss is routed
    if fused:
        loss_function = FusedLoss(model, transforms)
        setattr(model, FUSED, loss_function)
        model.loss_function = loss_function
    model.forward = types.MethodType(_signed(type(model).forward), model)
    return fused


def _signed(original):
    """`forward` under `original`'s names and signature: generate and Trainer read the model's signature through
    it. A new function for each model, since functools.wraps writes those names on it; it holds no state."""

    @functools.wraps(original)
    def signed(self, *args, return_logits: bool = False, **kwargs):
        return forward(self, *args, return_logits=return_logits, **kwargs)

    return signed


def forward(model, *args, return_logits: bool = False, **kwargs):
    """Step 1, context dispatch: outside a block, the call as it came. Inside one (one sequence across the ring):
    the inputs checked on every rank together, no cache kept, and with labels the sequence's divisor in and the
    sequence's loss out.

    It keeps no cache (use_cache=False, as TRL's trainers pass): transformers separates packed sequences
    (position_ids that restart) only when a forward has no cache, and a training forward in a block needs none."""
    run = context.active(model)
    if run is None:
        return routed(model, *args, return_logits=return_logits, **kwargs)
    positional = _positional(type(model).forward)
    if len(args) > len(positional):
        raise TypeError(f"{type(model).__name__}.forward takes {len(positional)} positional arguments")
    kwargs = {**dict(zip(positional, args, strict=False)), **kwargs}  # by position too: the checks see them
    facts = context.check(run, kwargs)
    kwargs = {**kwargs, "use_cache": False}
    labelled = kwargs.get("labels") is not None
    if labelled:  # every rank divides its share by the same number: the sum over the ring is the sequence's loss
        kwargs["num_items_in_batch"] = divisor(kwargs.get("num_items_in_batch"), facts)
    before = run.calls
    out = routed(model, return_logits=return_logits, **kwargs)
    context.attended(run, before)
    if not labelled:  # no loss asked for: each rank's logits of its own tokens
        return out
    loss = context.sequence_loss(run, out[0] if isinstance(out, tuple) else out.loss)
    if isinstance(out, tuple):
        return (loss, *out[1:])
    out.loss = loss
    return out


@functools.cache
def _positional(original) -> list[str]:
    """The parameters of a model class's forward a caller may pass by position (input_ids first), for the block's
    checks."""
    return [
        name
        for name, p in inspect.signature(original).parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def routed(model, *args, return_logits: bool = False, **kwargs):
    """Step 2, fused routing: a training forward with labels, without `return_logits` or `logits_to_keep`, on a
    model whose fused loss is on, runs vanilla's forward with its head holding its input, and returns no logits;
    every other forward is vanilla's."""
    plain = type(model).forward
    fused: FusedLoss | None = vars(model).get(FUSED)
    if (
        fused is None
        or return_logits
        or not model.training
        or kwargs.get("labels") is None
        or kwargs.get("logits_to_keep")
    ):
        return plain(model, *args, **kwargs)
    head = getattr(model, fused.head_name)
    # replaced since loading: a PEFT adapter on the head, a user's own loss_function
    if not isinstance(head, RotatedLinear) or own_loss_function(model) is not fused:
        return plain(model, *args, **kwargs)
    fused.active = True
    fused.labelled = Labelled(kwargs["labels"], kwargs.get("shift_labels"), kwargs.get("ignore_index", -100))
    head.forward = fused.hold  # type: ignore[method-assign]  # this forward only; deleted below
    try:
        out = plain(model, *args, **kwargs)
    finally:
        del head.forward
        missed, fused.active, fused.hidden, fused.labelled = fused.active, False, None, None
    if missed:
        raise RuntimeError(f"{type(model).__name__}.forward did not compute its loss from the LM head's output")
    return _without_logits(out)


def _without_logits(out):
    """The output with logits None (training forwards with labels never build them)."""
    if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...)
        return (out[0], None, *out[2:])
    return type(out)(**{k: v for k, v in out.items() if k != "logits"})


def _targets(labels: torch.Tensor, shift_labels, ignore_index: int) -> torch.Tensor:
    """Each token's target, flat: the next token's label (vanilla's shift), or `shift_labels` as given."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


class Labelled:
    """How many of a routed forward's tokens have labels, counted on the device at the forward's start (step 2) and
    copied to host memory there without waiting (non-blocking, into pinned memory, an event behind it).

    The loss takes the labelled tokens' rows by that count (`torch.nonzero_static`), so that the LM head's walks
    skip the ignored ones (a prompt's). `nonzero` would read the count when the loss runs: on CUDA a wait for
    everything queued before it, the whole forward. This copy is queued behind the batch alone: when the loss runs,
    the host waits for it only while the device is still behind the forward's start, and the forward's layers stay
    queued meanwhile, so the device never runs dry. On the CPU (and on any device but CUDA) the count is read
    where it is."""

    def __init__(self, labels: torch.Tensor, shift_labels, ignore_index: int):
        self.labels, self.shift_labels, self.ignore_index = labels, shift_labels, ignore_index
        count = (_targets(labels, shift_labels, ignore_index) != ignore_index).sum()
        self.ready: torch.cuda.Event | None = None
        if count.device.type == "cuda":
            count = count.to("cpu", non_blocking=True)  # pinned: the copy waits in the device's queue, not here
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(labels.device))
        self.count = count

    def of(self, labels: torch.Tensor, shift_labels, ignore_index: int) -> int | None:
        """The count, for the loss of these labels (None where the loss got others than the forward: count them)."""
        if labels is not self.labels or shift_labels is not self.shift_labels or ignore_index != self.ignore_index:
            return None
        if self.ready is not None:
            self.ready.synchronize()  # the copy's event alone: not the work queued since
        return int(self.count)


class FusedLoss:
    """A model's `loss_function` while the fused loss is on, and the head's input it holds during one routed
    forward (step 2 sets `active` and makes `hold` the head's forward; step 3, `loss`, takes the input)."""

    hf_rtp_fused = True  # ForCausalLMLoss through the ring: read_head accepts it

    def __init__(self, model: PreTrainedModel, transforms: list[tuple[str, str]]):
        self.model = model
        self.transforms = transforms
        head = model.get_output_embeddings()
        # read_head found the head among the model's children
        self.head_name = next(n for n, m in model.named_children() if m is head)
        self.hidden: torch.Tensor | None = None
        self.labelled: Labelled | None = None
        self.active = False

    def hold(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return cast_for_matmul(hidden).new_empty(*hidden.shape[:-1], 0)

    def __call__(self, *args, **kwargs):
        return loss(self, *args, **kwargs)


def loss(
    fused: FusedLoss,
    logits,
    labels,
    vocab_size,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    **kwargs,
):
    """Step 3, the loss: vanilla's ForCausalLMLoss, or in a routed forward the same loss from the held hidden
    states through the ring's head, divided by `divisor`."""
    if not fused.active:
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    hidden, fused.hidden, fused.active = fused.hidden, None, False
    assert hidden is not None  # the head's forward ran in this fused forward and held its input
    counted = fused.labelled.of(labels, shift_labels, ignore_index) if fused.labelled is not None else None
    targets = _targets(labels, shift_labels, ignore_index).to(hidden.device)
    keep = targets != ignore_index
    # The kept tokens' rows, so the head's walks skip the ignored ones. Selected by index, the gradient goes back by
    # index too; a boolean mask would read on the host for each tensor it selects and in backward. By the count the
    # forward's start took (Labelled), no wait for the device's queue; else `nonzero` reads the count here.
    kept = (keep.nonzero() if counted is None else torch.nonzero_static(keep, size=counted)).squeeze(1)
    per_token = token_losses(
        fused.model,
        hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept),
        targets.index_select(0, kept),
        vocab_size,
        fused.transforms,
        ignore_index,
    )
    return per_token.sum() / divisor(num_items_in_batch, kept=keep, device=per_token.device)


def divisor(
    num_items_in_batch: Any,
    facts: context.Facts | None = None,
    kept: torch.Tensor | None = None,
    *,
    at_least: int = 0,
    device: torch.device | None = None,
) -> Any:
    """What a rotated causal LM's loss divides its summed token losses by, the one `num_items_in_batch`:

    - the caller's, when given (transformers' way to normalise over accumulated micro-batches), as given;
    - else, in a context-parallel block (`facts`, its forward's), the whole sequence's label count over the ring,
      so that every rank's share summed over the ring is vanilla's mean over the sequence;
    - else the label tokens `kept` marks (a boolean mask), vanilla's mean: nan where there are none;
    - else None: nothing counted yet, the loss that runs next counts them.

    A count is at least `at_least` (TRL's fused head counts at least 1: 0, not nan, for a batch without labels).
    On `device` when given, a tensor is moved there."""
    found = num_items_in_batch
    if found is None:
        if facts is not None:
            count = facts.labels
        elif kept is not None:
            count = kept.sum()
        else:
            return None
        found = count.clamp(min=at_least) if at_least else count
    return found.to(device) if device is not None and torch.is_tensor(found) else found
