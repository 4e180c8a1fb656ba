"""The gRPC side of model names: ``ListModels`` and the optional ``model`` field of
``GenerateRequest``, checked against the served names as HTTP's ``model`` is."""

import grpc
import pytest

from meshserve.client import build_request, generate
from meshserve.v1 import gateway_pb2
from tests.support.http_mesh import KEY_A, SERVED

pytestmark = pytest.mark.model
AUTH = (("x-api-key", KEY_A),)


async def test_list_models_names_the_served_model(http_mesh):
    reply = await http_mesh.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=AUTH)
    engine = http_mesh.engines[0]
    assert [(m.id, m.root, m.max_model_len) for m in reply.models] == [(SERVED, engine.model_id,
                                                                        engine.max_model_len)]


async def test_list_models_needs_a_key(http_mesh):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await http_mesh.stub.ListModels(gateway_pb2.ListModelsRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_generate_with_a_served_model_runs_and_another_is_not_found(http_mesh):
    request = build_request("Hi", max_tokens=2, temperature=0)
    request.model = SERVED
    out = await generate(http_mesh.stub, request, AUTH)
    assert len(out.token_ids) == 2
    request.model = "gpt-4"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(http_mesh.stub, request, AUTH)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'gpt-4' is not served here" in err.value.details()
