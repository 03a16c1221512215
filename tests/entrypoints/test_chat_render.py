"""How a request renders its chat (ChatRender): its end, as vLLM's `add_generation_prompt` and
`continue_final_message` say it, and its own template variables (`chat_template_kwargs`). The
same prompt ids as transformers' apply_chat_template, offline (`LLM.chat`), over HTTP
(`/v1/chat/completions`, `/tokenize`) and with special-token strings in the content kept as
text; both ends true refused with vLLM's message, and variables that would stand in for the
renderer's own arguments or carry control tokens refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
from server_utils import ENGINE_OPTIONS, MODEL_NAME, served
from transformers import AutoTokenizer

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.config_file import ServerLimits
from deepinfer_dp.entrypoints.openai.chat_template import ChatTokenizer, TemplateError
from deepinfer_dp.utils.chat_template import ChatRender, ChatRenderError

BEGUN = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "A color is"}]
CONTINUE = ChatRender(add_generation_prompt=False, continue_final_message=True)
BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 4}
# A template that reads a variable of the request's: `shout` changes the prompt.
SHOUTING = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if shout %}LOUDLY {% endif %}assistant:")


def _hf_ids(hf, messages: list[dict], **kw) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, **kw)["input_ids"])


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_chat_render_follows_vllms_rules():
    assert ChatRender.of(None, None) == ChatRender(True, False)  # the default: the assistant's turn opened
    assert ChatRender.of(None, True) == CONTINUE  # continuing implies no new turn
    assert ChatRender.of(False, True) == CONTINUE
    assert ChatRender.of(False, False) == ChatRender(False, False)
    with pytest.raises(ValueError, match="Cannot set both"):
        ChatRender.of(True, True)
    assert ChatRender.of(None, None, {"shout": True}).template_kwargs()["shout"] is True
    for taken in ({"tools": []}, {"add_generation_prompt": False}, {"tokenize": False}, {"self": 1},
                  {"not a name": 1}, {1: 1, "tools": 2}):
        with pytest.raises(ChatRenderError, match="cannot be a template variable") as e:
            ChatRender.of(None, None, taken)
        assert e.value.param == "chat_template_kwargs"


def test_chat_tokenizer_ends_as_transformers_does(hf):
    chat = ChatTokenizer(hf)
    assert chat.prompt_ids(BEGUN, render=CONTINUE) == _hf_ids(hf, BEGUN, continue_final_message=True)
    user = BEGUN[:1]
    assert chat.prompt_ids(user, render=ChatRender(False, False)) == _hf_ids(hf, user, add_generation_prompt=False)
    assert chat.prompt_ids(user) == _hf_ids(hf, user, add_generation_prompt=True)
    # the three ends differ, so each test above shows its own
    assert len({tuple(chat.prompt_ids(BEGUN, render=e)) for e in (CONTINUE, ChatRender(), ChatRender(False))}) == 3


def test_an_open_message_with_special_strings_stays_text(hf):
    begun = [BEGUN[0], {"role": "assistant", "content": "A color<|im_end|> is"}]
    ids = ChatTokenizer(hf).prompt_ids(begun, render=CONTINUE)
    tail = hf("A color<|im_end|> is", add_special_tokens=False, split_special_tokens=True).input_ids
    assert ids[-len(tail):] == tail  # ends with the content as text: no turn closed after it
    assert hf.convert_tokens_to_ids("<|im_end|>") not in tail
    assert hf.decode(ids) == hf.decode(_hf_ids(hf, begun, continue_final_message=True))


def test_http_continues_the_final_message(server, hf):
    want = _hf_ids(hf, BEGUN, continue_final_message=True)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL_NAME, "messages": BEGUN, "continue_final_message": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want)
    plain = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": want, **GREEDY}).json()
    assert body["choices"][0]["message"]["content"] == plain["choices"][0]["text"]  # the continuation only
    r = httpx.post(server.url + "/tokenize", json={"messages": BEGUN, "continue_final_message": True})
    assert r.json()["tokens"] == want
    r = httpx.post(server.url + "/tokenize", json={"messages": BEGUN[:1], "add_generation_prompt": False})
    assert r.json()["tokens"] == _hf_ids(hf, BEGUN[:1], add_generation_prompt=False)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_http_refuses_both_ends(server, path):
    r = httpx.post(server.url + path, json={"model": MODEL_NAME, "messages": BEGUN, "continue_final_message": True,
                                            "add_generation_prompt": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == BOTH
    assert r.json()["error"]["param"] == "continue_final_message"


def test_llm_chat_continues_the_final_message(model_dir, hf):
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    try:
        params = SamplingParams(**GREEDY)
        want = llm.generate(prompt_token_ids=[_hf_ids(hf, BEGUN, continue_final_message=True)],
                            sampling_params=params, use_tqdm=False)
        assert llm.chat(BEGUN, params, use_tqdm=False, continue_final_message=True) == want
        with pytest.raises(ValueError, match="Cannot set both"):
            llm.chat(BEGUN, params, use_tqdm=False, add_generation_prompt=True, continue_final_message=True)
        loud = _hf_ids(hf, BEGUN[:1], add_generation_prompt=True, chat_template=SHOUTING, shout=True)
        want = llm.generate(prompt_token_ids=[loud], sampling_params=params, use_tqdm=False)
        assert llm.chat(BEGUN[:1], params, use_tqdm=False, chat_template=SHOUTING,
                        chat_template_kwargs={"shout": True}) == want
    finally:
        llm.shutdown()


def test_template_variables_reach_the_template(hf):
    chat = ChatTokenizer(hf, chat_template=SHOUTING)
    loud = chat.prompt_ids(BEGUN[:1], render=ChatRender.of(None, None, {"shout": True}))
    assert loud == _hf_ids(hf, BEGUN[:1], add_generation_prompt=True, chat_template=SHOUTING, shout=True)
    assert loud != chat.prompt_ids(BEGUN[:1])
    assert chat.prompt_ids(BEGUN[:1], render=ChatRender.of(None, None, {"unread": 1})) == chat.prompt_ids(BEGUN[:1])


def test_a_special_string_in_a_variable_follows_the_content_rule(hf):
    marked = ChatRender.of(None, None, {"shout": "<|im_start|>"})
    with pytest.raises(TemplateError, match="special-token string"):
        ChatTokenizer(hf, chat_template=SHOUTING).check_variables(marked)
    ChatTokenizer(hf, special_tokens_as_text=False, chat_template=SHOUTING).check_variables(marked)  # allowed


@pytest.fixture(scope="module")
def shouting_server(model_dir):
    with served(model_dir, limits=ServerLimits(chat_template=SHOUTING)) as server:
        yield server


def test_http_takes_template_variables(shouting_server, hf):
    want = _hf_ids(hf, BEGUN[:1], add_generation_prompt=True, chat_template=SHOUTING, shout=True)
    body = {"model": MODEL_NAME, "messages": BEGUN[:1], "chat_template_kwargs": {"shout": True}}
    r = httpx.post(shouting_server.url + "/v1/chat/completions", json={**body, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert httpx.post(shouting_server.url + "/tokenize", json=body).json()["tokens"] == want


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("variables, says", [
    ({"messages": []}, "cannot be a template variable"),
    ({"shout": "<|im_start|>system"}, "special-token string"),
])
def test_http_refuses_variables_by_name(shouting_server, path, variables, says):
    r = httpx.post(shouting_server.url + path,
                   json={"model": MODEL_NAME, "messages": BEGUN[:1], "chat_template_kwargs": variables})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "chat_template_kwargs"


def _stream_text(server, body: dict) -> dict[int, str]:
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"]["content"] or "")
    return texts


def test_echo_puts_the_begun_answer_first(server):
    body = {"model": MODEL_NAME, "messages": BEGUN, "continue_final_message": True, "n": 2, **GREEDY}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body).json()["choices"]
    echoed = httpx.post(server.url + "/v1/chat/completions", json={**body, "echo": True}).json()["choices"]
    for p, e in zip(plain, echoed, strict=True):
        assert e["message"]["content"] == "A color is" + p["message"]["content"]
    assert _stream_text(server, {**body, "echo": True}) == {c["index"]: c["message"]["content"] for c in echoed}
    # the begun answer as content parts: their text is echoed
    parts = [BEGUN[0], {"role": "assistant", "content": [{"type": "text", "text": "A color"},
                                                         {"type": "text", "text": " is"}]}]
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "messages": parts, "echo": True})
    assert [c["message"] for c in r.json()["choices"]] == [c["message"] for c in echoed]
    # the last message is the user's: nothing of the assistant's to echo
    asked = {**body, "messages": BEGUN[:1], "continue_final_message": False}
    plain = httpx.post(server.url + "/v1/chat/completions", json=asked).json()["choices"]
    echoed = httpx.post(server.url + "/v1/chat/completions", json={**asked, "echo": True}).json()["choices"]
    assert [c["message"] for c in echoed] == [c["message"] for c in plain]
