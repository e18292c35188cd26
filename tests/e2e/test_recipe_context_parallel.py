"""recipes/finetune.py --context_parallel, launched with torchrun: two ranks that cut each sequence across their
ring train as one process on the whole sequences does (same data order, same schedule): two steps, so the
second starts from the first's update."""

import sys

from support.recipes import finetune, metrics, run, torchrun


def test_the_recipe_with_context_parallelism_trains_as_one_process(tmp_path):
    steps = ["--per_device_batch_size", "2", "--seq_len", "48", "--warmup_steps", "0"]
    run([sys.executable, *finetune(tmp_path / "one", 2, *steps)])
    run([*torchrun(2), *finetune(tmp_path / "ring", 2, *steps, "--context_parallel")])
    alone, ring = metrics(tmp_path / "one"), metrics(tmp_path / "ring")
    assert [m["step"] for m in ring] == [1, 2]
    for one, two in zip(alone, ring, strict=True):
        # float32: the ring's sums run in another order than one process's
        assert abs(one["loss"] - two["loss"]) < 2e-4 * one["loss"], (one, two)
        assert abs(one["grad_norm"] - two["grad_norm"]) < 2e-3 * one["grad_norm"], (one, two)
    assert alone[-1]["loss"] < alone[0]["loss"]  # it trains
