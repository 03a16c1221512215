"""torchrun script for test_dp_images.py: every image request is rank 0's (one of its images
comes from a slow HTTP source), rank 1 has one short text request. Rank 0 writes every rank's
token ids and stats as JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mm_utils import make_image  # noqa: E402

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

model, out, slow_url, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
llm = LLM(model, decode_sequence=False, torch_threads=1, max_num_batched_tokens=24, max_model_len=256)
rank = llm.dp.dp_rank
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
if rank == 0:
    prompts = [{"prompt": "USER: <image>\nwhat is it? ASSISTANT:", "multi_modal_data": {"image": slow_url}},
               {"prompt": "USER: <image>\nand this? ASSISTANT:", "multi_modal_data": {"image": make_image(7)}}]
else:
    prompts = ["USER: just text ASSISTANT:"]
results = llm.generate(prompts, params, use_tqdm=False)
ids = [[t for o in r for t in o.token_ids] for r in results]
gathered = llm.dp.all_gather(ids)
stats = llm.rank_stats()
if rank == 0:
    with open(out, "w") as f:
        json.dump({"tokens": gathered, "stats": stats}, f)
llm.shutdown()
