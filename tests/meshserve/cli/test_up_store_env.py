"""``meshserve up`` hands the gateway its Redis stores in its environment
(``MESHSERVE_TASK_STORE``, ``MESHSERVE_RESULT_CACHE``), never on its command line: a
URL's password stays out of ``ps``, and the gateway still serves its tasks from that
Redis."""

import pytest
import redis.asyncio as aioredis

from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh import mesh_config
from meshserve.client import build_request, channel, submit_task, wait_task
from meshserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.redis_server import acl_user, redis_process_or_skip

PASSWORD = "s3cret-pw"


def _proc_file(pid: int, name: str) -> list[str]:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read().decode().split("\0")


@pytest.fixture
def redis():
    yield from redis_process_or_skip()


@pytest.mark.model
async def test_up_keeps_the_task_stores_password_off_every_command_line(redis, tmp_path):
    url = acl_user(redis.url, "meshserve", PASSWORD, "+@all")
    mesh = Mesh(mesh_config(0, 1, "default", "float32", "256MiB", [], None, str(tmp_path), task_store=url))
    await mesh.start()
    try:
        for name, proc in mesh.procs:
            assert not any(PASSWORD in arg for arg in _proc_file(proc.pid, "cmdline")), name
        gateway = dict(mesh.procs)["gateway"]
        assert f"MESHSERVE_TASK_STORE={url}" in _proc_file(gateway.pid, "environ")
        async with channel(mesh.gateway_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            request = build_request("Name a colour.", max_tokens=3, temperature=0, ignore_eos=True)
            task_id = (await submit_task(stub, request)).task_id
            status = await wait_task(stub, task_id, poll_s=0.05, timeout_s=300)
        assert status.state == gateway_pb2.TASK_STATE_SUCCEEDED, status
        assert len(status.choices[0].token_ids) == 3
        inspect = aioredis.from_url(redis.url)
        try:  # the task is in that Redis: the gateway read the variable, not a default store
            assert [k.decode() for k in await inspect.keys("meshserve:task:*")] == [f"meshserve:task:{task_id}"]
        finally:
            await inspect.aclose()
    finally:
        mesh.stop()
