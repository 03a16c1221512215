"""vLLM's older structured-output fields, which many clients and examples still send:
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (one constraint each),
`guided_whitespace_pattern` (the whitespace a JSON constraint allows) and
`guided_decoding_backend` (accepted and ignored: llguidance is the one grammar library here).

vLLM deprecated them for `structured_outputs` and later removed them; here they are aliases
of `structured_outputs`, with a deprecation warning in the log.
"""

from __future__ import annotations

import logging

from deepinfer_dp.entrypoints.openai.protocol import SamplingFields, StructuredOutputsRequest
from deepinfer_dp.entrypoints.openai.serving_engine import bad_request

logger = logging.getLogger(__name__)

# guided field -> its structured_outputs field
KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
QUALIFIERS = ("guided_whitespace_pattern", "guided_decoding_backend")


def apply_guided(req: SamplingFields) -> None:
    """Moves the request's guided_* fields into `req.structured_outputs` (in place); a 400
    naming the field when they conflict with each other or with structured_outputs."""
    given = [name for name in (*KINDS, *QUALIFIERS) if getattr(req, name) is not None]
    if not given:
        return
    logger.warning("deprecated request fields %s: send `structured_outputs` instead (vLLM's guided_* "
                   "fields are aliases of it here)", ", ".join(given))
    kinds = [name for name in KINDS if getattr(req, name) is not None]
    if len(kinds) > 1:
        raise bad_request(f"{' and '.join(kinds)} both constrain the output; send one of them", kinds[1])
    if kinds and req.structured_outputs is not None:
        raise bad_request(f"{kinds[0]} and structured_outputs both constrain the output; send one of them",
                          kinds[0])
    if kinds:
        req.structured_outputs = StructuredOutputsRequest.model_validate(
            {KINDS[kinds[0]]: getattr(req, kinds[0])}, strict=False)
        setattr(req, kinds[0], None)  # moved: a second call finds nothing to do
    pattern, req.guided_whitespace_pattern, req.guided_decoding_backend = req.guided_whitespace_pattern, None, None
    if pattern is None:
        return
    so = req.structured_outputs
    if so is None:
        raise bad_request("guided_whitespace_pattern shapes a JSON constraint: send it with guided_json or "
                          "structured_outputs", "guided_whitespace_pattern")
    if so.whitespace_pattern not in (None, pattern):
        raise bad_request("guided_whitespace_pattern and structured_outputs.whitespace_pattern differ; send one",
                          "guided_whitespace_pattern")
    so.whitespace_pattern = pattern
