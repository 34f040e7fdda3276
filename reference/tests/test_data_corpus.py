"""The synthetic corpus: template round trip, prompt/full prefixes, loss segments, check()."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from k3ref.data import tasks
from k3ref.data.render import END_OF_MSG
from k3ref.data.template_env import load_template

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "k3-mini"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def shipped_template():
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    return load_template(config["chat_template"])


@pytest.fixture(scope="module")
def corpus() -> list[tasks.Example]:
    rng = random.Random(20260101)
    return [tasks.sample_training_conversation(rng) for _ in range(300)]


def eval_examples() -> list[tasks.Example]:
    rng = random.Random(7)
    return [
        tasks.sample_example(kind, rng, thinking=thinking, effort=effort)
        for kind in tasks.TASK_KINDS
        for thinking in (True, False)
        for effort in ("low", "max")
        for _ in range(3)
    ]


def test_shipped_template_reproduces_full_and_prompt_text(corpus, shipped_template):
    kinds = set()
    for ex in corpus + eval_examples():
        kw = tasks.render_kwargs(ex)
        assert shipped_template.render(messages=ex.messages, tools=ex.tools, **kw) == tasks.full_text(ex)
        prompt = shipped_template.render(messages=ex.messages[:-1], tools=ex.tools, add_generation_prompt=True, **kw)
        assert prompt == tasks.prompt_text(ex)
        assert tasks.full_text(ex).startswith(prompt)
        kinds.add(ex.kind)
    assert kinds == set(tasks.TASK_KINDS)


def test_segments_cover_text_and_tokenize_like_the_whole(corpus, tokenizer):
    for ex in corpus[:150]:
        segments = tasks.train_segments(ex)
        text = tasks.full_text(ex)
        assert "".join(s for s, _ in segments) == text
        n_assistant = sum(m["role"] == "assistant" for m in ex.messages)
        loss = [s for s, m in segments if m]
        assert len(loss) == n_assistant
        assert all(s.endswith(END_OF_MSG) and s.count(END_OF_MSG) == 1 for s in loss)
        pieces = [tokenizer.encode(s).ids for s, _ in segments]
        assert [i for p in pieces for i in p] == tokenizer.encode(text).ids
    # The eval prompt plus the reference continuation is the last loss segment.
    for ex in eval_examples():
        assert tasks.train_segments(ex)[-1] == (
            tasks.full_text(ex)[len(tasks.prompt_text(ex)) - len(_gen_prompt_body(ex)) :],
            True,
        )


def _gen_prompt_body(ex: tasks.Example) -> str:
    return "<|open|>think<|sep|>" if ex.options["thinking"] else "<|open|>response<|sep|>"


def test_generators_are_seeded_and_mix_is_sensible(corpus):
    a = [tasks.full_text(tasks.sample_training_conversation(random.Random(s))) for s in range(20)]
    b = [tasks.full_text(tasks.sample_training_conversation(random.Random(s))) for s in range(20)]
    assert a == b
    thinking = sum(ex.options["thinking"] for ex in corpus) / len(corpus)
    assert 0.6 < thinking < 0.8
    assert {ex.options["thinking_effort"] for ex in corpus} == set(tasks.EFFORTS)
    tool = [ex for ex in corpus if ex.kind == "tool_use"]
    assert any(len(m.get("tool_calls", [])) == 2 for ex in tool for m in ex.messages)  # parallel calls
    assert any(ex.tools and not any(m.get("tool_calls") for m in ex.messages) for ex in tool)  # no tool needed
    assert any(m["role"] == "tool" for ex in tool for m in ex.messages)  # round trips
    with pytest.raises(ValueError):
        tasks.sample_example("poetry", random.Random(0), thinking=True, effort="low")


def test_kv_retrieval_lengths(tokenizer):
    rng = random.Random(3)
    lengths = [
        len(tokenizer.encode(tasks.full_text(tasks.sample_example("kv_retrieval", rng, thinking=True, effort="max"))).ids)
        for _ in range(20)
    ]
    assert min(lengths) > 1200 and max(lengths) < 4096
    assert any(n > 2048 for n in lengths)


def test_arithmetic_traces_are_correct():
    rng = random.Random(11)
    for _ in range(500):
        a, op, b = rng.randint(0, 9999), rng.choice("+-*"), rng.randint(0, 99)
        trace, result = tasks.arithmetic_trace(a, op, b, rng.choice(tasks.EFFORTS))
        assert result == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert trace.splitlines()[-1].endswith(str(result)) or f"= {result}." in trace


def test_check_accepts_reference_answers():
    for ex in eval_examples():
        result = tasks.check(ex, tasks.reference_continuation(ex))
        assert result and all(result.values()), (ex.kind, result)
        expected_keys = {
            "arithmetic": {"exact"}, "recall": {"exact"}, "kv_retrieval": {"exact"},
            "tool_use": {"well_formed", "schema_valid", "args_exact"},
            "json_answer": {"valid_json", "exact"}, "prose": {"well_formed"},
        }[ex.kind]
        if not ex.options["thinking"]:
            expected_keys = expected_keys | {"no_think"}
        assert set(result) == expected_keys


def _with_final(ex: tasks.Example, **changes) -> tasks.Example:
    bad = copy.deepcopy(ex)
    bad.messages[-1].update(changes)
    return bad


def test_check_rejects_corrupted_answers():
    rng = random.Random(5)
    for kind in ("arithmetic", "recall", "kv_retrieval", "json_answer"):
        ex = tasks.sample_example(kind, rng, thinking=True, effort="medium")
        wrong = ex.messages[-1]["content"].replace("}", ',"x":1}') if kind == "json_answer" else ex.messages[-1]["content"][:-2] + "Q."
        gen = tasks.reference_continuation(_with_final(ex, content=wrong))
        assert tasks.check(ex, gen)["exact"] is False
    ex = tasks.sample_example("json_answer", rng, thinking=False, effort="low")
    gen = tasks.reference_continuation(_with_final(ex, content="```json\n{}\n```"))
    assert tasks.check(ex, gen) == {"valid_json": False, "exact": False, "no_think": True}

    # tool_use: a changed argument value, an undeclared tool, a truncated turn.
    ex = next(
        e for e in (tasks.sample_example("tool_use", rng, thinking=True, effort="low") for _ in range(50))
        if e.expected["calls"]
    )
    call = ex.messages[-1]["tool_calls"][0]["function"]
    key = next(iter(call["arguments"]))
    bad = copy.deepcopy(ex)
    bad.messages[-1]["tool_calls"][0]["function"]["arguments"][key] = "zzz"
    res = tasks.check(ex, tasks.reference_continuation(bad))
    assert res["well_formed"] and not res["args_exact"]
    bad = copy.deepcopy(ex)
    bad.messages[-1]["tool_calls"][0]["function"]["name"] = "launch_rocket"
    res = tasks.check(ex, tasks.reference_continuation(bad))
    assert res["well_formed"] and not res["schema_valid"] and not res["args_exact"]
    gen = tasks.reference_continuation(ex)
    truncated = gen[: gen.index("<|close|>tools")]
    assert tasks.check(ex, truncated) == {"well_formed": False, "schema_valid": False, "args_exact": False}
    no_call = tasks.reference_continuation(_with_final(ex, tool_calls=None))
    assert tasks.check(ex, no_call)["schema_valid"] is False

    # prose: unterminated; thinking off but a think block emitted.
    ex = tasks.sample_example("prose", rng, thinking=False, effort="low")
    gen = tasks.reference_continuation(ex)
    assert tasks.check(ex, gen[:-30]) == {"well_formed": False, "no_think": True}
    assert tasks.check(ex, "<|open|>think<|sep|>x<|close|>think<|sep|>" + gen)["no_think"] is False


def test_parse_assistant_turn_typed_arguments():
    gen = (
        "plan<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="a&amp;b" index="1"<|sep|><|open|>argument key="n" type="number"<|sep|>2.5<|close|>argument<|sep|>'
        '<|open|>argument key="s" type="string"<|sep|>2.5<|close|>argument<|sep|>'
        '<|open|>argument key="o" type="object"<|sep|>{"k":[true,null]}<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="j" index="2"<|sep|><|open|>json type="object"<|sep|>{"x": 1}<|close|>json<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>ignored"
    )
    turn = tasks.parse_assistant_turn(gen, thinking=True)
    assert turn.well_formed and turn.calls_ok and turn.think == "plan" and turn.response == "ok"
    assert turn.calls == [
        {"name": "a&b", "arguments": {"n": 2.5, "s": "2.5", "o": {"k": [True, None]}}},
        {"name": "j", "arguments": {"x": 1}},
    ]


def test_minijinja_renders_corpus_identically(corpus):
    minijinja = pytest.importorskip("minijinja")
    from k3ref.data.render import TemplateError
    from k3ref.data.template_env import TEMPLATE_PATH

    def raise_exception(message):
        raise TemplateError(message)

    env = minijinja.Environment(templates={"t": TEMPLATE_PATH.read_text()}, globals={"raise_exception": raise_exception})
    for ex in corpus[:100]:
        kw = tasks.render_kwargs(ex)
        assert env.render_template("t", messages=ex.messages, tools=ex.tools, **kw) == tasks.full_text(ex)
