"""The checksum ranks compare before each ungathered EVA forward (integrations/peft.py, `_batch_digest`): equal for
equal batches whatever their container, different where any value differs, even deep inside a tensor whose repr
would elide it, and no silent guess for a value it cannot compare."""

import numpy
import torch
from transformers import BatchEncoding

from hf_rtp.integrations.peft import _UNCOMPARED, _batch_digest


def _batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_equal_batches_digest_alike_whatever_holds_them():
    ids = torch.arange(5000).reshape(2, 2500)
    plain = _batch_digest(_batch(ids))
    assert plain[1] == "" and plain[0] != _UNCOMPARED
    assert _batch_digest(BatchEncoding(_batch(ids.clone()))) == plain  # transformers' tokenizer output
    assert _batch_digest(_batch(ids.t().contiguous().t())) == plain  # another memory layout of the same values
    assert _batch_digest({"attention_mask": torch.ones_like(ids), "input_ids": ids}) == plain  # key order


def test_any_difference_changes_the_digest():
    ids = torch.arange(5000).reshape(2, 2500)
    plain = _batch_digest(_batch(ids))[0]
    middle = ids.clone()
    middle[1, 1250] += 1  # where a tensor's repr shows "..."
    assert _batch_digest(BatchEncoding(_batch(middle)))[0] != plain
    assert _batch_digest(_batch(ids.to(torch.int32)))[0] != plain
    assert _batch_digest(_batch(ids.reshape(1, 5000)))[0] != plain
    assert _batch_digest([ids.numpy()])[0] != _batch_digest([ids.numpy() + 1])[0]
    assert _batch_digest({"input_ids": ids, "labels": None})[0] != _batch_digest({"input_ids": ids})[0]


def test_views_that_torch_cannot_reinterpret_are_read_by_value():
    z = torch.complex(torch.arange(4.0), torch.ones(4))
    assert _batch_digest(z.conj()) == _batch_digest(z.conj().resolve_conj())


def test_values_it_cannot_compare_are_named_not_guessed():
    assert _batch_digest({"input_ids": torch.ones(2, 3), "extra": object()}) == (_UNCOMPARED, "object")
    assert _batch_digest(numpy.array([object()]))[0] == _UNCOMPARED
    assert _batch_digest(torch.ones(2, 2).to_sparse())[0] == _UNCOMPARED
