"""Shared fixtures: one real redis-server and one local Ray cluster for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on an ephemeral port with a password; yields its URL."""
    from rlplatform.transport.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_client(redis_server):
    from rlplatform.transport.redis_server import connect

    client = connect(redis_server)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test that needs actors, which start forked from a warm interpreter
    as a job's do (rlplatform.warm_start). Its log monitor, which nothing here reads
    (log_to_driver=False), looks for new worker log files every 5 s instead of on each 0.1 s poll: the session
    gathers hundreds of them (every actor's), and globbing 60 dead actors' files on each poll took 2.4 CPU-s a
    minute against 0.9."""
    from unittest import mock

    import ray

    from rlplatform.warm_start import VLLM_MODULES, local_workers_forked

    log_monitor = {"LOG_NAME_UPDATE_INTERVAL_S": "5", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
    with mock.patch.dict(os.environ, log_monitor), local_workers_forked(VLLM_MODULES):  # the suite's vLLM workers too
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory):
    """A freshly initialised demo policy saved in Hugging Face format; yields its directory."""
    from rlplatform.config import ModelConfig
    from rlplatform.policy import save_initial_policy

    path = tmp_path_factory.mktemp("policy")
    return save_initial_policy(ModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), 0, str(path))


def pytest_collection_modifyitems(config, items):
    """Files with a test marked `slow` run first: pytest-xdist hands out whole files in this order
    (`--no-loadscope-reorder`; its default puts the files with the most tests first), so the 2 workers start
    the longest files early and end together instead of one finishing a long file alone.
    Tests marked `gpu` need CUDA (vLLM, NCCL); on a CPU machine they are skipped."""
    import torch

    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file's tests stay together, in order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not any node named gpu
            item.add_marker(skip)


@pytest.fixture(scope="session")
def greedy_accuracy():
    """`fn(model_dir, job_config)`: held-out greedy accuracy of a saved policy, recomputed outside the
    job with plain Hugging Face `generate`, to compare with what the job's evaluator reported."""
    import torch

    from rlplatform.data import load_rows
    from rlplatform.policy import load_policy

    def accuracy(model_dir: str, config) -> float:
        model, tokenizer = load_policy(model_dir)
        _, test_rows = load_rows(config.data, config.seed)
        correct = 0
        with torch.no_grad():
            for row in test_rows:
                prompt = tokenizer(row["prompt"], return_tensors="pt")
                out = model.generate(**prompt, max_new_tokens=config.eval.max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
                text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
                correct += text.strip() == str(row["answer"]).strip()
        return correct / len(test_rows)
    return accuracy
