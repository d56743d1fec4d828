"""`python -m k3lab.evaluate` and its lm-eval `LM` (k3lab/evaluate.py) on the local example tasks of
docs/examples/evals (multiple choice and generation, data in a local file), scored against log-likelihoods and
greedy continuations computed here from the model's full forward."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")  # the `eval` extra

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from analysis.collect import collect  # noqa: E402
from k3lab.evaluate import build_parser, evaluate, lm_class, main  # noqa: E402
from k3lab.generate import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "docs" / "examples" / "evals"
DOCS = [json.loads(line) for line in (TASKS / "sotu_cloze.jsonl").read_text().splitlines()]


def logprob(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | end-of-document, context) from one full forward: the pair encoded whole, the
    continuation's ids those after the context's own."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    ids = [tok.eod_id, *whole]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
    return sum(logp[i - 1, ids[i]].item() for i in range(1 + len(ctx), len(ids)))


def greedy(model, tok, context: str, until: list[str], max_tokens: int) -> tuple[str, float]:
    """The greedy continuation by full forwards of the growing sequence (no cache), cut at the first stop
    string, and the smallest gap between the two largest logits on the way (a near tie, which rounding may
    decide either way)."""
    ids = [tok.eod_id, *tok.encode(context)]
    out, gap = [], float("inf")
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids + out]))[0, -1]
            top = logits.topk(2).values
            gap = min(gap, (top[0] - top[1]).item())
            nxt = logits.argmax().item()
            if nxt == tok.eod_id:
                break
            out.append(nxt)
            if any(u in tok.decode(out) for u in until):
                break
    text = tok.decode(out)
    for u in until:
        text = text.split(u)[0]
    return text, gap


@pytest.fixture(scope="module")
def samples(trained_run):
    """lm-eval's per-document records of both example tasks for the trained run (log_samples), with a context
    longer than any of the tasks' (the run trained at 32 tokens, less than some contexts take)."""
    run = load_run(trained_run)
    lm = lm_class()(run, batch_size=3, max_length=256)
    results = lm_eval.simple_evaluate(model=lm, tasks=["sotu_cloze", "sotu_complete"],
                                      task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                      log_samples=True)
    return run, results


def test_multiple_choice_against_hand_computed_loglikelihoods(samples):
    """Each choice's log-likelihood is the one computed here, and acc follows. Tolerance: fp32 logits of a
    padded batch against those of a lone sequence differ by a few ulps (~1e-6 at their size, ~10), which
    log-softmax passes on to each of the <= 30 scored tokens: well under 1e-4 in the sum."""
    run, results = samples
    by_doc = {s["doc_id"]: s for s in results["samples"]["sotu_cloze"]}
    hits = 0
    for i, doc in enumerate(DOCS):
        hand = [logprob(run.model, run.tokenizer, doc["context"], " " + c) for c in doc["choices"]]
        got = [resp[0][0] for resp in by_doc[i]["resps"]]
        assert got == pytest.approx(hand, abs=1e-4)
        hits += max(range(len(hand)), key=hand.__getitem__) == doc["answer"]
    assert results["results"]["sotu_cloze"]["acc,none"] == pytest.approx(hits / len(DOCS))


def test_generation_against_hand_computed_greedy_decoding(samples):
    """generate_until runs the cached decoding path; its text equals greedy decoding by full forwards wherever
    no near tie (two logits within 1e-3, far above fp32 rounding) leaves the argmax to rounding, and
    exact_match follows from the texts."""
    run, results = samples
    by_doc = {s["doc_id"]: s for s in results["samples"]["sotu_complete"]}
    compared = hits = 0
    for i, doc in enumerate(DOCS):
        text = by_doc[i]["resps"][0][0]
        hand, gap = greedy(run.model, run.tokenizer, doc["context"], ["\n", ".", ","], 6)
        if gap > 1e-3:
            assert text == hand
            compared += 1
        hits += text.strip() == doc["choices"][doc["answer"]]
    assert compared >= len(DOCS) // 2
    assert results["results"]["sotu_complete"]["exact_match,none"] == pytest.approx(hits / len(DOCS))


def test_rolling_loglikelihood(trained_run):
    """A text shorter than the context is scored token by token after the end-of-document token; a longer one
    in windows whose scores cover every token once."""
    from lm_eval.api.instance import Instance

    run = load_run(trained_run)
    text = "line 5 of document 2 says 9. line 6 of document 2 says 3."
    n = len(run.tokenizer.encode(text))
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    whole = lm_class()(run).loglikelihood_rolling([request])[0]
    assert whole == pytest.approx(logprob(run.model, run.tokenizer, "", text), abs=1e-4)
    windows = lm_class()(run, max_length=n // 3).loglikelihood_rolling([request])[0]
    assert windows < 0 and windows != pytest.approx(whole, abs=1e-6)


def test_command_writes_results_and_skips_what_is_done(trained_run, tmp_path, capsys):
    """Results land in <run>/evals/<task>.json; a folder is searched for completed runs; a second call skips
    what the same checkpoint, tasks and settings already gave, a changed setting evaluates again; collect reads
    the results as eval/<task>/<measure> columns."""
    folder = tmp_path / "runs"
    shutil.copytree(trained_run, folder / "a", ignore=shutil.ignore_patterns("evals"))
    (folder / "b").mkdir()
    (folder / "b" / "config.yaml").write_text("{}")
    (folder / "b" / "summary.json").write_text(json.dumps({"status": "failed"}))
    args = ["--tasks", "sotu_cloze,sotu_complete", "--include", str(TASKS), "--limit", "4"]
    written = evaluate(build_parser().parse_args([str(folder), *args]))
    assert sorted(p.relative_to(folder).as_posix() for p in written) == ["a/evals/sotu_cloze.json",
                                                                         "a/evals/sotu_complete.json"]
    assert "b: skipped, status failed" in capsys.readouterr().out
    record = json.loads((folder / "a" / "evals" / "sotu_cloze.json").read_text())
    assert record["samples"] == 4 and record["identity"]["checkpoint"]["step"] == 6
    assert set(record["metrics"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert record["higher_is_better"] == {"acc": True, "acc_norm": True}
    assert evaluate(build_parser().parse_args([str(folder), *args])) == []
    assert "evaluated already at step 6" in capsys.readouterr().out
    assert len(evaluate(build_parser().parse_args([str(folder), *args[:-1], "3"]))) == 2
    runs = collect([folder / "a"]).runs
    assert runs["eval/sotu_cloze/acc"].item() == json.loads((folder / "a/evals/sotu_cloze.json").read_text())[
        "metrics"]["acc"]
    assert runs.attrs["higher_is_better"]["eval/sotu_complete/exact_match"] is True


def test_bad_input_is_one_line(trained_run, tmp_path, monkeypatch, capsys):
    import k3lab.evaluate

    # lm-eval's own task index takes a minute to build here: the example folder alone stands for it
    monkeypatch.setattr(k3lab.evaluate, "task_manager",
                        lambda names, include: TaskManager(include_path=str(TASKS), include_defaults=False))
    assert main([str(trained_run), "--tasks", "sotu_cloze,no_such_task"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no_such_task is not a task lm-eval knows" in err
    assert main([str(tmp_path), "--tasks", "x"]) == 2
    assert "holds no run directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert main([str(trained_run), "--tasks", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install -e ".[eval]"' in err
