"""gateway.proto_convert and the mesh client's message conversion: exact values both
ways, and the same bytes on the wire as messages built field by field."""

from __future__ import annotations

import numpy as np

from gateway.collector import CompletedChoice
from gateway.events import ChoiceResult, Delta, FinishReason, Queued, Timings, TokenLogprob, TopLogprob, Usage
from gateway.mesh import Admission, ExecutorOutput
from gateway.mesh_client import admit_request, output_from_proto
from gateway.proto_convert import (finish_reason_from_proto, finish_reason_to_proto, logprobs_from_proto,
                                   logprobs_to_proto, request_from_proto, request_to_proto, response_of,
                                   result_from_proto, result_to_proto, task_result, task_result_choices)
from gateway.request import ChatOptions, GenerationRequest
from meshserve.client import build_request
from meshserve.sampling import SamplingParams
from meshserve.v1 import common_pb2, executor_pb2, gateway_pb2, scheduler_pb2

F32 = float(np.float32(-0.1))  # a logprob as float32 carries it: exact through the messages
LOGPROB = TokenLogprob(7, F32, (TopLogprob(7, F32), TopLogprob(9, -2.5)))
LOGPROB_MSG = common_pb2.TokenLogprob(token_id=7, logprob=-0.1, top=[common_pb2.TopLogprob(token_id=7, logprob=-0.1),
                                                                      common_pb2.TopLogprob(token_id=9, logprob=-2.5)])


def result(**kw) -> ChoiceResult:
    fields = dict(request_id="r1", index=1, finish_reason=FinishReason.LENGTH,
                  usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0, kvstore_tokens=0),
                  timings=Timings(queue_s=0.0, ttft_s=0.25, tpot_s=0.0, e2e_s=0.5), prompt_token_ids=(1, 2, 3),
                  executor_id="executor-0", stop_reason="", prompt_logprobs=(LOGPROB,), cached=False)
    return ChoiceResult(**{**fields, **kw})


def test_requests_keep_which_prompt_form_is_set():
    assert request_from_proto(build_request("")) == GenerationRequest(
        prompt="", sampling=SamplingParams(max_tokens=16, temperature=1.0))
    chat = request_from_proto(build_request(chat=[("system", "Be brief."), ("user", "Hi")], request_id="c1"),
                              default_request_id="task-1")
    assert (chat.chat, chat.prompt, chat.prompt_token_ids, chat.request_id) == (
        (("system", "Be brief."), ("user", "Hi")), None, None, "c1")
    ids = request_from_proto(build_request([5, 6], priority=0, top_p=0.0, n=17), default_request_id="task-1")
    assert (ids.prompt_token_ids, ids.priority, ids.request_id, ids.input_kind) == ((5, 6), 0, "task-1",
                                                                                   "prompt_token_ids")
    assert (ids.sampling.top_p, ids.sampling.n) == (0.0, 17)  # not validated here: the core does that
    none = request_from_proto(gateway_pb2.GenerateRequest())
    assert (none.input_kind, none.priority, none.request_id, none.sampling) == (None, None, "", SamplingParams())


def test_chat_options_and_the_stop_string_flag_come_from_the_request_and_go_back_unchanged():
    msg = gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role="user", content="Hi", name="ann"),
                  gateway_pb2.ChatMessage(role="assistant", content="Hel", name=""),
                  gateway_pb2.ChatMessage(role="user", content="?")],
        add_generation_prompt=False, continue_final_message=True, chat_template_kwargs='{"b": 1, "a": 2}'),
        include_stop_str_in_output=True)
    r = request_from_proto(msg)
    assert r.chat_options == ChatOptions(add_generation_prompt=False, continue_final_message=True,
                                         template_kwargs='{"b": 1, "a": 2}', names=("ann", "", None))
    assert r.include_stop_str_in_output is True
    back = request_to_proto(r)  # every sampling field written, the rest as sent
    assert (back.chat, back.include_stop_str_in_output) == (msg.chat, True)
    plain = request_from_proto(build_request(chat=[("user", "Hi")]))  # unset: today's rendering
    assert (plain.chat_options, plain.include_stop_str_in_output) == (ChatOptions(), False)
    assert not request_to_proto(plain).chat.HasField("add_generation_prompt")
    assert request_from_proto(build_request("Hi")).chat_options == ChatOptions()


def test_a_cache_salt_is_carried_and_an_unset_one_stays_unset():
    assert request_from_proto(build_request("Hi")).cache_salt is None
    assert request_from_proto(build_request("Hi", cache_salt="")).cache_salt == ""  # set: the core refuses it
    salted = request_from_proto(build_request("Hi", cache_salt="s1"))
    assert salted.cache_salt == "s1" and request_to_proto(salted).cache_salt == "s1"
    assert not request_to_proto(request_from_proto(build_request("Hi"))).HasField("cache_salt")


def test_results_are_the_same_message_and_bytes_as_built_by_hand():
    by_hand = gateway_pb2.GenerateResult(
        request_id="r1", finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2),
        timings=common_pb2.Timings(ttft_s=0.25, e2e_s=0.5), prompt_token_ids=[1, 2, 3], executor_id="executor-0",
        index=1, prompt_logprobs=[LOGPROB_MSG])
    msg = result_to_proto(result())
    assert msg == by_hand and msg.SerializeToString() == by_hand.SerializeToString()
    zero = result_to_proto(result(usage=Usage(0, 0), timings=Timings(0.0, 0.0, 0.0, 0.0), prompt_logprobs=()))
    assert zero.HasField("usage") and zero.HasField("timings")  # present even when all zero, as before
    cached = result_to_proto(result(cached=True, executor_id="", finish_reason=None, stop_reason="\n"))
    assert (cached.cached, cached.executor_id, cached.finish_reason, cached.stop_reason) == (
        True, "", common_pb2.FINISH_REASON_UNSPECIFIED, "\n")


def test_stream_messages_of_each_event():
    assert response_of(Queued(2, 1.5)) == gateway_pb2.GenerateResponse(
        queue=gateway_pb2.QueueUpdate(position=2, estimated_wait_s=1.5))
    assert response_of(Delta(1, "lo", (11, 12), (LOGPROB,))) == gateway_pb2.GenerateResponse(
        delta=gateway_pb2.TokenDelta(text="lo", token_ids=[11, 12], index=1, logprobs=[LOGPROB_MSG]))
    assert response_of(result()) == gateway_pb2.GenerateResponse(result=result_to_proto(result()))


def test_a_task_result_is_a_task_status_with_its_choices():
    choices = [CompletedChoice(0, "A", (20,), (), result(index=0, finish_reason=FinishReason.STOP)),
               CompletedChoice(1, "Hello", (10, 11), (LOGPROB, LOGPROB), result())]
    status = gateway_pb2.TaskStatus.FromString(task_result(choices))
    assert status == gateway_pb2.TaskStatus(choices=[
        gateway_pb2.TaskChoice(index=0, text="A", token_ids=[20],
                               result=result_to_proto(result(index=0, finish_reason=FinishReason.STOP))),
        gateway_pb2.TaskChoice(index=1, text="Hello", token_ids=[10, 11], logprobs=[LOGPROB_MSG, LOGPROB_MSG],
                               result=result_to_proto(result()))])
    assert not gateway_pb2.TaskStatus.FromString(task_result([CompletedChoice(0)])).choices[0].HasField("result")


def test_finish_reasons_and_logprobs_round_trip():
    for number in (1, 2, 3):
        assert finish_reason_to_proto(finish_reason_from_proto(number)) == number
    assert (finish_reason_from_proto(0), finish_reason_to_proto(None), finish_reason_from_proto(99)) == (
        None, 0, FinishReason.ABORT)
    assert logprobs_from_proto([LOGPROB_MSG]) == (LOGPROB,)
    assert logprobs_to_proto([LOGPROB]) == [LOGPROB_MSG]


def test_executor_outputs_and_admissions_as_the_mesh_client_converts_them():
    out = executor_pb2.ExecuteResponse(token_ids=[4, 5], finish_reason=common_pb2.FINISH_REASON_STOP,
                                       num_cached_tokens=16, index=2, logprobs=[LOGPROB_MSG, LOGPROB_MSG],
                                       num_kvstore_tokens=16)
    assert output_from_proto(out) == ExecutorOutput(index=2, token_ids=(4, 5), finish_reason=FinishReason.STOP,
                                                    num_cached_tokens=16, num_kvstore_tokens=16,
                                                    logprobs=(LOGPROB, LOGPROB))
    assert output_from_proto(executor_pb2.ExecuteResponse()) == ExecutorOutput(index=0, token_ids=())
    a = Admission("r1", "acme", 3, 40, 8, "m", 2, (b"\x01" * 16, b"\x02" * 16), 16)
    assert admit_request(a) == scheduler_pb2.AdmitRequest(
        request_id="r1", tenant="acme", priority=3, num_prompt_tokens=40, max_tokens=8, model="m", n=2,
        block_hashes=[b"\x01" * 16, b"\x02" * 16], hash_block_size=16)
    off = admit_request(Admission("r1", "acme", 0, 4, 8, "m", 1))
    assert list(off.block_hashes) == [] and off.hash_block_size == 0


def test_a_stop_token_id_survives_the_result_message_and_a_stored_result():
    stopped, plain = result(finish_reason=FinishReason.STOP, stop_token_id=0), result()
    msg = result_to_proto(stopped)
    assert (msg.HasField("stop_token_id"), msg.stop_token_id) == (True, 0)  # id 0 is set, not absent
    assert not result_to_proto(plain).HasField("stop_token_id")
    assert (result_from_proto(msg), result_from_proto(result_to_proto(plain))) == (stopped, plain)
    choices = [CompletedChoice(0, "A", (0,), (), stopped), CompletedChoice(1, "B", (9,), (), plain)]
    assert task_result_choices(task_result(choices)) == choices
