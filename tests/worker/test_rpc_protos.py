"""The generated gRPC code matches pdserve.proto, and its messages round-trip."""

from __future__ import annotations

from rpc import codegen, pdserve_pb2, pdserve_pb2_grpc


def test_generated_code_is_current():
    assert codegen.stale_files() == [], "run: python -m rpc.codegen"


def test_services_have_the_contract_methods():
    services = pdserve_pb2.DESCRIPTOR.services_by_name
    decode = {m.name for m in services["DecodeWorker"].methods}
    prefill = {m.name for m in services["PrefillWorker"].methods}
    common = {m.name for m in services["Worker"].methods}  # both roles answer it: no stub by role
    assert common == {"TransferInfo", "Health", "Stats", "Metrics", "Drain", "ChangeRole"}
    assert decode == {"Generate", "Streams", "SetPeers"}
    assert prefill == {"Prefill", "Abort", "SetPeers"}
    assert services["DecodeWorker"].methods_by_name["Generate"].server_streaming
    assert hasattr(pdserve_pb2_grpc, "DecodeWorkerServicer") and hasattr(pdserve_pb2_grpc, "PrefillWorkerStub")


def test_messages_round_trip():
    req = pdserve_pb2.GenerateRequest(
        request_id="r-1", prompt_token_ids=[1, 2, 3], priority=2, prefill_workers=["127.0.0.1:7001"],
        params=pdserve_pb2.SamplingParams(temperature=0.7, max_tokens=16, seed=5, logit_bias={42: -3.0}),
    )
    back = pdserve_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req and back.params.HasField("seed") and not back.params.HasField("logprobs")
    resp = pdserve_pb2.GenerateResponse(finish_reason=pdserve_pb2.ERROR, error=pdserve_pb2.Error(
        code=pdserve_pb2.OVERLOADED, message="queue full", request_id="r-1"))
    assert pdserve_pb2.GenerateResponse.FromString(resp.SerializeToString()).error.request_id == "r-1"
