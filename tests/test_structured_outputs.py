"""Structured outputs through the real server and the official openai client, on the embedded default model at
temperature 1 over several seeds, streamed and not: OpenAI's response_format (json_object, json_schema, and
`chat.completions.parse` with a pydantic model), vLLM's structured_outputs and guided_* (regex, choice, EBNF
grammar); a constraint that cannot be used, or two at once, is a 400 naming it; an unconstrained request in the
same batch gets the text it gets alone."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers_optional import require
from helpers_server import start_server

openai = require("openai", "the server is tested through the real openai client")
pydantic = require("pydantic", "outputs are validated with pydantic models")
require("xgrammar", "structured outputs compile grammars with xgrammar")

MODEL = "SmolLM2-135M-Instruct"
SEEDS = range(4)


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=24)
    population: int
    capital: bool
    tags: list[str] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def client():
    server = start_server("--max-num-seqs", "16", timeout=300)
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        server.stop()


def _chat(client, stream: bool, **kw) -> str:
    messages = [{"role": "user", "content": "Describe a city."}]
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=messages, temperature=1, max_tokens=300,
                                              **kw).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=1, max_tokens=300,
                                            stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _all(fn, *args) -> list:
    """fn(*args, seed) for every seed, all at once (the engine batches them)."""
    return _each([(fn, *args)])[0]


def _each(calls: list[tuple]) -> list[list]:
    """_all for each (fn, *args), all of them at once: one batch runs as long as the longest output, where one
    call after another would run as long as their longest outputs together."""
    with ThreadPoolExecutor(len(calls) * len(SEEDS)) as pool:
        futures = [[pool.submit(fn, *args, seed) for seed in SEEDS] for fn, *args in calls]
        return [[f.result() for f in row] for row in futures]


def streamed(seed: int) -> bool:
    """Half the seeds' requests stream (the constraint holds in both paths)."""
    return seed % 2 == 1


@pytest.mark.slow
def test_json_schema_and_json_object_outputs_validate(client):
    schema = {"name": "city", "schema": City.model_json_schema(), "strict": True}
    schema_texts, object_texts = _each([
        (lambda seed: _chat(client, streamed(seed), seed=seed,
                            response_format={"type": "json_schema", "json_schema": schema}),),
        (lambda seed: _chat(client, streamed(seed), seed=seed, response_format={"type": "json_object"}),)])
    for text in schema_texts:
        City.model_validate_json(text)
    for text in object_texts:
        assert isinstance(json.loads(text), dict)


def test_parse_with_a_pydantic_model(client):
    def parse(seed: int):
        return client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                                             response_format=City, temperature=1, seed=seed, max_tokens=300)

    for out in _all(parse):
        assert isinstance(out.choices[0].message.parsed, City) and out.choices[0].finish_reason == "stop"


def test_regex_choice_and_grammar_constrain_completions(client):
    cases = [({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}},
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
             ({"guided_choice": ["Paris", "Lyon", "New \"York\""]}, lambda t: t in ("Paris", "Lyon", 'New "York"')),
             ({"guided_grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'},
              lambda t: re.fullmatch(r"(yes|no), [0-9]{1,2}", t)),
             ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
              lambda t: isinstance(json.loads(t)["ok"], bool))]
    def complete(body: dict, seed: int) -> str:
        kw = dict(model=MODEL, prompt="The answer is", temperature=1, seed=seed, max_tokens=64, extra_body=body)
        if streamed(seed):
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        return client.completions.create(**kw).choices[0].text

    for (body, valid), texts in zip(cases, _each([(complete, body) for body, _ in cases])):
        for text in texts:
            assert valid(text), (body, text)


def test_a_constraint_that_cannot_be_used_is_a_400_naming_it(client):
    bad = [({"guided_regex": "("}, "guided_regex", "regex"),
           ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "grammar"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format", "JSON schema"),
           ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex", "only one output constraint"),
           ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
           ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object")]
    for body, param, words in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
        assert err.value.body["param"] == param and words in err.value.body["message"], (body, err.value.body)
    # the server is fine afterwards
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_unconstrained_requests_in_the_same_batch_get_their_own_text(client):
    plain = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12)
    alone = client.completions.create(**plain).choices[0].text
    with ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(client.completions.create, model=MODEL, prompt="Pick", temperature=1, seed=s,
                                   max_tokens=48, extra_body={"guided_regex": "[a-z ]{10,40}"}) for s in range(6)]
        mixed = [pool.submit(client.completions.create, **plain) for _ in range(2)]
        assert [f.result().choices[0].text for f in mixed] == [alone, alone]
        assert all(re.fullmatch("[a-z ]{10,40}", f.result().choices[0].text) for f in constrained)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                              "unit": {"type": "string", "enum": ["c", "f"]}},
             "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}}]
REQUIRED = {"get_weather": {"city", "unit"}, "get_time": {"tz"}}


def _calls(client, stream: bool, seed: int, **kw) -> list[tuple[str, dict]]:
    """The (name, arguments) of the calls a forced tool_choice made."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
                temperature=1, seed=seed, max_tokens=200, **kw)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(tc.index, [tc.function.name, ""])
            entry[1] += tc.function.arguments or ""
    return [(name, json.loads(arguments)) for name, arguments in calls.values()]


def test_a_named_or_required_tool_choice_is_enforced(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    named_calls, required_calls = _each([
        (lambda seed: _calls(client, streamed(seed), seed, tool_choice=named),),
        (lambda seed: _calls(client, streamed(seed), seed, tool_choice="required", parallel_tool_calls=False),)])
    for calls in named_calls:
        assert [name for name, _ in calls] == ["get_time"] and REQUIRED["get_time"] <= set(calls[0][1])
    for calls in required_calls:
        assert len(calls) == 1 and all(REQUIRED[name] <= set(arguments) for name, arguments in calls)


def test_a_grammar_after_a_reasoning_end_tag_leaves_the_tokens_before_it_free():
    """SequenceGrammar(after=...): no mask until the tag's tokens appear (even split across steps), then the
    grammar holds what follows them."""
    import torch

    from flotilla.actors.grammar import Grammars, SequenceGrammar, apply
    from flotilla.models.default_model import default_model_dir
    from flotilla.models.model_folder import load_tokenizer
    from flotilla.sampling_params import StructuredOutputs

    tokenizer = load_tokenizer(default_model_dir(progress=False))
    grammars = Grammars(tokenizer, len(tokenizer), [0])
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # (split across steps below)
    g = SequenceGrammar(grammars.start(StructuredOutputs(choice=["yes", "no"])), [0], after=end)
    free = tokenizer.encode("Let me think about it", add_special_tokens=False)

    def masked(output: list[int]) -> torch.Tensor:
        g.follow(output)
        logits = torch.zeros(1, len(tokenizer))
        apply(logits, [([0], g, [])], grammars.batch)
        return logits[0].isfinite()

    assert masked(free).all() and not g.started
    assert masked(free + end[:1]).all()  # half the tag
    allowed = masked(free + end)
    assert g.started and 0 < int(allowed.sum()) < 10
    assert allowed[tokenizer.encode("yes", add_special_tokens=False)[0]]
    assert masked(free + end + tokenizer.encode("no", add_special_tokens=False)).sum() == 1  # only the stop token
    grammars.close()


def test_one_batch_fill_masks_each_row_as_its_own_matcher_would():
    """apply: single-row sequences filled in one batch call, a speculating sequence's rows (after each draft) and
    the rest each on their own; every row masked as its sequence's matcher alone masks it, rows of no grammar (or of
    one that has ended) left as they were."""
    import torch
    import xgrammar as xgr

    from flotilla.actors.grammar import Grammars, SequenceGrammar, apply
    from flotilla.models.default_model import default_model_dir
    from flotilla.models.model_folder import load_tokenizer
    from flotilla.sampling_params import StructuredOutputs

    tokenizer = load_tokenizer(default_model_dir(progress=False))
    grammars = Grammars(tokenizer, len(tokenizer), [0])
    schema = StructuredOutputs(json=json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    choice = StructuredOutputs(choice=["yes", "no"])

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    outputs = [enc('{"n": 1'), enc("y"), [], enc('{"n"'), enc("no") + [0]]  # the last one has ended
    specs = [schema, choice, schema, schema, choice]
    seqs = [SequenceGrammar(grammars.start(spec), [0]) for spec in specs]
    for g, out in zip(seqs, outputs):
        g.follow(out)
    drafts = enc(": 4")[:2]
    rows = [([0], seqs[0], []), ([2], seqs[1], []), ([3], seqs[2], []), ([4, 5, 6], seqs[3], drafts),
            ([7], seqs[4], [])]
    logits = torch.randn(9, len(tokenizer), generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    apply(logits, rows, grammars.batch)
    for sequence_rows, g, d in rows:  # each matcher on its own, then the reference mask
        bitmask = xgr.allocate_token_bitmask(1 + max(sequence_rows), len(tokenizer))
        for row in g.fill(bitmask, sequence_rows, d):
            xgr.apply_token_bitmask_inplace(want[row:row + 1], bitmask[row:row + 1])
    assert torch.equal(logits, want)
    finite = logits.isfinite().sum(-1).tolist()
    assert finite[1] == finite[8] == len(tokenizer) and finite[7] == len(tokenizer)  # no grammar; ended
    assert all(0 < finite[r] < len(tokenizer) for r in (0, 2, 3, 4, 5, 6))
    grammars.close()


def test_a_graphs_argmax_stands_for_free_rows_and_is_taken_again_for_masked_ones(tmp_path):
    """ModelRunner._sample given a decode graph's argmax (computed before the masks): the masked rows' greedy tokens
    are those of their masked logits, the free rows keep the graph's, as when no argmax is given."""
    import numpy as np
    import torch
    from helpers_engine import write_tiny_engine_model

    from flotilla.actors.model_runner import ModelRunner
    from flotilla.actors.seq_state import SeqState
    from flotilla.config import EngineConfig
    from flotilla.sampling_params import SamplingParams, StructuredOutputs

    model = write_tiny_engine_model(tmp_path / "m")
    runner = ModelRunner(EngineConfig.from_options(model=str(model), device="cpu", dtype="float32",
                                                   kv_cache_blocks=16, block_size=4), progress=False)
    constrained = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="[a-c]{2,9}"))
    kinds = [constrained, SamplingParams(temperature=0), constrained, SamplingParams(temperature=0.8, seed=1)]
    logits = torch.randn(len(kinds), runner.model.config.vocab_size, generator=torch.Generator().manual_seed(0))

    def sample(greedy: torch.Tensor | None) -> list[int]:
        seqs = [SeqState.new(np.array([5, 6, 7], dtype=np.int32), np.array([0]), num_prompt_tokens=3,
                             num_computed=3, sampling=p, grammar=runner._grammar_of(p)) for p in kinds]
        out, _ = runner._sample(seqs, [f"r{i}" for i in range(len(kinds))], logits.clone(), greedy)
        return out.token_ids.tolist()

    unmasked = logits.argmax(-1)
    got, want = sample(unmasked.clone()), sample(None)
    assert got == want and got[1] == int(unmasked[1])
    assert got[0] != int(unmasked[0]) and got[2] != int(unmasked[2])  # (the masks changed the constrained rows)
    runner.close()


@pytest.mark.gpu
def test_grammars_hold_on_cuda_in_graph_replayed_and_overlapped_decode_steps(tmp_path):
    """The masks reach logits that CUDA graphs produced, with steps in flight; constrained rows beside free ones."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from helpers_engine import write_tiny_engine_model

    from flotilla import LLM, SamplingParams
    from flotilla.sampling_params import StructuredOutputs

    model = write_tiny_engine_model(tmp_path / "m")
    pattern = "[a-z]{3,8}( [a-z]{3,8}){1,3}"
    constrained = [SamplingParams(max_tokens=48, temperature=1.0, seed=s,
                                  structured_outputs=StructuredOutputs(regex=pattern)) for s in range(8)]
    free = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    greedy = [SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputs(regex=pattern)),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)]  # (a graph's argmax)
    with LLM(str(model), device="cuda", dtype="bfloat16", kv_cache_blocks=512, block_size=16, max_num_seqs=18) as llm:
        outs = llm.generate(["The quick brown fox"] * 18, constrained + free + greedy, use_tqdm=False)
        assert llm.client.ready_detail["worker/0"]["cuda_graphs"] == "on"
    for out in outs[:8] + outs[16:17]:
        assert re.fullmatch(pattern, out.outputs[0].text) and out.outputs[0].finish_reason == "stop", out.outputs[0]
    assert all(len(out.outputs[0].token_ids) == 16 for out in outs[8:16])
    # the free greedy row beside masked ones took its own logits' argmax each step
    assert all(lp.logprob == max(lp.top.values()) for lp in outs[17].outputs[0].logprobs)
