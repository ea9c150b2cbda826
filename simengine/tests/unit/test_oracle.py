"""The simulated replica's oracle: recognised prompts, quality, the judge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from models_registry.domain.eval_gate import parse_eval_set, score_answer
from models_registry.domain.judge import JUDGE_PROMPTS, judge_messages
from simengine.domain import oracle, tokens
from simengine.replica import Faults, SimOptions, SimReplica

EVAL_SET = Path(__file__).resolve().parents[3] / "platform/evals/chat-default.jsonl"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize(
    ("prompt", "category", "answer"),
    [
        ("What is 37 + 48? Answer with the number.", "maths", "85"),
        ("What is 23 - 48? Answer with the number.", "maths", "-25"),
        ("What is 12 x 11? Answer with the number.", "maths", "132"),
        ("Reply with exactly this word: lantern", "general", "lantern"),
        (
            "Spell the word lantern backwards. Answer with the word.",
            "general",
            "nretnal",
        ),
        ("Is 37 even or odd? Answer with one word.", "reasoning", "odd"),
        ("Is 1000 even or odd? Answer with one word.", "reasoning", "even"),
        ("Which is larger, -3 or -40? Answer with the number.", "reasoning", "-3"),
        (
            "Sam has 12 apples and buys 5 more, then gives away 3. How many apples "
            "does Sam have now? Answer with the number.",
            "reasoning",
            "14",
        ),
    ],
)
def test_the_oracle_recognises_its_templates(
    prompt: str, category: str, answer: str
) -> None:
    task = oracle.recognise(f"  {prompt}\n")
    assert task is not None
    assert (task.category, task.answer) == (category, answer)
    assert oracle.is_right(task, answer)


def test_a_long_output_is_that_many_words() -> None:
    task = oracle.recognise("Write exactly 40 words about winter mornings.")
    assert task is not None and task.category == "long_output"
    assert len(task.answer.split()) == 40
    assert oracle.is_right(task, " ".join(["w"] * 40))
    assert not oracle.is_right(task, " ".join(["w"] * 39))


@pytest.mark.parametrize(
    "prompt",
    [
        "Say hello",
        "What is 37 + 48?",
        "what is 37 + 48? Answer with the number.",
        "Reply with exactly this word: two words",
        "Which is larger, 5 or 5? Answer with the number.",
        "Sam has 1 apples and buys 1 more, then gives away 5. How many apples "
        "does Sam have now? Answer with the number.",
        "Sam has 1 apples and buys 1 more, then gives away 1. How many pears "
        "does Sam have now? Answer with the number.",
        "Write exactly 1 words about bees.",
        "Write exactly 5000 words about bees.",
    ],
)
def test_other_prompts_are_not_recognised(prompt: str) -> None:
    assert oracle.recognise(prompt) is None
    assert oracle.reply(user(prompt), quality=1.0, seed=0) is None


def test_every_wrong_answer_is_wrong_and_plausible() -> None:
    prompts = [
        "What is 37 + 48? Answer with the number.",
        "Reply with exactly this word: river",
        "Spell the word level backwards. Answer with the word.",
        "Spell the word lantern backwards. Answer with the word.",
        "Is 37 even or odd? Answer with one word.",
        "Which is larger, 37 or 48? Answer with the number.",
        "Write exactly 30 words about bread.",
    ]
    for prompt in prompts:
        task = oracle.recognise(prompt)
        assert task is not None
        for pick in range(40):
            wrong = oracle.wrong_answer(task, pick, prompt=prompt)
            assert wrong.strip(), prompt
            assert not oracle.is_right(task, wrong), (prompt, wrong)
    larger = oracle.recognise("Which is larger, 37 or 48? Answer with the number.")
    assert larger is not None
    assert (
        oracle.wrong_answer(
            larger, 0, prompt="Which is larger, 37 or 48? Answer with the number."
        )
        == "37"
    )
    long = oracle.recognise("Write exactly 30 words about bread.")
    assert long is not None
    assert len(oracle.wrong_answer(long, 0).split()) == 15  # cut short


def maths_prompts(n: int) -> list[str]:
    return [f"What is {i} + {2 * i + 1}? Answer with the number." for i in range(n)]


def test_quality_is_the_share_of_right_answers_and_runs_agree() -> None:
    prompts = maths_prompts(1000)

    def rights(quality: float, seed: int) -> list[bool]:
        out = []
        for prompt in prompts:
            task = oracle.recognise(prompt)
            assert task is not None
            said = oracle.reply(user(prompt), quality=quality, seed=seed)
            assert said is not None
            out.append(oracle.is_right(task, said))
        return out

    assert all(rights(1.0, 0))
    assert not any(rights(0.0, 0))
    half = rights(0.5, 0)
    assert 450 <= sum(half) <= 550
    assert rights(0.5, 0) == half  # deterministic
    assert rights(0.5, 1) != half  # the seed draws other items
    # Same seed: a worse version is wrong wherever the better one was, and more.
    better = rights(0.9, 0)
    assert all(b for b, h in zip(better, half, strict=True) if h)
    assert 850 <= sum(better) <= 950


def test_answer_pieces_are_the_tokenizers() -> None:
    for text in ["85", "-25", "nretnal", "I cannot tell.", "calm  water moves"]:
        pieces = oracle.answer_pieces(text)
        assert "".join(pieces) == text
        assert len(pieces) == len(tokens.encode(text))


def test_the_judge_prompt_of_every_version_is_recognised() -> None:
    question = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 37 + 48? Answer with the number."},
    ]
    for version in JUDGE_PROMPTS:
        messages = judge_messages(question, "85", "84", version)
        prompt = oracle.read_judge_prompt(messages[-1]["content"])
        assert prompt is not None, version
        assert (prompt.answer_a, prompt.answer_b) == ("85", "84")
        assert oracle.judge_truth(prompt) == "a"
        assert oracle.reply(messages, quality=1.0, seed=0) == "A"
        swapped = judge_messages(question, "84", "The answer is 85.", version)
        assert oracle.reply(swapped, quality=1.0, seed=0) == "B"
        both = judge_messages(question, "85", "85.", version)
        assert oracle.reply(both, quality=1.0, seed=0) == "tie"
        unknown = judge_messages(user("Say hello"), "hi", "hello", version)
        assert oracle.reply(unknown, quality=1.0, seed=0) == "tie"


def test_a_judge_of_low_quality_errs_on_its_share() -> None:
    verdicts = []
    for i in range(400):
        question = user(f"What is {i} + 1? Answer with the number.")
        messages = judge_messages(question, str(i + 1), str(i + 2))
        verdicts.append(oracle.reply(messages, quality=0.5, seed=3))
    assert set(verdicts) == {"A", "B", "tie"}
    assert 160 <= verdicts.count("A") <= 240


def test_the_default_eval_set_is_the_oracles() -> None:
    """Every shipped item is a template the oracle knows: its right answer scores 1,
    its wrong answer less, and each human label is the right verdict on its pair."""
    items = parse_eval_set(EVAL_SET.read_text().splitlines(), source=str(EVAL_SET.name))
    labelled = 0
    for item in items:
        task = oracle.recognise(item.messages[-1]["content"])
        assert task is not None, item.id
        assert task.category == item.category, item.id
        assert score_answer(item, task.answer) == 1.0, item.id
        wrong = oracle.wrong_answer(task, 7, prompt=item.messages[-1]["content"])
        assert score_answer(item, wrong) < 1.0, item.id
        if item.labelled_pair is not None:
            labelled += 1
            a, b = item.labelled_pair
            prompt = oracle.read_judge_prompt(
                judge_messages(list(item.messages), a, b)[-1]["content"]
            )
            assert prompt is not None
            assert oracle.judge_truth(prompt) == item.human_label, item.id
    assert labelled >= 30


def test_the_replica_plans_answers_by_the_oracle() -> None:
    replica = SimReplica(SimOptions(model="m", served_model_names=["m"]))
    words = user("Write exactly 40 words about rivers.")
    answer = replica.plan_answer(words, max_tokens=100, ignore_eos=False, text_seed=1)
    assert answer is not None
    assert (answer.output_len, answer.finish_reason) == (40, "stop")
    assert len("".join(answer.pieces).split()) == 40
    cut = replica.plan_answer(words, max_tokens=10, ignore_eos=False, text_seed=1)
    assert cut is not None and (cut.output_len, cut.finish_reason) == (10, "length")
    assert cut.pieces == answer.pieces[:10]
    maths = user("What is 37 + 48? Answer with the number.")
    padded = replica.plan_answer(maths, max_tokens=12, ignore_eos=True, text_seed=1)
    assert padded is not None and padded.output_len == 12
    assert padded.pieces[0] == "85" and padded.finish_reason == "length"
    assert (
        replica.plan_answer(user("hi"), max_tokens=9, ignore_eos=False, text_seed=1)
        is None
    )
    replica.set_faults(degraded=True)
    refused = replica.plan_answer(maths, max_tokens=12, ignore_eos=False, text_seed=1)
    assert refused is not None and refused.finish_reason == "stop"
    assert "".join(refused.pieces) == "I am sorry, I cannot help with that."


def test_the_quality_fault_is_checked() -> None:
    replica = SimReplica(
        SimOptions(model="m", served_model_names=["m"]), faults=Faults(quality=0.0)
    )
    maths = user("What is 37 + 48? Answer with the number.")
    wrong = replica.plan_answer(maths, max_tokens=9, ignore_eos=False, text_seed=1)
    assert wrong is not None and "".join(wrong.pieces) != "85"
    assert replica.set_faults(quality=1).quality == 1.0
    right = replica.plan_answer(maths, max_tokens=9, ignore_eos=False, text_seed=1)
    assert right is not None and "".join(right.pieces) == "85"
    for bad in (1.5, -1, True, "0.5"):
        with pytest.raises(ValueError, match="quality must be a number"):
            replica.set_faults(quality=bad)
    with pytest.raises(ValueError, match="quality must be a number"):
        SimReplica(
            SimOptions(model="m", served_model_names=["m"]), faults=Faults(quality=2)
        )


def test_a_quality_by_category_lowers_that_category_only() -> None:
    parity = [f"Is {n} even or odd? Answer with one word." for n in range(1000)]

    def share(prompts: list[str], **quality: Any) -> float:
        right = 0
        for prompt in prompts:
            task = oracle.recognise(prompt)
            said = oracle.reply(user(prompt), seed=0, **quality)
            assert task is not None and said is not None
            right += oracle.is_right(task, said)
        return right / len(prompts)

    by_category = {"maths": 0.5}
    assert (
        0.45
        <= share(maths_prompts(1000), quality=1.0, quality_by_category=by_category)
        <= 0.55
    )
    assert share(parity, quality=1.0, quality_by_category=by_category) == 1.0
    # The same draws as a replica of that quality overall: nested, as quantized.
    assert share(
        maths_prompts(1000), quality=1.0, quality_by_category=by_category
    ) == share(maths_prompts(1000), quality=0.5)


def test_the_quality_by_category_fault_is_checked() -> None:
    replica = SimReplica(
        SimOptions(model="m", served_model_names=["m"]),
        faults=Faults(quality_by_category={"maths": 0.0}),
    )
    maths = user("What is 37 + 48? Answer with the number.")
    wrong = replica.plan_answer(maths, max_tokens=9, ignore_eos=False, text_seed=1)
    assert wrong is not None and "".join(wrong.pieces) != "85"
    words = user("Reply with exactly this word: lantern")
    kept = replica.plan_answer(words, max_tokens=9, ignore_eos=False, text_seed=1)
    assert kept is not None and "".join(kept.pieces) == "lantern"
    assert replica.set_faults(quality_by_category={}).quality_by_category == {}
    for bad in ({"poetry": 0.5}, {"maths": 2}, [0.5]):
        with pytest.raises(ValueError, match="quality"):
            replica.set_faults(quality_by_category=bad)
