"""engine.kernels.pdl: the kernels' PDL constexpr (0 off, 1 trigger at start, 2 late)."""
import torch

from engine.kernels import pdl


def test_pdl_mode_off_where_unsupported():
    # the CPU (and the Triton interpreter) never launch with PDL, whatever the switch says
    assert pdl.pdl_mode(torch.device("cpu")) == 0
    assert pdl.pdl_mode(torch.device("cpu"), False) == 0


def test_pdl_mode_follows_the_late_trigger_option():
    assert pdl.pdl_mode(torch.device("cpu"), True) == 1  # forced on: trigger at the start
    assert pdl.pdl_mode(torch.device("cpu"), True, late=True) == 2  # KernelOptions.pdl_late_trigger
    assert pdl.pdl_mode(torch.device("cpu"), False, late=True) == 0
