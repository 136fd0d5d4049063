"""The target's attention in this process never takes SDPA's cuDNN backend on a GPU: cuDNN plans per
shape on the host, and decoding and capture change shapes at every call (draftlab/target/attention.py)."""
import contextlib

import torch

from draftlab.features import extract
from draftlab.target import attention
from tests.support.micro import make_micro_model


def backends() -> dict:
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled()}


def test_on_a_gpu_sdpa_may_pick_every_backend_but_cudnn_and_the_choice_is_given_back_after():
    before = backends()
    with attention.attention_kernels("cuda"):
        assert backends() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert backends() == before
    with attention.attention_kernels("cpu"):  # nothing to avoid off a GPU
        assert backends() == before


def test_capture_runs_the_targets_forward_inside_the_kernel_choice(monkeypatch):
    model = make_micro_model("llama", num_layers=2)
    seen = []
    forward = model.model.forward

    def recording_forward(*a, **kw):
        seen.append(entered[-1] if entered else None)
        return forward(*a, **kw)

    entered = []

    @contextlib.contextmanager
    def kernels(device):
        entered.append(torch.device(device))
        yield
        entered.append(None)  # left: a forward after this would see None

    monkeypatch.setattr(extract, "attention_kernels", kernels)
    monkeypatch.setattr(model.model, "forward", recording_forward)
    extract.capture(model, torch.randint(5, 200, (2, 7)), None, [1, 2])
    assert seen == [torch.device("cpu")]  # the one forward ran inside, for the batch's own device
