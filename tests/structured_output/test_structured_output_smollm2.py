"""Structured output with SmolLM2 (the default model): 20 JSON schemas (nested objects,
arrays, enums, required fields, number ranges, strings with patterns), greedy and at
temperature 0.8, every output parses and validates with `jsonschema`; plus regex, choice and
an EBNF arithmetic grammar. The full set is slow; the default run checks a few."""

from __future__ import annotations

import json

import pytest
from so_cases import ARITHMETIC, CODE_REGEX, check_arithmetic, check_json, check_regex

from deepinfer_dp import LLM, SamplingParams, StructuredOutputsParams

S = {"type": "string", "minLength": 1, "maxLength": 24}
INT = {"type": "integer", "minimum": 0, "maximum": 1000}


def obj(required: bool = True, **props) -> dict:
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = list(props)
    return schema


SCHEMAS = [
    obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(title=S, year={"type": "integer", "minimum": 1900, "maximum": 2030}, rating={"type": "number",
                                                                                      "minimum": 0, "maximum": 10}),
    obj(city=S, country=S, population={"type": "integer", "minimum": 1}),
    obj(color={"enum": ["red", "green", "blue"]}, hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    obj(tags={"type": "array", "items": S, "minItems": 1, "maxItems": 4}),
    obj(user=obj(name=S, email={"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"})),
    obj(point=obj(x={"type": "number"}, y={"type": "number"})),
    obj(items={"type": "array", "items": obj(sku=S, qty={"type": "integer", "minimum": 1, "maximum": 99}),
               "minItems": 1, "maxItems": 3}),
    obj(status={"enum": ["open", "closed", "pending"]}, priority={"type": "integer", "minimum": 1, "maximum": 5}),
    obj(ok={"type": "boolean"}, message=S),
    obj(date={"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, event=S),
    obj(temperature={"type": "number", "minimum": -50, "maximum": 60}, unit={"enum": ["C", "F"]}),
    obj(book=obj(title=S, author=obj(first=S, last=S)), pages=INT),
    obj(matrix={"type": "array", "items": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2},
                "minItems": 2, "maxItems": 2}),
    obj(name=S, nickname={"anyOf": [S, {"type": "null"}]}),
    obj(False, name=S, age=INT) | {"required": ["name"]},
    obj(code={"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, count=INT),
    obj(answer={"enum": ["yes", "no"]}, confidence={"type": "number", "minimum": 0, "maximum": 1}),
    obj(steps={"type": "array", "items": obj(n={"type": "integer", "minimum": 1, "maximum": 9}, text=S),
               "minItems": 2, "maxItems": 3}),
    obj(person=obj(name=S, pets={"type": "array", "items": obj(kind={"enum": ["cat", "dog"]}, name=S),
                                 "maxItems": 2})),
]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_model_len=1024, max_num_seqs=64)
    yield llm
    llm.shutdown()


def _prompts(llm: LLM, schemas: list[dict]) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"Reply with JSON matching this schema: "
                                      f"{json.dumps(s)}"}], tokenize=False, add_generation_prompt=True)
            for s in schemas]


def _run_schemas(llm: LLM, schemas: list[dict], temperature: float) -> None:
    # Compact JSON: with free whitespace the 135M model can emit newlines until max_tokens
    # (seen on the matrix schema), a valid prefix that never closes.
    specs = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in schemas]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=250, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    for text, schema in zip(llm.generate(_prompts(llm, schemas), params, use_tqdm=False), schemas, strict=True):
        check_json(text, schema)


def test_schemas_count():
    assert len(SCHEMAS) == 20


def test_a_few_schemas_greedy(llm):
    _run_schemas(llm, SCHEMAS[:3], 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_twenty_schemas(llm, temperature):
    _run_schemas(llm, SCHEMAS, temperature)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])
def test_regex_choice_and_grammar(llm, temperature):
    tok = llm.get_tokenizer()
    asks = ["Give a product code like AB-123.", "Is water wet? Answer yes or no.", "Write an arithmetic expression."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
               for a in asks]
    specs = [StructuredOutputsParams(regex=CODE_REGEX), StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(grammar=ARITHMETIC)]
    params = [SamplingParams(temperature=temperature, seed=7, max_tokens=60, structured_outputs=s) for s in specs]
    code, answer, expr = llm.generate(prompts, params, use_tqdm=False)
    check_regex(code, CODE_REGEX)
    assert answer in ("yes", "no")
    check_arithmetic(expr)
