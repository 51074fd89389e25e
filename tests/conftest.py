import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before
# diff_transformer.ops.triton_diff decorates them (this file is imported before any test module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from diff_transformer.files import CACHE_ENV  # noqa: E402 (after the switch above)


def pytest_configure(config):
    """The suite builds what it caches (the embedded corpus's shards) into a folder of its own, made
    empty for this session, unless DIFF_TRANSFORMER_CACHE names one: no test can pass on what an earlier
    run or this machine left in ~/.cache, and the suite never writes there. Set in the controlling
    process before pytest-xdist starts its workers, which inherit it and share one folder (the corpus
    is built once, under its lock: data.corpus.default_dataset). A folder named that does not exist
    yet is made here, as the commands make it on first use."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its share of the cores, not all of them each
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput.get("workercount", 1))))
        return
    if os.environ.get(CACHE_ENV):
        os.makedirs(os.environ[CACHE_ENV], exist_ok=True)
        return
    folder = tempfile.mkdtemp(prefix="diff-transformer-test-cache-")
    os.environ[CACHE_ENV] = folder
    config._session_cache = folder


def pytest_unconfigure(config):
    folder = getattr(config, "_session_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(CACHE_ENV, None)


@pytest.fixture(autouse=True)
def _reset_torch_state():
    """Every test starts from the same seed and default dtype, whatever the previous one did."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
