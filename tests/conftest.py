import pytest
import torch


@pytest.fixture(autouse=True)
def _reset_torch_state():
    """Every test starts from the same seed and default dtype, whatever the previous one did."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
