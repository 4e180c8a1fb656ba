"""One in-process mesh on the default model, shared by the mesh tests."""

import pytest
import pytest_asyncio

from scheduler.config import SchedulerConfig
from tests.support.engines import make_engine
from tests.support.mesh_harness import SHARED_MESH_EXECUTOR_TIMEOUT_S, start_local_mesh


@pytest.fixture(scope="session")
def default_engine():
    return make_engine()


@pytest_asyncio.fixture(scope="session")
async def mesh(default_engine, tokenizer):
    m = await start_local_mesh([default_engine], tokenizer,
                               scheduler_config=SchedulerConfig(executor_timeout_s=SHARED_MESH_EXECUTOR_TIMEOUT_S))
    yield m
    await m.stop()
