"""The VAE's causal 3-D convolutions as 2-D ones for a single image (every placement, CPU and GPU).

`QwenImageCausalConv3d` pads each input in time with two zero frames in front (its causal padding) and
runs a 3x3x3 convolution. For one image (one frame, no frames cached from a previous chunk: every
encode and decode here) two of the kernel's three time taps multiply those zero frames, so the output
is exactly a 2-D convolution of the frame with the kernel's last time slice - a third of the work. The
sums are the same ones in another order (float32 on the CPU: within 1e-5; the test pins it against the
module's own forward, so a change in diffusers' class shows up there).

On the CPU it also leaves PyTorch's `slow_conv3d` (vol2col + matmul), which PyTorch picks over oneDNN
for any 5-D float32 input with N*C*D*H at most 20,480: the encoder's first convolution over a
1-megapixel condition image took 0.58 s on one core, 0.07 s as a 2-D convolution. One tiny-checkpoint
edit (512x512, two steps, CFG on) went from 3.3 to ~2 CPU-s (measured on the 2-core CI machine).
Video inputs (several frames) and later chunks (a frame cache) take the module's own path. Installed as a
diffusers hook with its own forward on each convolution (`HookRegistry`, as step_cache.py's hooks are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from imgedit.model import internals

HOOK = "imgedit_single_frame"


def _forward(conv, original, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    pad_w, _, pad_h, _, pad_t, _ = internals.causal_padding(conv)
    if x.shape[2] != 1 or (cache_x is not None and pad_t > 0):
        return original(x, cache_x)
    weight = conv.weight[:, :, -1]  # the tap that meets the frame; the others meet the causal zeros
    y = F.conv2d(x[:, :, 0], weight, conv.bias, conv.stride[1:], (pad_h, pad_w), conv.dilation[1:],
                 conv.groups)
    return y.unsqueeze(2)


def install(vae: torch.nn.Module) -> int:
    """Route the VAE's causal 3-D convolutions through `_forward`; returns how many."""
    count = 0
    for module in vae.modules():
        padding = internals.causal_padding(module)
        if (isinstance(module, torch.nn.Conv3d)
                and module.padding_mode == "zeros" and module.padding == (0, 0, 0)
                and isinstance(padding, tuple) and len(padding) == 6 and padding[5] == 0
                and module.kernel_size[0] == padding[4] + 1
                and module.stride[0] == 1 and module.dilation[0] == 1):
            HookRegistry.check_if_exists_or_initialize(module).register_hook(SingleFrame(), HOOK)
            count += 1
    return count


class SingleFrame(ModelHook):
    """A single frame through a 2-D convolution; anything else through the module's own forward."""

    def new_forward(self, module: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None):
        return _forward(module, self.fn_ref.original_forward, x, cache_x)
