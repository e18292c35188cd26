"""The fused LM-head loss on a rotated causal LM: in training, with labels, no [tokens, vocab] logits.

A family qualifies when its forward, read as code, does exactly what the fused loss reproduces:
`logits = self.lm_head(hidden_states)`, then at most the transforms `HeadTransform` knows (Cohere's
`* self.logit_scale`, Granite's `/ self.config.logits_scaling`, Gemma 2/3's final-logit soft-capping),
then `loss = self.loss_function(logits, labels, ...)` with transformers' ForCausalLMLoss. Everything
else the forward does (the backbone, MoE's aux loss added to the loss, the output class) stays
vanilla's own code. Any other head is left on the plain path, with a log line saying why.

The mechanism: for the length of one forward, the head returns an empty [batch, seq, 0] tensor and
keeps its input; the model's own transforms run on that empty tensor; its `loss_function` (replaced
on this model) computes the loss from the kept hidden states through the ring.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap
import types

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from .. import log
from ..layers import RotatedLinear
from ..layers.common import cast_for_matmul, local
from ..layers.fused_loss import HeadTransform, fused_cross_entropy, fused_token_stats
from ..private.torch_names import assert_async
from ..private.transformers_names import own_loss_function
from . import context

# The transforms vanilla applies between the head and the loss, by their exact code (`logits` stands
# for whatever the forward calls its logits): field of HeadTransform -> attribute read on the model.
_TRANSFORMS = {
    "logits = logits * self.logit_scale": ("multiply", "logit_scale"),
    "logits = logits / self.config.logits_scaling": ("divide", "config.logits_scaling"),
    "if self.config.final_logit_softcapping is not None:\n    logits = logits / self.config.final_logit_softcapping\n"
    "    logits = torch.tanh(logits)\n    logits = logits * self.config.final_logit_softcapping": (
        "softcap",
        "config.final_logit_softcapping",
    ),
}


class _Renamer(ast.NodeTransformer):
    def __init__(self, name: str):
        self.name = name

    def visit_Name(self, node):
        return ast.Name("logits", node.ctx) if node.id == self.name else node


def _is_self_call(node, attribute: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attribute
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def read_head(model: PreTrainedModel) -> tuple[list[tuple[str, str]], str | None]:
    """The transforms of `model`'s head as (HeadTransform field, model attribute) pairs, and why the
    fused loss cannot reproduce its forward (None when it can)."""
    head = model.get_output_embeddings()
    attribute = next((n for n, m in model.named_children() if m is head), None)
    if not isinstance(head, RotatedLinear) or attribute is None:
        return [], "its LM head is not a rotated linear layer of the model itself"
    own = own_loss_function(model)  # set on this model: by hf_rtp (accepted) or by its user
    if not (getattr(own, "hf_rtp_fused", False) or (own is None and model.loss_function is ForCausalLMLoss)):
        return [], "its loss is not transformers' ForCausalLMLoss"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return [], "the source of its forward is not available"
    if not isinstance(tree, ast.FunctionDef):
        return [], "its forward is not a plain function"
    body = tree.body
    at = next(
        (
            i
            for i, s in enumerate(body)
            if isinstance(s, ast.Assign)
            and len(s.targets) == 1
            and isinstance(s.targets[0], ast.Name)
            and _is_self_call(s.value, attribute)
        ),
        None,
    )
    if at is None:
        return [], f"its forward does not compute `logits = self.{attribute}(hidden_states)`"
    assignment = body[at]
    assert isinstance(assignment, ast.Assign) and isinstance(assignment.targets[0], ast.Name)  # found so above
    name = assignment.targets[0].id
    transforms, rest = [], body[at + 1 :]
    while rest and not (isinstance(rest[0], ast.If) and ast.unparse(rest[0].test) == "labels is not None"):
        text = ast.unparse(_Renamer(name).visit(rest.pop(0)))
        if text == "loss = None":
            continue
        if text not in _TRANSFORMS:
            return [], f"its forward transforms the logits in a way the fused loss does not reproduce: `{text}`"
        transforms.append(_TRANSFORMS[text])
    if (
        not rest
        or not isinstance(rest[0], ast.If)
        or not rest[0].body
        or not (isinstance(rest[0].body[0], ast.Assign) and _is_self_call(rest[0].body[0].value, "loss_function"))
    ):
        return [], "its forward does not call self.loss_function(logits, labels, ...) right after the head"
    call = rest[0].body[0].value
    assert isinstance(call, ast.Call)  # _is_self_call accepted it
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
    if not (isinstance(first, ast.Name) and first.id == name):
        return [], "its loss is not computed from the head's logits"
    # after the loss the logits may only be returned (they come back as None)
    for statement in rest[0].body[1:] + rest[1:]:
        returned = isinstance(statement, ast.Return) or (
            isinstance(statement, ast.If) and ast.unparse(statement.test) == "not return_dict"
        )
        if name in _names(statement) and not returned:
            return [], f"its forward uses the logits after the loss: `{ast.unparse(statement).splitlines()[0]}`"
    return transforms, None


class _Capture:
    """The head's input during one fused forward."""

    def __init__(self):
        self.hidden: torch.Tensor | None = None
        self.active = False

    def hold(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return cast_for_matmul(hidden).new_empty(*hidden.shape[:-1], 0)


def token_losses(model, hidden, targets, vocab_size, transforms, ignore_index=-100):
    """Per-token -log p(target) of `hidden` [tokens, hidden] through `model`'s rotated head and its
    `transforms` (from `read_head`)."""
    return fused_cross_entropy(*_head_inputs(model, hidden, targets, vocab_size, transforms, ignore_index))


def token_stats(model, hidden, targets, vocab_size, transforms, extras, ignore_index=-100, **options):
    """As `token_losses`, with TRL's `extras` beside it (`fused_token_stats`); `options` go to HeadTransform."""
    inputs = _head_inputs(model, hidden, targets, vocab_size, transforms, ignore_index, **options)
    return fused_token_stats(*inputs, extras=extras)


def _head_inputs(model, hidden, targets, vocab_size, transforms, ignore_index, **options):
    head = model.get_output_embeddings()
    found = {field: operator.attrgetter(path)(model) for field, path in transforms}
    transform = HeadTransform(**found, **options)
    assert_async(
        ((targets >= 0) & (targets < vocab_size)).all(), f"labels must be {ignore_index} or lie in [0, {vocab_size})"
    )
    return cast_for_matmul(hidden), local(head.weight), local(head.bias), targets, head.ring, head.layout, transform


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
    capture = _Capture()
    head_name = next((n for n, m in model.named_children() if m is model.get_output_embeddings()), None)

    def loss_function(
        logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
    ):
        if not capture.active:
            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
        hidden, capture.hidden, capture.active = capture.hidden, None, False
        assert hidden is not None  # the head's forward ran in this fused forward and held its input
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        keep = targets != ignore_index
        # The forward's one read on the host (on CUDA, a wait for the device): the kept tokens' rows, once, so
        # the head's walks skip the ignored ones (a prompt's). Selected by index, the gradient goes back by index
        # too; a boolean mask would read again for each tensor it selects and in backward.
        kept = keep.nonzero().squeeze(1)
        per_token = token_losses(
            model,
            hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept),
            targets.index_select(0, kept),
            vocab_size,
            transforms,
            ignore_index,
        )
        if num_items_in_batch is None:
            return per_token.sum() / keep.sum()  # vanilla's mean over kept tokens (nan when there are none)
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(per_token.device)
        return per_token.sum() / num_items_in_batch

    positional = [  # the forward's parameters a caller may pass by position (input_ids first), for the block's checks
        name
        for name, p in inspect.signature(type(model).forward).parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]

    @functools.wraps(type(model).forward)  # generate and Trainer read the model's signature through it
    def forward(self, *args, return_logits: bool = False, **kwargs):
        run = context.active(self)
        if run is not None:  # one sequence across the ring: checked inputs, the sequence's loss
            if len(args) > len(positional):
                raise TypeError(f"{type(self).__name__}.forward takes {len(positional)} positional arguments")
            kwargs = {**dict(zip(positional, args, strict=False)), **kwargs}  # by position too: the checks see them
            return context.forward(run, lambda **kw: routed(self, return_logits=return_logits, **kw), kwargs)
        return routed(self, *args, return_logits=return_logits, **kwargs)

    def routed(self, *args, return_logits: bool = False, **kwargs):
        plain = type(self).forward
        if (
            not fused
            or return_logits
            or not self.training
            or kwargs.get("labels") is None
            or kwargs.get("logits_to_keep")
        ):
            return plain(self, *args, **kwargs)
        assert head_name is not None  # read_head found the head among the model's children
        head = getattr(self, head_name)
        # replaced since loading: a PEFT adapter on the head, a user's own loss_function
        if not isinstance(head, RotatedLinear) or own_loss_function(self) is not loss_function:
            return plain(self, *args, **kwargs)
        capture.active = True
        head.forward = capture.hold  # type: ignore[method-assign,assignment]  # this forward only; deleted below
        try:
            out = plain(self, *args, **kwargs)
        finally:
            del head.forward
            missed, capture.active, capture.hidden = capture.active, False, None
        if missed:
            raise RuntimeError(f"{type(self).__name__}.forward did not compute its loss from the LM head's output")
        return _without_logits(out)

    if fused:
        loss_function.hf_rtp_fused = True  # type: ignore[attr-defined]  # ForCausalLMLoss through the ring: read_head accepts it
        model.loss_function = loss_function
    model.forward = types.MethodType(forward, model)
    return fused


def _without_logits(out):
    """The output with logits None (training forwards with labels never build them)."""
    if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...)
        return (out[0], None, *out[2:])
    return type(out)(**{k: v for k, v in out.items() if k != "logits"})
