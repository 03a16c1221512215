"""torchrun script for test_dp_slow_grammar_build.py: rank 1's grammar build is made slow
(a sleep before the real compile), and its only request is the constrained one; rank 0 has
one short plain request. Rank 0 writes every rank's stats and rank 1's text as JSON."""

import json
import sys
import time

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.structured_output import backend
from deepinfer_dp.structured_output.params import StructuredOutputsParams

model, out, delay_s, regex = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
llm = LLM(model, decode_sequence=True, torch_threads=1, num_kv_blocks=64, block_size=16)
rank = llm.dp.dp_rank
if rank == 1:
    compile_now = backend.GrammarBackend.compile

    def slow_compile(self, params):
        time.sleep(delay_s)
        return compile_now(self, params)

    backend.GrammarBackend.compile = slow_compile
if rank == 0:
    texts = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
else:
    spec = StructuredOutputsParams(regex=regex)
    texts = llm.generate(["A code:"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec),
                         use_tqdm=False)
gathered = llm.dp.all_gather(texts)
stats = llm.rank_stats()
if rank == 0:
    with open(out, "w") as f:
        json.dump({"texts": gathered, "stats": stats}, f)
llm.shutdown()
