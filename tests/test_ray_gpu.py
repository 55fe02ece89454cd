"""Ray placement on a GPU: a one-node Ray cluster started by the test with the machine's first GPU; the engine's
worker lands in a bundle holding that GPU, sees it as its device through Ray's CUDA_VISIBLE_DEVICES, and gives the
tokens of the same engine launched locally on that GPU."""

from __future__ import annotations

import pytest
import torch
from flotilla import LLM, SamplingParams
from helpers_engine import write_tiny_tokenizer
from helpers_optional import require
from helpers_server import cluster_key
from helpers_tiny_models import random_tokens, write_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
ray = require("ray", "Ray placement's tests run a real Ray cluster")


def test_a_ray_placed_worker_runs_on_its_bundles_gpu_and_gives_the_local_tokens(tmp_path):
    from ray.cluster_utils import Cluster

    folder = write_tiny_model(tmp_path / "m", "qwen3")
    write_tiny_tokenizer(folder, vocab_size=320)
    prompts = [{"prompt_token_ids": random_tokens(n, seed=n)} for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    options = {"block_size": 16, "kv_cache_blocks": 64, "enforce_eager": True}
    with LLM(str(folder), **options) as llm:
        local = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.client.ready_detail["worker/0"]["device"].startswith("cuda")

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "num_gpus": 1, "include_dashboard": False})
    try:  # (the Ray node's address is beyond loopback, so the control plane authenticates with a cluster key)
        with cluster_key(tmp_path / "cluster.key"), \
                LLM(str(folder), distributed_executor_backend="ray", ray_address=cluster.address, **options) as llm:
            worker = next(h for h in llm.client.runtime.ray.hosts if "worker" in h.names)
            assert worker.gpus == 1 and ray.available_resources().get("GPU", 0) == 0  # (its bundle holds the GPU)
            assert llm.client.ready_detail["worker/0"]["device"] == "cuda:0"
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert outs == local
    finally:
        ray.shutdown()
        cluster.shutdown()
