"""The unfused epilogue's quantisation refuses a name it does not know."""

from __future__ import annotations

import pytest
import torch

from arfuse.backends.torch.epilogue import quantize


def test_unknown_quant_raises_instead_of_running_nvfp4() -> None:
    with pytest.raises(ValueError, match=r"quant='int4'.*nvfp4"):
        quantize(torch.ones(2, 32), "int4", 1.0, "linear")
