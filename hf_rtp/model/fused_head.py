"""The fused LM-head loss on a rotated causal LM: in training, with labels, no [tokens, vocab] logits.

A family qualifies when its forward, read as code, does exactly what the fused loss reproduces:
`logits = self.lm_head(hidden_states)`, then at most the transforms `HeadTransform` knows (Cohere's
`* self.logit_scale`, Granite's `/ self.config.logits_scaling`, Gemma 2/3's final-logit soft-capping),
then `loss = self.loss_function(logits, labels, ...)` with transformers' ForCausalLMLoss. Everything
else the forward does (the backbone, MoE's aux loss added to the loss, the output class) stays
vanilla's own code. Any other head is left on the plain path, with a log line saying why.

This module reads a head (`read_head`) and computes its losses through the ring (`token_losses`, and
`token_stats` for TRL's fused head); how a forward reaches them, the head holding its input while the model's
own transforms run on an empty tensor, is model/forward.py's.
"""

from __future__ import annotations

import ast
import inspect
import operator
import textwrap

from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from ..layers import RotatedLinear
from ..layers.common import cast_for_matmul, local
from ..layers.fused_loss import HeadTransform, fused_cross_entropy, fused_token_stats
from ..private.torch_names import assert_async
from ..private.transformers_names import own_loss_function

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
