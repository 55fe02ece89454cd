"""Prompt logprobs and logit bias through the real server and the official openai client, on the embedded default
model, against transformers' log-softmax of the same prompt: completions' echo with logprobs (lm-eval's
loglikelihood request), vLLM's prompt_logprobs on completions and chat, and logit_bias. Prompts are longer than
the server's token budget per step, so each is scored over several prefill chunks; a prompt sent twice is scored
whole again (no prefix-cache hit skips its positions)."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers_optional import require
from helpers_server import start_server

from flotilla.models.default_model import default_model_dir

openai = require("openai", "the server is tested through the real openai client")
transformers = require("transformers", "the reference logprobs come from transformers")

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"]


@pytest.fixture(scope="module")
def server():
    # 16 tokens per step: every prompt here is scored over several prefill chunks
    server = start_server("--max-num-batched-tokens", "16", "--max-num-seqs", "4", timeout=300)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@functools.cache
def _reference() -> tuple[object, object]:
    path = default_model_dir(progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


def _hf_logprobs(ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: the log-softmax after each prefix."""
    model, _ = _reference()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _ids(text: str) -> list[int]:
    return _reference()[1](text)["input_ids"]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, greedy; the prompt's tokens come first
    (the first with null), each with transformers' logprob and top alternative, then the sampled token."""
    out = client.completions.create(model=MODEL, prompt=PROMPTS, echo=True, logprobs=1, max_tokens=1, temperature=0)
    for prompt, choice in zip(PROMPTS, sorted(out.choices, key=lambda c: c.index)):
        ids = _ids(prompt)
        ref = _hf_logprobs(ids)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = ref[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:len(ids)]), want, rtol=0, atol=1e-4)
        best = ref[:-1].max(-1).values
        torch.testing.assert_close(torch.tensor([max(t.values()) for t in lp.top_logprobs[1:len(ids)]]), best,
                                   rtol=0, atol=1e-4)
        # the sampled token: greedy after the whole prompt
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        assert lp.text_offset[:2] == [0, len(lp.tokens[0])] and lp.text_offset[-1] == len(prompt)
    assert out.usage.prompt_tokens == sum(len(_ids(p)) for p in PROMPTS)


def test_a_prompt_sent_again_is_scored_whole_again(client):
    """Its prefix is cached after the first request; prompt logprobs still need every position computed."""
    first, again = (client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=0, max_tokens=1,
                                              temperature=0) for _ in range(2))
    assert again.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
    assert len(again.choices[0].logprobs.token_logprobs) == len(_ids(PROMPTS[0])) + 1
    assert None not in again.choices[0].logprobs.token_logprobs[1:]


def test_streamed_echo_starts_with_the_prompt_and_its_logprobs(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPTS[0]
    assert len(first.logprobs.tokens) == len(_ids(PROMPTS[0])) and first.logprobs.token_logprobs[0] is None
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert text == PROMPTS[0] + plain.choices[0].text


def test_echo_of_token_ids_gives_their_text(client):
    ids = _ids(PROMPTS[1])
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=2, temperature=0)
    assert out.choices[0].text.startswith(_reference()[1].decode(ids))
    assert out.choices[0].logprobs is None


def _rank(row: torch.Tensor, token: int) -> int:
    return int((row > row[token]).sum()) + 1


def test_vllms_prompt_logprobs_on_completions_and_chat(client):
    ids = _ids(PROMPTS[0])
    ref = _hf_logprobs(ids)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for pos, entry in enumerate(entries[1:]):
        token = ids[pos + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(ref[pos, token].item(), abs=1e-4)
        assert mine["rank"] == _rank(ref[pos], token)
        top = ref[pos].topk(2).indices.tolist()
        assert all(str(t) in entry for t in top) and len(entry) == len({token, *top})

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    assert len(entries) == chat.usage.prompt_tokens


def test_logit_bias_forces_and_bans_tokens(client):
    ids = _ids(PROMPTS[0])
    greedy = _hf_logprobs(ids)[-1].argmax().item()
    forced = 1000  # some other token
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == _reference()[1].decode([forced])
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=0,
                                    logit_bias={str(greedy): -100})
    banned = _reference()[1].decode([greedy])
    assert out.choices[0].text != banned
    # logprobs stay the model's own (before the bias), as vLLM reports them
    assert out.choices[0].logprobs.token_logprobs[0] < _hf_logprobs(ids)[-1, greedy].item()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == _reference()[1].decode([forced])


@pytest.mark.parametrize("bias", [{"49152": 1}, {"x": 1}, {"7": 200}])
def test_a_bad_logit_bias_is_a_400_naming_it_and_the_server_keeps_serving(client, bias):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias=bias)
    assert info.value.body["param"] == "logit_bias"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].finish_reason == "length"
