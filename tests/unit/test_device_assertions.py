"""Device assertions (`torch._assert_async`, no host sync) hold CUDA's limit on their message on every device.

CUDA's `_assert_async` refuses a message of 255 characters or more ("Message length must be smaller than 255"),
where the CPU takes any: the first GPU run of `hf-rtp bench` met that in the token walk's check
(benchmarks/results/gpu-check-h100-run1.log). hf_rtp's wrapper refuses such a message on the CPU too, so the CPU
suite, which runs every call site, fails where a GPU user would have.
"""

from __future__ import annotations

import pytest
import torch

from hf_rtp.distributed.transport.token_walk import _UNREAD_SHORT
from hf_rtp.private.torch_names import ASSERT_MESSAGE_LIMIT, assert_async


def test_a_message_over_cudas_limit_is_refused_on_the_cpu_too():
    assert_async(torch.tensor(True), "x" * ASSERT_MESSAGE_LIMIT)  # 254: CUDA takes it
    with pytest.raises(ValueError, match="over CUDA's limit"):
        assert_async(torch.tensor(True), "x" * (ASSERT_MESSAGE_LIMIT + 1))


def test_a_false_condition_still_fails_with_the_message():
    with pytest.raises(RuntimeError, match="token ids must lie"):
        assert_async(torch.tensor(False), "token ids must lie in [0, 7)")


def test_the_token_walks_message_fits_without_the_weights_shapes():
    assert len(_UNREAD_SHORT.format(weights="")) <= ASSERT_MESSAGE_LIMIT
