"""lm-eval's multiple-choice scoring through the server: its `local-completions` model (echo + logprobs requests)
against the real server on the embedded default model gives the loglikelihoods and accuracy of its `hf` model (the
same weights in transformers), on a small task made here from a local file (no hub)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers_optional import require
from helpers_server import start_server

from flotilla.models.default_model import default_model_dir

require("lm_eval", "lm-eval drives the server as users evaluate with it")

QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The opposite of hot is", ["warm", "loud", "cold", "tall"], 2),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Rankine", "Celsius"], 3),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
]

TASK = """task: flotilla_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    (d / "data.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                          for q, c, a in QUESTIONS))
    (d / "flotilla_mc.yaml").write_text(TASK.format(data=d / "data.jsonl"))
    return d


@pytest.fixture(scope="module")
def task_manager(task_dir):
    """The task here alone, for both evaluations: indexing lm-eval's thousands of built-in tasks takes seconds."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def _evaluate(task_manager, model: str, model_args: str) -> tuple[float, list[list[float]]]:
    """(accuracy, each document's loglikelihood per choice)."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=model, model_args=model_args, tasks=["flotilla_mc"], log_samples=True,
                          task_manager=task_manager, batch_size=1)
    samples = sorted(out["samples"]["flotilla_mc"], key=lambda s: s["doc_id"])
    return out["results"]["flotilla_mc"]["acc,none"], [[float(r[0][0]) for r in s["resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_scores_as_the_hf_model_does(task_manager, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "none")
    path = default_model_dir(progress=False)
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, timeout=300)  # the server starts while the hf model scores the task
        try:
            ref_acc, ref_scores = _evaluate(task_manager, "hf", f"pretrained={path},dtype=float32,device=cpu")
        except BaseException:
            starting.result().stop()
            raise
    server = starting.result()
    try:
        acc, scores = _evaluate(task_manager, "local-completions", (
            f"model=SmolLM2-135M-Instruct,base_url={server.url}/v1/completions,tokenizer={path},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1"))
    finally:
        server.stop()
    assert len(scores) == len(QUESTIONS) and all(len(s) == 4 for s in scores)
    for mine, theirs in zip(scores, ref_scores):
        assert mine == pytest.approx(theirs, abs=1e-3)
    assert acc == ref_acc
