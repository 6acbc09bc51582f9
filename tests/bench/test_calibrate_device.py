"""scripts/bench/calibrate_device.py on a tiny model: both constants come out measured and tabled, and the
logit chunk it varies changes the time, never the gradient."""

from __future__ import annotations

from unittest import mock

import torch
from transformers import AutoTokenizer

import gradian.capture.gradients as gradients
from circuitkit.models.loading import load_model
from gradian.capture.gradients import logit_chunk_rows, supervised_loss_grad
from scripts.bench.bench_gpu import PROXY_SHAPE, Setting, configs, model_dir, write_rows
from scripts.bench.calibrate_device import CHUNK_EXPONENTS, calibrate, markdown


def test_the_constants_are_measured_on_the_device_and_the_chunk_moves_no_gradient(tmp_path):
    shape = {**PROXY_SHAPE, "n_layers": 2}
    cpu = torch.device("cpu")
    path = model_dir(shape, torch.float32, cpu, tmp_path / "models")
    data = write_rows(tmp_path / "rows.jsonl", AutoTokenizer.from_pretrained(path), 2, (20, 40))
    model_cfg, grads = configs(path, data, "float32", Setting("tiny", shape, 2, 512, 2))
    loaded = load_model(model_cfg, cpu, keep_adapter=True)

    cal = calibrate(loaded, grads, small=True)
    overhead, chunk = cal["overhead"], cal["chunk"]
    assert len(overhead["points"]) == 6 and overhead["b_s_per_token"] > 0 and overhead["in_use"] == 32
    assert set(chunk["seconds"]) == set(CHUNK_EXPONENTS) and all(s > 0 for s in chunk["seconds"].values())
    assert chunk["in_use_elements"] == logit_chunk_rows(chunk["vocab"], cpu) * chunk["vocab"]
    table = markdown(cal)
    assert "| planner overhead per batch" in table and "| logit chunk" in table

    # The oracle: every chunk size gives the one-pass gradient.
    adapter, vocab = loaded.adapter, int(loaded.adapter.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, int(adapter.config.hidden_size), generator=g)
    targets, weights = torch.randint(0, vocab, (300,), generator=g), torch.rand(300, generator=g)
    grads_by_chunk = []
    for e in (10, 14, 26):
        with mock.patch.dict(gradients.LOGIT_CHUNK_ELEMENTS, {"cpu": 2**e}):
            grads_by_chunk.append(supervised_loss_grad(adapter, h, targets, weights, "ce"))
    for loss, grad in grads_by_chunk[1:]:
        torch.testing.assert_close(loss, grads_by_chunk[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, grads_by_chunk[0][1], rtol=1e-5, atol=1e-6)


def test_an_accelerator_takes_the_larger_chunk():
    assert logit_chunk_rows(49152, "cpu") == 2**22 // 49152 == logit_chunk_rows(49152)
    assert logit_chunk_rows(49152, torch.device("cuda")) == 2**24 // 49152 == logit_chunk_rows(49152, "mps")
    assert logit_chunk_rows(2**30, "cuda") == 1
