"""match_causal_conv1d: HF's causal depthwise conv (padded conv1d, first positions kept) -> torch_causal_conv1d;
counts and numerics with a dynamic sequence, and the convolutions it must leave alone."""

import torch
import torch.nn.functional as F

from helpers import count, export_gm, run_transform

CONV = torch.ops.auto_deploy.torch_causal_conv1d.default
CHANNELS, KERNEL = 6, 4


class CausalConv(torch.nn.Module):
    """``causal_conv1d_fn`` as HF writes it (LFM2's short convolution), or a variant that must not match."""

    def __init__(self, groups=CHANNELS, padding=KERNEL - 1, keep_first=True):
        super().__init__()
        self.conv = torch.nn.Conv1d(CHANNELS, CHANNELS, KERNEL, groups=groups, padding=padding)
        self.keep_first = keep_first

    def forward(self, x):  # x [b, c, s]
        y = F.conv1d(x, self.conv.weight, self.conv.bias, padding=self.conv.padding, groups=self.conv.groups)
        return (y[:, :, : x.shape[-1]] if self.keep_first else y).sin()  # all s + k - 1 outputs: not causal


def _export(module):
    seq = torch.export.Dim("seq", min=3, max=64)
    return export_gm(module, torch.randn(2, CHANNELS, 5), dims={2: seq})


def test_matches_and_computes_the_same():
    torch.manual_seed(0)
    module = CausalConv().eval()
    gm = _export(module)
    assert count(gm, torch.ops.aten.conv1d.default) == 1
    gm = run_transform("match_causal_conv1d", gm, "pattern_matcher")
    assert count(gm, torch.ops.aten.conv1d.default) == 0 and count(gm, CONV) == 1
    x = torch.randn(2, CHANNELS, 11)
    with torch.no_grad():
        torch.testing.assert_close(gm(x)[0], module(x), atol=1e-6, rtol=1e-6)


def test_other_convolutions_are_left_alone():
    for module in (CausalConv(groups=1), CausalConv(padding=1), CausalConv(keep_first=False)):
        gm = run_transform("match_causal_conv1d", _export(module.eval()), "pattern_matcher")
        assert count(gm, torch.ops.aten.conv1d.default) == 1 and count(gm, CONV) == 0
