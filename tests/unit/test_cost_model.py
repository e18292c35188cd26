"""hf_rtp/tools/cost.py, the multi-node table of docs/multi-node.md: the formulas say what its docstring says.
(test_two_dimensional.py checks the ring's real bytes against the same counting.)"""

import pytest

from hf_rtp.tools import cost

P = 10**9  # parameters


def test_a_ring_inside_a_node_sends_its_chunks_three_times_over_nvlink_and_reduces_over_the_network():
    flat = cost.rtp(P, world=8, per_node=8)
    # bf16 weights walk twice, float32 gradients once
    assert flat.intra == pytest.approx((2 * 2 + 4) * P * 7 / 8) and flat.inter == 0
    grid = cost.rtp(P, world=32, per_node=8, rtp_size=8)
    assert grid.intra == flat.intra
    assert grid.inter == pytest.approx(
        2 * (4 - 1) / 4 * 4 * P / 8
    )  # ring all-reduce of a float32 1/8 chunk over 4 replicas
    assert grid.memory == pytest.approx(P * cost.STATE_BYTES / 8 + cost.POOL_BYTES)
    # the all-reduce runs during earlier layers' backward: the two links overlap
    assert grid.seconds == pytest.approx(max(grid.intra / cost.NVLINK_BYTES_S, grid.inter / cost.NETWORK_BYTES_S))


def test_a_ring_across_nodes_runs_at_network_speed():
    across = cost.rtp(P, world=16, per_node=8)
    assert across.ring_crosses_nodes and across.intra == 0
    assert across.seconds == pytest.approx((2 * 2 + 4) * P * 15 / 16 / cost.NETWORK_BYTES_S)
    assert across.seconds > 5 * cost.rtp(P, world=16, per_node=8, rtp_size=8).seconds


def test_a_ring_sends_what_fsdp2_sends_over_as_many_ranks_inside_a_node():
    assert cost.rtp(P, 8, 8).intra == pytest.approx(cost.fsdp(P, 8, 8, P // 32).intra)


def test_hsdp_and_rings_per_node_send_the_same_over_the_network_and_fsdp2_more():
    layer = P // 32
    grid, hsdp, fsdp2 = (cost.rtp(P, 32, 8, 8), cost.fsdp(P, 32, 8, layer, 8), cost.fsdp(P, 32, 8, layer))
    assert grid.inter == pytest.approx(hsdp.inter)
    assert fsdp2.inter > 1.2 * hsdp.inter  # float32 gradients make the replicas' all-reduce the larger share
    assert fsdp2.memory < hsdp.memory  # but FSDP2 holds a quarter of the states


def test_the_readme_table_covers_both_models_and_every_strategy():
    table = cost.table()
    for row in (
        "Llama-3-8B | 2 x 8 | RTP, rings of 8 (2-D)",
        "Llama-3-70B | 4 x 8 | FSDP2",
        "HSDP, shards of 8",
        "RTP, one flat ring",
        "(ring at network speed)",
    ):
        assert row in table
    params, layer = cost.counts(cost.llama3("8B"))
    assert 8.0e9 < params < 8.1e9 and 2.1e8 < layer < 2.3e8
