"""The msgpack wire format of Sample and ScoredSample: lossless round trips, and a
WireFormatError for every kind of malformed message."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

import msgpack
import pytest

from rlplatform.transport.samples import (SCHEMA_VERSION, ResultMeta, Sample, ScoredSample, WireFormatError,
                                          decode_meta, decode_sample, decode_scored, encode_meta, encode_sample,
                                          encode_scored)


def make_sample(**changes) -> Sample:
    fields = dict(
        sample_id="g7/3", group_id="g7", policy="policy-a", prompt="37+48=", completion="85",
        prompt_ids=[3, 7, 11, 4, 8, 12], completion_ids=[8, 5, 2],
        behaviour_logprobs=[-0.125, -1.0000000001, -3.5e-7], token_versions=[4, 4, 5],
        row={"prompt": "37+48=", "answer": "85", "difficulty": 2, "tags": ["a", "b"]},
    )
    fields.update(changes)
    return Sample(**fields)


def test_sample_round_trip_keeps_every_field():
    sample = make_sample()
    decoded = decode_sample(encode_sample(sample))
    assert decoded == sample
    assert asdict(decoded) == asdict(sample)
    assert decoded.behaviour_logprobs == [-0.125, -1.0000000001, -3.5e-7]  # float64, bit exact
    assert decoded.row["difficulty"] == 2 and decoded.row["tags"] == ["a", "b"]
    assert decoded.version == 4


def test_completion_mask_round_trips_and_defaults_to_empty():
    multi_turn = make_sample(completion_mask=[1, 0, 1])
    assert decode_sample(encode_sample(multi_turn)).completion_mask == [1, 0, 1]
    assert make_sample().completion_mask == [] and decode_sample(encode_sample(make_sample())).completion_mask == []


def test_empty_completion_round_trip():
    sample = make_sample(completion="", completion_ids=[], behaviour_logprobs=[], token_versions=[])
    decoded = decode_sample(encode_sample(sample))
    assert decoded == sample and decoded.version == 0


def test_scored_round_trip_keeps_every_field():
    scored = ScoredSample(make_sample(), reward=0.75, components={"exact_match": 1.0, "length": -0.25})
    decoded = decode_scored(encode_scored(scored))
    assert decoded == scored
    assert decoded.sample == scored.sample
    assert decoded.reward == 0.75 and decoded.components == {"exact_match": 1.0, "length": -0.25}
    assert decoded.error is None


def test_scored_round_trip_keeps_reasons():
    scored = ScoredSample(make_sample(), reward=0.0, components={"code_tests": 0.0}, reasons={"code_tests": "timeout"})
    assert decode_scored(encode_scored(scored)).reasons == {"code_tests": "timeout"}


def test_scored_round_trip_with_error():
    scored = ScoredSample(make_sample(), reward=0.0, components={}, error="boom: ValueError: bad")
    decoded = decode_scored(encode_scored(scored))
    assert decoded == scored and decoded.error == "boom: ValueError: bad"


def packed_sample(**changes) -> dict:
    body = {"v": SCHEMA_VERSION, "sample": asdict(make_sample())}
    body["sample"].update(changes)
    return body


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"not msgpack at all \xff\xfe", b"\x93\x01\x02"])
def test_garbage_bytes(data):
    with pytest.raises(WireFormatError):
        decode_sample(data)
    with pytest.raises(WireFormatError):
        decode_scored(data)


def test_non_map_record():
    with pytest.raises(WireFormatError, match="not a map"):
        decode_sample(msgpack.packb([1, 2, 3]))


@pytest.mark.parametrize("version", [0, 2, None, "1"])
def test_wrong_schema_version(version):
    body = packed_sample()
    body["v"] = version
    with pytest.raises(WireFormatError, match="schema version"):
        decode_sample(msgpack.packb(body))
    scored = msgpack.unpackb(encode_scored(ScoredSample(make_sample(), 1.0, {"exact_match": 1.0})))
    scored["v"] = version
    with pytest.raises(WireFormatError, match="schema version"):
        decode_scored(msgpack.packb(scored))


def test_missing_schema_version():
    body = packed_sample()
    del body["v"]
    with pytest.raises(WireFormatError, match="schema version"):
        decode_sample(msgpack.packb(body))


@pytest.mark.parametrize("name", ["sample_id", "group_id", "policy", "prompt", "completion", "prompt_ids",
                                  "completion_ids", "behaviour_logprobs", "token_versions", "row"])
def test_missing_field(name):
    body = packed_sample()
    del body["sample"][name]
    with pytest.raises(WireFormatError, match=f"'{name}'"):
        decode_sample(msgpack.packb(body))


def test_missing_sample_map():
    with pytest.raises(WireFormatError, match="no 'sample' map"):
        decode_sample(msgpack.packb({"v": SCHEMA_VERSION}))


@pytest.mark.parametrize("name,value", [
    ("sample_id", 17), ("group_id", None), ("completion", [1, 2]), ("prompt_ids", "3 7 11"),
    ("completion_ids", {"0": 8}), ("behaviour_logprobs", -0.5), ("token_versions", 4), ("row", ["85"]),
])
def test_wrong_typed_field(name, value):
    body = packed_sample(**{name: value})
    with pytest.raises(WireFormatError, match=f"'{name}'"):
        decode_sample(msgpack.packb(body))


@pytest.mark.parametrize("changes", [
    {"behaviour_logprobs": [-0.1, -0.2]},
    {"token_versions": [4, 4, 5, 5]},
    {"completion_ids": [8]},
])
def test_per_token_lists_of_different_lengths(changes):
    body = packed_sample(**changes)
    with pytest.raises(WireFormatError, match="differ in length"):
        decode_sample(msgpack.packb(body))


@pytest.mark.parametrize("changes", [
    {"reward": "1.0"}, {"reward": None}, {"components": [1.0]}, {"error": 5},
    {"reasons": ["timeout"]}, {"reasons": {"code_tests": 3}}, {"reasons": {"code_tests": ""}},
    {"reasons": {"code_tests": "x" * 65}},
])
def test_bad_scored_fields(changes):
    body = msgpack.unpackb(encode_scored(ScoredSample(make_sample(), 1.0, {"exact_match": 1.0})))
    body.update(changes)
    with pytest.raises(WireFormatError):
        decode_scored(msgpack.packb(body))


def test_scored_with_bad_sample_is_rejected():
    body = msgpack.unpackb(encode_scored(ScoredSample(make_sample(), 1.0, {"exact_match": 1.0})))
    body["sample"]["token_versions"] = [1]
    with pytest.raises(WireFormatError, match="differ in length"):
        decode_scored(msgpack.packb(body))


@pytest.mark.parametrize("name,value", [
    ("completion_ids", [8, "5", 2]), ("prompt_ids", [3, None]), ("behaviour_logprobs", [-0.1, "x", -0.3]),
    ("token_versions", [4, None, 5]), ("token_versions", [4, 4.5, 5]), ("completion_ids", [8, True, 2]),
    ("completion_mask", [1, True, 0]), ("completion_mask", [1, 0.0, 1]), ("completion_mask", [1, 2, 0]),
])
def test_wrong_typed_per_token_values(name, value):
    body = packed_sample(**{name: value})
    with pytest.raises(WireFormatError, match=f"'{name}'"):
        decode_sample(msgpack.packb(body))


def test_integer_logprob_is_accepted():
    decoded = decode_sample(msgpack.packb(packed_sample(behaviour_logprobs=[0, -1, -0.5])))
    assert decoded.behaviour_logprobs == [0, -1, -0.5]


def test_completion_mask_round_trips_and_marks_the_model_tokens():
    sample = make_sample(completion_ids=[8, 5, 2, 9], behaviour_logprobs=[-0.5, 0.0, 0.0, -1.0],
                         token_versions=[6, 6, 6, 7], completion_mask=[1, 0, 0, 1])
    decoded = decode_sample(encode_sample(sample))
    assert decoded == sample and decoded.completion_mask == [1, 0, 0, 1]
    assert decoded.trained_tokens == 2 and decoded.version == 6
    observation_first = make_sample(token_versions=[9, 4, 9], completion_mask=[1, 0, 1])
    assert observation_first.version == 9  # an observation's version does not count


def test_records_without_a_completion_mask_decode_as_all_model_tokens():
    body = packed_sample()
    del body["sample"]["completion_mask"]
    decoded = decode_sample(msgpack.packb(body))
    assert decoded.completion_mask == [] and decoded.trained_tokens == 3


@pytest.mark.parametrize("mask, reason", [
    ([1, 0], "has 2 entries for 3 completion tokens"),
    ([1, 2, 0], "list of 0 and 1"),
    ([1, True, 0], "list of 0 and 1"),
    ("110", "list of 0 and 1"),
])
def test_malformed_completion_mask_is_rejected(mask, reason):
    with pytest.raises(WireFormatError, match=reason):
        decode_sample(msgpack.packb(packed_sample(completion_mask=mask)))


def test_teacher_scores_round_trip_and_must_cover_every_completion_token():
    sample = Sample("g/0", "g", "device", "1+1=", "2", prompt_ids=[1, 2], completion_ids=[3, 4],
                    behaviour_logprobs=[-0.5, -0.7], token_versions=[0, 0],
                    teacher_logprobs=[-0.1, -2.0], teacher_version=3)
    back = decode_sample(encode_sample(sample))
    assert (back.teacher_logprobs, back.teacher_version) == ([-0.1, -2.0], 3)
    assert ResultMeta.of(ScoredSample(back, 1.0, {})).teacher_version == 3
    for bad in ([-0.1], ["x", -2.0]):
        with pytest.raises(WireFormatError, match="'teacher_logprobs' must be empty or a number per completion token"):
            decode_sample(encode_sample(dataclasses.replace(sample, teacher_logprobs=bad)))


def test_teacher_top_tokens_round_trip_and_must_pair_ids_with_log_probs_per_completion_token():
    sample = Sample("g/0", "g", "device", "1+1=", "2", prompt_ids=[1, 2], completion_ids=[3, 4],
                    behaviour_logprobs=[-0.5, -0.7], token_versions=[0, 0], teacher_logprobs=[-0.1, -2.0],
                    teacher_version=3, teacher_top_ids=[[3, 5], [6, 4]], teacher_top_logprobs=[[-0.1, -2.5], [-0.2, -2.0]])
    back = decode_sample(encode_sample(sample))
    assert (back.teacher_top_ids, back.teacher_top_logprobs) == ([[3, 5], [6, 4]], [[-0.1, -2.5], [-0.2, -2.0]])
    for ids, logprobs in (([[3, 5]], [[-0.1, -2.5]]),  # one token of two
                          ([[3, 5], [6]], [[-0.1, -2.5], [-0.2, -2.0]]),  # an id short
                          ([[3, 5], [6]], [[-0.1, -2.5], [-0.2]]),  # paired, but k differs between tokens
                          ([[3, 5], [6, 4.0]], [[-0.1, -2.5], [-0.2, -2.0]]),  # an id not an integer
                          ([[3, 5], [6, 4]], [[-0.1, -2.5], [-0.2, "x"]])):
        with pytest.raises(WireFormatError, match="'teacher_top_ids' and 'teacher_top_logprobs' must be empty or"):
            decode_sample(encode_sample(dataclasses.replace(sample, teacher_top_ids=ids, teacher_top_logprobs=logprobs)))


def test_the_prompt_position_travels_to_the_controllers_record_and_must_be_an_integer():
    sample = Sample("g/0", "g", "device", "1+1=", "2", prompt_ids=[1, 2], completion_ids=[3],
                    behaviour_logprobs=[-0.5], token_versions=[0], prompt_position=17)
    back = decode_sample(encode_sample(sample))
    assert back.prompt_position == 17
    meta = ResultMeta.of(ScoredSample(back, 1.0, {}))
    assert decode_meta(encode_meta(meta)).prompt_position == 17
    without = packed_sample()
    del without["sample"]["prompt_position"]
    assert decode_sample(msgpack.packb(without)).prompt_position == -1  # a record without one: none
    with pytest.raises(WireFormatError, match="'prompt_position' must be integers"):
        decode_sample(encode_sample(dataclasses.replace(sample, prompt_position="17")))
    with pytest.raises(WireFormatError, match="'prompt_position' must be integers"):
        decode_meta(encode_meta(dataclasses.replace(meta, prompt_position=1.5)))
