"""``meshserve task TASK_ID``: read, wait for or cancel an async task (registered by ``meshserve.cli``).

``meshserve generate --async`` submits; this command reads a task submitted earlier.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Optional

import typer


def task_command(
    task_id: str = typer.Argument(..., help="The id SubmitTask returned."),
    addr: str = typer.Option("127.0.0.1:50051", "--addr", help="Gateway host:port."),
    cancel: bool = typer.Option(False, "--cancel", help="Cancel the task (CancelTask) instead of reading it."),
    wait: bool = typer.Option(False, "--wait", help="Poll until the task is done."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MESHSERVE_API_KEY"),
) -> None:
    """Print an async task's status (GetTask) as one JSON object; exit 1 when it failed or is unknown."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from meshserve.client import cancel_task, channel, get_task, wait_task
    from meshserve.v1 import gateway_pb2, gateway_pb2_grpc

    async def main() -> int:
        metadata = (("x-api-key", api_key),) if api_key else ()
        async with channel(addr) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            try:
                if cancel:
                    status = await cancel_task(stub, task_id, metadata)
                else:
                    status = await (wait_task if wait else get_task)(stub, task_id, metadata)
            except grpc.aio.AioRpcError as exc:
                print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True)))
        return 1 if status.state == gateway_pb2.TASK_STATE_FAILED else 0

    sys.exit(asyncio.run(main()))
