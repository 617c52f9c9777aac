"""Suite-wide settings.

radbo's client work is thousands of tiny tensor operations, for which intra-op threads only add
synchronisation (on a busy 2-core machine a tiny forward and backward ran ~3,000x slower on two
threads than on one). The suite therefore runs with one intra-op thread; tests about threads set
their own count and restore it.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
