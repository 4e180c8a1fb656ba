"""``GET /v1/models/{model}``: one served name's model object, the same as its entry of
``/v1/models``; an unknown name is 404 ``model_not_found``, as a completion naming it
gets. The openai client's ``models.retrieve`` reads it (names with slashes too)."""

from __future__ import annotations

import dataclasses

import httpx2 as httpx
import openai
import pytest

from tests.support.inprocess_app import MODEL, app_client

SERVED = dataclasses.replace(MODEL, served_model_names=("HuggingFaceTB/SmolLM2-135M-Instruct", "smol"))
NOT_FOUND = {"error": {"message": "model 'gpt-4o' is not served here (this gateway serves "
                                  "'HuggingFaceTB/SmolLM2-135M-Instruct', 'smol')",
                       "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


async def test_one_model_is_its_entry_of_the_list_and_an_unknown_one_is_404(tokenizer):
    async with app_client(tokenizer, model=SERVED) as http:
        listed = (await http.get("/v1/models")).json()["data"]
        for entry in listed:
            r = await http.get(f"/v1/models/{entry['id']}")
            assert (r.status_code, r.json()) == (200, entry)
        assert listed[1] == {"id": "smol", "object": "model", "created": 0, "owned_by": "meshserve",
                             "root": "smollm2-135m-instruct", "max_model_len": 2048}
        r = await http.get("/v1/models/gpt-4o")
        assert (r.status_code, r.json()) == (404, NOT_FOUND)
        r = await http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "Hi"})
        assert (r.status_code, r.json()) == (404, NOT_FOUND)  # the same answer as a completion naming it


async def test_the_openai_clients_retrieve_reads_it(tokenizer):
    async with app_client(tokenizer, model=SERVED) as http:
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=http._transport))
        model = await client.models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct")  # its slash travels as %2F
        assert (model.id, model.object, model.owned_by) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "model",
                                                           "meshserve")
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve("gpt-4o")
        assert err.value.status_code == 404 and err.value.code == "model_not_found"
