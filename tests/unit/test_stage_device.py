"""Devices, precision and the stash bound of a stage, on the CPU (CUDA-only checks skip without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from swarmpipe.peer.config import default_threads
from swarmpipe.peer.spec import SpecError, spec_from_dict
from swarmpipe.peer.stage.device import DeviceError, device_info, resolve_device, to_device, to_host
from swarmpipe.peer.stage.precision import LossScale, PrecisionError, resolve_precision
from swarmpipe.peer.stage.runtime import StageRuntime, UnknownMicrobatch

pytestmark = pytest.mark.timeout(60)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_spec(**extra):
    data = {"num_stages": 2, "microbatch_size": 2, "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}}
    data.update(extra)
    return spec_from_dict(data)


def batch(seed: int = 0):
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- devices
def test_device_names_resolve_or_fail_clearly():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else resolve_device("auto").type)
    for bad in ("gpu", "cuda:x", "tpu", "cuda:123"):
        with pytest.raises(DeviceError, match="expected auto, cpu, cuda, cuda:N or mps"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve_device("cuda")
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve_device("cuda:1")


def test_cpu_info_and_threads_follow_the_machine():
    info = device_info(torch.device("cpu"))
    assert info.name == "cpu" and 0 < info.free_bytes <= info.total_bytes
    assert "GiB free" in info.describe()
    assert 1 <= default_threads() <= (os.cpu_count() or 1)


def test_host_tensors_stay_put_on_the_cpu():
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t and to_host(t) is t


# ---------------------------------------------------------------- precision
def test_precision_defaults_and_refusals():
    cpu = torch.device("cpu")
    auto = resolve_precision(tiny_spec().precision, cpu)
    assert auto.compute == torch.float32 and not auto.autocast and not auto.scaled
    assert resolve_precision(tiny_spec(precision={"compute": "bf16"}).precision, cpu).compute == torch.bfloat16
    with pytest.raises(PrecisionError, match="fp16.*needs a CUDA device"):
        resolve_precision(tiny_spec(precision={"compute": "fp16"}).precision, cpu)
    with pytest.raises(SpecError, match="compute must be"):
        tiny_spec(precision={"compute": "int8"})
    with pytest.raises(SpecError, match="bf16 weights need bf16 compute"):
        tiny_spec(precision={"compute": "fp32", "weights": "bf16"})


def test_bf16_compute_trains_and_keeps_fp32_master_weights_and_a_fp32_wire():
    fp32 = StageRuntime(tiny_spec(), 1)
    bf16 = StageRuntime(tiny_spec(precision={"compute": "bf16"}), 1)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    targets = batch(1)
    exact, mixed = fp32.forward_backward(x, targets), bf16.forward_backward(x, targets)
    assert mixed.applied and abs(mixed.loss - exact.loss) < 0.05
    assert mixed.grad_input.dtype == torch.float32  # the reply's codec sees float32 whatever computed it
    assert all(p.dtype == torch.float32 for p in bf16.weights.module.parameters())
    assert bf16.evaluate(x, targets).dtype == torch.float32


def test_bf16_weights_halve_the_stage_and_states_still_travel_in_fp32():
    runtime = StageRuntime(tiny_spec(precision={"compute": "bf16", "weights": "bf16"}), 0)
    assert all(p.dtype == torch.bfloat16 for p in runtime.weights.module.parameters())
    out = runtime.forward("mb", batch())
    assert out.dtype == torch.float32
    runtime.backward("mb", torch.ones_like(out))
    state = runtime.weights.export_state()
    assert all(t.dtype == torch.float32 for k, t in state.tensors.items() if k.startswith("param."))


def test_loss_scale_grows_shrinks_and_unscales():
    scale = LossScale(True, initial=8.0, growth_interval=2)
    grads = [torch.full((2,), 16.0), None]
    assert scale.unscale(grads) and torch.equal(grads[0], torch.full((2,), 2.0))
    assert scale.unscale([torch.ones(1)]) and scale.scale == 16.0  # two clean steps: doubled
    assert not scale.unscale([torch.tensor([float("inf")])]) and scale.scale == 8.0 and scale.overflows == 1
    off = LossScale(False)
    g = torch.ones(1)
    assert off.scale_grad(g) is g and off.unscale([torch.tensor([float("inf")])])


# ---------------------------------------------------------------- the stash bound
def test_the_stash_bound_drops_the_oldest_version_counted_and_its_backward_replays():
    probe = StageRuntime(tiny_spec(), 0)
    snapshot = sum(p.numel() * p.element_size() for p in probe.weights.trainable().values())
    runtime = StageRuntime(tiny_spec(), 0, stash_bound_bytes=2 * snapshot)
    grad = torch.ones(2, 8, 16)
    runtime.forward("old", batch(0))  # version 0, kept out
    runtime.forward("a", batch(1))
    runtime.backward("a", grad)  # -> version 1
    runtime.forward("mid", batch(2))  # version 1, kept out
    runtime.forward("b", batch(3))
    runtime.backward("b", grad)  # -> version 2
    assert len(runtime.pending.versions()) == 2 and runtime.stats.dropped_stash_bound == 0
    runtime.forward("new", batch(4))  # a third snapshot would pass the bound: version 0 goes
    assert runtime.stats.dropped_stash_bound == 1
    assert len(runtime.pending.versions()) == 2 and runtime.pending.snapshot_bytes() <= 2 * snapshot
    with pytest.raises(UnknownMicrobatch):
        runtime.backward("old", grad)
    replayed = runtime.replay_backward(batch(0), grad)  # what the trainer does: nothing is lost
    assert replayed.applied
    for mb in ("mid", "new"):
        assert runtime.backward(mb, grad).applied


# ---------------------------------------------------------------- CUDA
@CUDA
def test_a_cuda_stage_matches_the_cpu_stage():
    cpu = StageRuntime(tiny_spec(precision={"compute": "fp32"}), 1)
    gpu = StageRuntime(tiny_spec(precision={"compute": "fp32"}), 1, device="cuda")
    assert all(p.device.type == "cuda" for p in gpu.weights.module.parameters())
    x, targets = torch.randn(2, 8, 16), batch(1)
    a, b = cpu.forward_backward(x, targets), gpu.forward_backward(x, targets)
    assert b.grad_input.device.type == "cpu" and abs(a.loss - b.loss) < 1e-4
    torch.testing.assert_close(a.grad_input, b.grad_input, atol=1e-4, rtol=1e-3)


@CUDA
def test_cuda_auto_precision_is_bf16_and_trains():
    gpu = StageRuntime(tiny_spec(), 0, device="cuda")
    assert gpu.precision.compute == torch.bfloat16
    out = gpu.forward("mb", batch())
    assert out.device.type == "cpu" and gpu.backward("mb", torch.ones_like(out)).applied
