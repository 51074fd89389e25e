import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before
# diff_transformer.ops.triton_diff decorates them (this file is imported before any test module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _reset_torch_state():
    """Every test starts from the same seed and default dtype, whatever the previous one did."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
