"""One in-process mesh serving HTTP beside gRPC, shared by the HTTP tests (tenants and
served name: ``tests.support.http_mesh``)."""

import pytest_asyncio

from gateway.tenants import TenantRegistry
from scheduler.config import SchedulerConfig
from tests.support.engines import make_engine
from tests.support.http_mesh import SERVED, write_tenants
from tests.support.mesh_harness import SHARED_MESH_EXECUTOR_TIMEOUT_S, start_local_mesh


@pytest_asyncio.fixture(scope="package")
async def http_mesh(tokenizer, tmp_path_factory):
    registry = TenantRegistry.from_file(write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.toml"))
    config = SchedulerConfig(tenant_quotas={t.name: t.kv_quota_blocks for t in registry.tenants},
                             executor_timeout_s=SHARED_MESH_EXECUTOR_TIMEOUT_S)
    m = await start_local_mesh([make_engine(num_blocks=256)], tokenizer, tenants=registry, http=True,
                               served_model_names=(SERVED,), scheduler_config=config)
    yield m
    await m.stop()
