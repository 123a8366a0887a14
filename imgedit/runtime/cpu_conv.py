"""3-D convolutions on the CPU through oneDNN (DEVICE_MAP=cpu: the demo and the test suite).

PyTorch picks its native `slow_conv3d` (vol2col + matmul) over oneDNN for a 5-D float32 input whose
N*C*D*H is at most 20,480 with a kernel of at most 3 - a heuristic written for small 2-D images. The
Qwen VAE's causal 3-D convolutions on one frame always land there: the encoder's first convolution
over a 1-megapixel condition image took 0.58 s on one core, 0.12 s through oneDNN (same result to
2.5e-5; measured on the 2-core CI machine). Over one tiny-checkpoint edit (512x512, two steps, CFG
on) the VAE went from 2.4 to 1.2 CPU-s and the whole call from 3.3 to 2.1; the images differ by at
most one level. GPU runs never reach this code (the CUDA path is untouched).

PyTorch has no switch that forces oneDNN, and `torch.utils.mkldnn.to_mkldnn` replaces modules with
script modules that drop the VAE's causal padding, so each `nn.Conv3d` keeps its own forward (the
padding, the cache of past frames) and only its final convolution call is routed here.
"""

from __future__ import annotations

import functools

import torch


def _conv(conv: torch.nn.Conv3d, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if input.device.type == "cpu" and input.dtype == torch.float32 and weight.device.type == "cpu":
        return torch.mkldnn_convolution(input.contiguous(), weight, bias, conv.padding, conv.stride,
                                        conv.dilation, conv.groups)
    return torch.nn.Conv3d._conv_forward(conv, input, weight, bias)


def use_onednn(model: torch.nn.Module) -> int:
    """Route the model's zero-padded 3-D convolutions through oneDNN; returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in model.modules():
        if (isinstance(module, torch.nn.Conv3d) and module.padding_mode == "zeros"
                and not isinstance(module.padding, str)):
            module._conv_forward = functools.partial(_conv, module)
            count += 1
    return count
