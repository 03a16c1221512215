"""The offline API: LLM.generate and LLM.chat over one engine, or over DP ranks.

Where the engines run:
  - dp_size 1: in this process (`llm.llm_engine`), driven by the step loop.
  - under torchrun: this process is one rank (`llm.llm_engine`, and `llm.dp` the group: its
    rank, all_gather and rank_stats, collectives every rank calls).
  - dp_size > 1 otherwise: Ray actor ranks behind the router process (`llm.dp`, see
    cluster/dp_driver.py); `llm.llm_engine` is None, the engines are in the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from deepinfer_dp import _C
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import DPSettings
from deepinfer_dp.distributed.groups import torchrun_env
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.engine.step_loop import StepLoop
from deepinfer_dp.engine.stop_strings import truncate_at_stop
from deepinfer_dp.multimodal.chat import has_image_parts
from deepinfer_dp.multimodal.errors import MM_ERROR_PREFIX
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.sampling_params import InvalidRequest, SamplingParams
from deepinfer_dp.structured_output.params import BUILD_ERROR_PREFIX
from deepinfer_dp.utils.chat_template import ChatRender, load_chat_template


class LLM:
    """`LLM(model=None)` serves the default SmolLM2-135M-Instruct; `model` may be a Hugging
    Face directory or a .gguf file; other keywords are EngineConfig options."""

    def __init__(self, model: str | None = None, decode_sequence: bool = True,
                 dp_options: DPSettings | dict | None = None, **engine_options) -> None:
        """dp_size > 1 starts that many ranks as Ray actors behind a router (`dp_options`: the
        router and Ray sections of config_file.py, or a dict of their fields' names, e.g.
        {"policy": "least_loaded", "max_rank_restarts": 0}; see DPSettings.of).
        Under torchrun, each process is one DP rank and calls generate on its own shard."""
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.decode_sequence = decode_sequence
        self.llm_engine: LLMEngine | None = None  # the engine in this process, if any
        self.dp: Any = None  # the DP side: TorchrunRank or DPDriver; None at dp_size 1
        self._loop: StepLoop | None = None
        if torchrun_env() is not None:
            from deepinfer_dp.cluster.torchrun import build_torchrun_rank
            self.dp = build_torchrun_rank(config)
            self._loop = self.dp.loop
            self.llm_engine = self._loop.engine
        elif config.dp_size > 1:
            from deepinfer_dp.cluster.dp_driver import DPDriver
            self.dp = DPDriver(config, DPSettings.of(dp_options))
        else:
            self.llm_engine = LLMEngine(config)
            self._loop = StepLoop(self.llm_engine)
        self._submitter = self.llm_engine if self.llm_engine is not None else self.dp

    def rank_stats(self) -> list[dict]:
        """Every DP rank's counters (generate_step, placeholder_steps, ...); one entry at dp 1.
        Under torchrun this is a collective: call it on every rank."""
        return [self._loop.stats()] if self.dp is None else self.dp.rank_stats()

    def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: float = 300) -> dict:
        """Grows or shrinks the DP group of `LLM(dp_size=N)` to `new_data_parallel_size` ranks
        while it serves (another thread's generate goes on); the leaving ranks' requests get
        `drain_timeout` seconds to finish, then move to the staying ranks by recompute.
        Returns what it did; raises ScaleError (its `status`: 400, 409, 503)."""
        from deepinfer_dp.cluster.dp_driver import DPDriver

        if not isinstance(self.dp, DPDriver):
            how = "under torchrun" if self.dp is not None else "at dp_size 1 (one engine in this process)"
            raise RuntimeError(f"scale_elastic_ep needs the Ray DP deployment of LLM(dp_size=N > 1); this LLM "
                               f"runs {how}, whose group cannot change size")
        return self.dp.deployment.scale(new_data_parallel_size, drain_timeout)

    def shutdown(self) -> None:
        """Stops the engine's threads, the DP ranks (Ray actors) or the DP group (torchrun)."""
        (self.dp or self.llm_engine).shutdown()

    def get_tokenizer(self):
        return self._submitter.tokenizer

    @property
    def sampling_defaults(self) -> dict:
        """The sampling fields the model's generation config sets (empty: neutral defaults)."""
        return dict(self._submitter.input_processor.sampling_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no params: the model's generation_config.json
        values (EngineConfig.generation_config, "auto"), or neutral ones ("vllm"), as vLLM."""
        return self._submitter.input_processor.default_params()

    def generate(self, prompts: str | dict | Sequence[str | dict] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = True,
                 data_parallel_rank: int | None = None) -> list:
        """One result per prompt, in prompt order: text (decode_sequence=True) or the list of
        cloned RequestOutputs (one per token). With n > 1 a result is a list of n of those.
        A prompt with images is a dict, vLLM's shape: {"prompt": text with the model's image
        placeholders, "multi_modal_data": {"image": image or [images]}} (PIL images, bytes or
        URLs). Images that fail (fetch, decode, processor) fail only their prompt: the others
        run, then one ValueError names the prompt and the image, its `outputs` the results
        (None for a failed prompt). `data_parallel_rank` (vLLM's): every request runs on that
        DP rank (one of this LLM's: under torchrun, this process's own)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate needs prompts or prompt_token_ids")
        num = len(prompts) if prompts is not None else len(prompt_token_ids)
        if prompts is not None and prompt_token_ids is not None and len(prompt_token_ids) != num:
            raise ValueError(f"got {num} prompts but {len(prompt_token_ids)} prompt_token_ids")
        params = _per_prompt_params(self.get_default_sampling_params() if sampling_params is None else sampling_params,
                                    num)
        pin = self._pin(data_parallel_rank)
        owners = self._add_requests(prompts, prompt_token_ids, params, pin)
        outputs = self._run_engine(use_tqdm, len(owners))
        return self._collect(outputs, owners, params, num)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool | None = None, *, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list:
        """Applies the model's chat template to one conversation or a list of them; `chat_template`
        (the Jinja template, or a file holding it) replaces the model's, as in vLLM.
        `continue_final_message`: the last message is left open and the model continues it (e.g.
        an assistant answer begun by the caller); add_generation_prompt (unset: true unless
        continuing) opens a new assistant turn after the messages. `chat_template_kwargs`: variables
        for the template (e.g. {"enable_thinking": False}), as in vLLM."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = ChatRender.of(add_generation_prompt, continue_final_message, chat_template_kwargs)
        template = load_chat_template(chat_template)
        if any(has_image_parts(conv) for conv in conversations):  # the model's processor renders them
            images = self._image_requests()
            prompts = []
            for conv in conversations:
                mm = images.chat_prompt(conv, render, template)
                prompts.append({"prompt": mm.prompt, "multi_modal_data": {"image": mm.images}})
            return self.generate(prompts, sampling_params=sampling_params, use_tqdm=use_tqdm)
        tok = self.get_tokenizer()
        if template is None and tok.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template (a base model, or a GGUF file without "
                             "tokenizer.chat_template): pass chat_template=... (the Jinja template or its file), "
                             "or use generate()")
        ids = [_as_ids(tok.apply_chat_template(conv, tokenize=True, chat_template=template, **render.template_kwargs()))
               for conv in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)

    def _image_requests(self):
        """The engine's ImageRequests, or over Ray the driver's ImageFront: both render a chat."""
        images = self._submitter.images
        if images is None:
            raise InvalidRequest("this model does not take images", "multi_modal_data")
        return images

    def _pin(self, data_parallel_rank: int | None) -> dict:
        """add_checked's keyword for a pinned rank (none for an in-process engine: it is the rank)."""
        if data_parallel_rank is None:
            return {}
        served = [self.llm_engine.config.dp_rank] if self.llm_engine is not None else list(range(self.dp.dp_size))
        if data_parallel_rank not in served:
            raise InvalidRequest(f"data_parallel_rank {data_parallel_rank} does not exist here: this LLM's "
                                 f"DP ranks are {served}", "data_parallel_rank")
        return {} if self.llm_engine is not None else {"data_parallel_rank": data_parallel_rank}

    def _add_requests(self, prompts, prompt_token_ids, params: list[SamplingParams], pin: dict) -> dict[str, int]:
        """Adds every request before any model work; maps request id -> prompt index. Each
        prompt is validated once with its params (InputProcessor.process), and its n samples
        are submitted as checked requests. A bad prompt raises InvalidRequest naming its index
        and the field, and the ones already added are aborted, so nothing is left half-submitted."""
        owners: dict[str, int] = {}
        processor = self._submitter.input_processor
        try:
            for i, p in enumerate(params):
                mm = self._mm_prompt(prompts[i], p) if prompts is not None and isinstance(prompts[i], dict) else None
                text = mm.prompt if mm is not None else prompts[i] if prompts is not None else None
                ids = prompt_token_ids[i] if prompt_token_ids is not None else self._tokenize(text)
                ids, checked = processor.process(ids, p)
                extra = pin if mm is None else {"mm": mm, **pin}
                for sample in range(checked.n):
                    owners[self._submitter.add_checked(ids, checked.for_sample(sample), **extra)] = i
        except ValueError as e:
            self._submitter.abort_request(list(owners))
            raise InvalidRequest(f"prompt {i}: {e}", getattr(e, "param", None)) from e
        return owners

    def _mm_prompt(self, prompt: dict, params: SamplingParams) -> MultiModalPrompt:
        """A dict prompt's text and images, checked against limit_mm_per_prompt."""
        text, data = prompt.get("prompt"), prompt.get("multi_modal_data") or {}
        unknown = set(prompt) - {"prompt", "multi_modal_data"} or set(data) - {"image"}
        if unknown:
            raise InvalidRequest(f"unsupported prompt key(s) {sorted(unknown)} (prompt, multi_modal_data.image)",
                                 "prompt")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        limit = self._image_requests() and self._submitter.config.limit_mm_per_prompt.get("image", 0)
        if len(images) > limit:
            raise InvalidRequest(f"{len(images)} images, more than limit_mm_per_prompt allows ({limit})",
                                 "multi_modal_data.image")
        if params.prompt_logprobs is not None:
            raise InvalidRequest("prompt_logprobs are not supported for prompts with images", "prompt_logprobs")
        return MultiModalPrompt(text, images, max_tokens_set=params.max_tokens is not None)

    def _tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise InvalidRequest(f"a prompt must be a string, got {type(prompt).__name__}", "prompt")
        return self.get_tokenizer()(prompt).input_ids

    def _run_engine(self, use_tqdm: bool, num_requests: int) -> dict[str, list]:
        pbar = tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm)
        outputs: dict[str, list] = {}

        def collect(step_outputs: list) -> None:
            for raw in step_outputs:
                out = raw.clone()  # now: pooled outputs are released by the next step
                outputs.setdefault(out.request_id, []).append(out)
                if out.finished:
                    pbar.update(1)

        if self._loop is not None:
            self._loop.run(collect)
        else:
            self.dp.run_until_done(collect)  # the ranks run the step loop
        pbar.close()
        return outputs

    def _collect(self, outputs: dict[str, list], owners: dict[str, int], params: list[SamplingParams],
                 num: int) -> list:
        results: list[list] = [[] for _ in range(num)]
        input_errors: dict[int, str] = {}  # a prompt whose images failed: the others still return
        for rid in sorted(owners, key=int):
            outs = outputs.get(rid, [])
            i = owners[rid]
            if not outs or not outs[-1].finished:
                raise RuntimeError(f"request {rid} ended without a finished output")  # never silently short
            if outs[-1].finish_reason == "error":
                error = outs[-1].error or ""
                if error.startswith(MM_ERROR_PREFIX):
                    input_errors.setdefault(i, f"prompt {i}: {error.removeprefix(MM_ERROR_PREFIX)}")
                    continue
                # a schema, regex or grammar the library refused is the caller's bad input
                kind = ValueError if error.startswith(BUILD_ERROR_PREFIX) else RuntimeError
                raise kind(f"prompt {i}: request {rid} failed: {error}")
            results[i].append(self._decode(outs, params[i]) if self.decode_sequence else outs)
        done = [None if i in input_errors else r[0] if params[i].n == 1 else r for i, r in enumerate(results)]
        if input_errors:
            error = ValueError("; ".join(input_errors.values()))
            error.outputs = done
            raise error
        return done

    def _decode(self, outs: list, params: SamplingParams) -> str:
        ids = [t for o in outs for t in o.token_ids]
        text = self.get_tokenizer().decode(ids, skip_special_tokens=params.skip_special_tokens)
        if params.stop and outs[-1].status == _C.SequenceStatus.FINISHED_STOPPED:
            text = truncate_at_stop(text, params.stop, params.include_stop_str_in_output)
        return text


def _per_prompt_params(sampling_params, num: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num
    if len(sampling_params) != num:
        raise ValueError(f"got {len(sampling_params)} sampling_params for {num} prompts")
    return list(sampling_params)


def _as_ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)
