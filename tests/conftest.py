import os

import pytest

from tests.scheduling import children_write_bytecode, compile_workspace_sources, restore_xdist_groups, start_rank

# Tests must never reach a hub; everything is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
children_write_bytecode()


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process gloo group for the module's tests (FSDP2 and the steps' all-reduces need one); a group another
    test already made is left alone."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once, in the controller (or the only process with -n 0)
        compile_workspace_sources()


@pytest.hookimpl(trylast=True)  # after xdist's loadgroup hook
def pytest_collection_modifyitems(config, items):
    restore_xdist_groups(config, items)
    items.sort(key=start_rank)
