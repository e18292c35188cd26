"""How .ci/gpu reads the NCCL library torch loaded and picks the world two ranks on one GPU share (gpu_world.py):
plain functions, checked on any machine; the GPU check runs them for real in its first stage."""

from gpu_world import GLOO_WORLD, NCCL_WORLD, choose, mapped_nccl, nccl_version


def test_ncclgetversion_codes_read_as_nccl_h_writes_them():
    assert nccl_version(23203) == (2, 32, 3)  # X*10000 + Y*100 + Z since NCCL 2.9
    assert nccl_version(22805) == (2, 28, 5)
    assert nccl_version(2804) == (2, 8, 4)  # X*1000 + Y*100 + Z before


def test_the_libnccl_files_a_process_maps_are_read_from_its_maps():
    maps = (
        "7f00-7f10 r--p 00000000 08:01 1 /opt/nccl/lib/libnccl.so.2.32.3\n"
        "7f10-7f20 r-xp 00010000 08:01 1 /opt/nccl/lib/libnccl.so.2.32.3\n"
        "7f20-7f30 r--p 00000000 08:01 2 /usr/lib/libnccl-net.so\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \n"
        "7f40-7f50 r--p 00000000 08:01 3 /site-packages/torch/lib/libtorch_cuda.so\n"
        "7f50-7f60 r--p 00000000 08:01 4 /path with spaces/libnccl.so.2\n"
    )
    # NCCL itself, once per file, not its network plugin
    assert mapped_nccl(maps) == ["/opt/nccl/lib/libnccl.so.2.32.3", "/path with spaces/libnccl.so.2"]
    assert mapped_nccl("") == []


def test_two_ranks_share_a_gpu_over_nccl_only_where_every_nccl_loaded_allows_it():
    nccl = {"HF_RTP_TEST_BACKEND": NCCL_WORLD, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert choose([(2, 30, 0)]) == choose([(2, 32, 3)]) == nccl
    gloo = {"HF_RTP_TEST_BACKEND": GLOO_WORLD}
    assert choose([(2, 28, 9)]) == choose([]) == gloo
    assert choose([(2, 32, 3), (2, 27, 7)]) == gloo  # two libraries mapped: the older one may be the one bound
