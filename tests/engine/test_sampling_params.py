import subprocess
import sys

import pytest

from engine.sampling_params import SamplingParams


def test_defaults_match_vllm_names_and_values():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1, 1.0, 1.0, -1, None, 16)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.ignore_eos and p.skip_special_tokens and not p.structured and not p.greedy


def test_normalisation():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(temperature=0).greedy and isinstance(
        SamplingParams(temperature=1).temperature, float
    )
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(json_object=True).structured


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "x"}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"json_schema": "not a dict"}, "json_schema"),
        ({"json_schema": {"type": "string", "default": float("nan")}}, "json_schema"),
        ({"json_schema": {"type": "bogus"}}, "json_schema"),
        ({"json_object": True, "regex": "a"}, "at most one"),
        ({"regex": ""}, "regex"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json_schema": {"type": "bogus"}},
     'json_schema is not a supported JSON Schema: Unsupported type "bogus"'),
    ({"regex": "a("},
     "regex is not supported: Regex parsing error at position 3: The parenthesis is not closed."),
])
def test_a_grammar_the_compiler_refuses_is_named_without_its_log_prefix(kwargs, message):
    """The client reads what is wrong with its schema, not the compiler's clock and C++ source path."""
    with pytest.raises(ValueError) as refused:
        SamplingParams(**kwargs)
    assert str(refused.value) == message


def test_valid_json_schema_accepted():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert SamplingParams(json_schema=schema).json_schema == schema


def test_import_is_torch_free():
    code = "import sys, engine.sampling_params as m; m.SamplingParams(n=2); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
