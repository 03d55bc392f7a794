"""``ray-attn`` refuses bad arguments with one line naming the field (argparse's exit 2), never a
pydantic traceback, and a GPU request on a cluster without GPUs fails at once instead of waiting
for a placement group that can never be placed."""

from __future__ import annotations

import pytest

from ray_attn.cli import main


@pytest.mark.parametrize("argv,line", [
    (["demo", "--tp", "3"], "ray-attn: error: tensor_parallel_size=3 must divide num_attention_heads=4"),
    (["demo", "--tp", "0"], "ray-attn: error: tensor_parallel_size: Input should be greater than 0"),
])
def test_bad_arguments_get_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == line and not any("Traceback" in x or "pydantic" in x for x in err)


@pytest.mark.slow
def test_cuda_on_a_cluster_without_gpus_fails_at_once(capsys):
    import ray
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    started = not ray.is_initialized()
    try:
        with pytest.raises(SystemExit) as e:
            main(["demo", "--device", "cuda", "--num-blocks", "64"])
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    assert e.value.code == 2
    assert "parallel.device='cuda' needs 2 GPU(s)" in capsys.readouterr().err
