"""Structured-output cases shared by the engine and server tests: specs and how to check an
output against them (jsonschema for JSON, a full regex match, membership, an arithmetic parse)."""

from __future__ import annotations

import ast
import json
import re

import jsonschema

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
    "additionalProperties": False}
CODE_REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
# Arithmetic expressions, in GBNF (llama.cpp's EBNF dialect): integers, + - * /, parentheses.
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""


def check_json(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def check_regex(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"


def check_arithmetic(text: str) -> None:
    """Parses as an expression of integers and + - * / ( ) only."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    assert all(isinstance(n, allowed) for n in ast.walk(tree)), text
