"""One in-process mesh serving HTTP beside gRPC, shared by the HTTP tests: tenants
in file mode (two keys of tenant ``a``, one of ``b``; ``quota`` may hold one KV
block), the model served as ``smol``."""

import textwrap

import pytest
import pytest_asyncio

from scheduler.admission import SchedulerConfig
from gateway.tenants import TenantRegistry
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh

KEY_A, KEY_B, KEY_QUOTA = "key-a", "key-b", "key-quota"
SERVED = "smol"


@pytest.fixture(scope="package")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(textwrap.dedent(f"""
        [[tenants]]
        name = "a"
        api_keys = ["{KEY_A}"]
        [[tenants]]
        name = "b"
        api_keys = ["{KEY_B}"]
        [[tenants]]
        name = "quota"
        api_keys = ["{KEY_QUOTA}"]
        kv_quota_blocks = 1
    """))
    return path


@pytest_asyncio.fixture(scope="package")
async def http_mesh(tokenizer, tenants_file):
    registry = TenantRegistry.from_file(tenants_file)
    config = SchedulerConfig(tenant_quotas={t.name: t.kv_quota_blocks for t in registry.tenants})
    m = await start_local_mesh([make_engine(num_blocks=256)], tokenizer, tenants=registry, http=True,
                               served_model_names=(SERVED,), scheduler_config=config)
    yield m
    await m.stop()
