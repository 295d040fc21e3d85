"""RULER's synthetic tasks: exact lengths for any tokenizer, gold answers that are gold in the
decoded text, determinism, the length checks and RULER's string-match scorer."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from longctx_cli.data import ruler
from longctx_cli.data.ruler import (
    TASKS,
    make_sample,
    match_score,
    min_length,
    ruler_average,
    score,
)
from longctx_cli.data.tokenizer import byte_tokenizer

NIAH = [t for t in TASKS if t.startswith("niah_")]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _bpe(with_bos: bool):
    """A small byte-level BPE trained here (no files, no network): merges make token counts
    differ from character counts, so exactness is not an artefact of the byte tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [ruler._essay_sentence(rng) for _ in range(300)]
    corpus += [ruler.NOISE, " ".join(ruler.CWE_WORDS), "VAR ABCDE = VAR FGHIJ 12345 67890"]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if with_bos:
        model.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", model.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


@pytest.fixture(scope="module", params=[True, False], ids=["bpe-bos", "bpe-nobos"])
def bpe(request):
    return _bpe(request.param)


def _text(tokenizer, sample) -> str:
    return tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)


# ---- what makes each answer gold, read back from the decoded prompt ----------------------

NEEDLE = re.compile(r"One special magic (number|uuid) for (\S+) is: (\S+?)\.(?=\s|$)")


def _check_niah(task: str, text: str, answers: list[str], length: int) -> None:
    cfg = ruler._NIAH[task]
    question = re.search(r"\n(?:What is the|What are all the) special magic \w+ for (.+?) "
                         r"mentioned in the text above\?", text)
    assert question, text[-300:]
    asked = re.split(r", and |, ", question.group(1))
    context = text[:question.start()]
    needles = [(m.group(2), m.group(3)) for m in NEEDLE.finditer(context)]
    assert all(m.group(1) == cfg.value for m in NEEDLE.finditer(context))
    # The gold values are exactly the values of the asked keys' needles, in question order.
    assert len(asked) == cfg.queries and len(set(asked)) == cfg.queries
    gold = [v for key in asked for k, v in needles if k == key]
    assert gold == answers or sorted(gold) == sorted(answers) and cfg.values > 1
    assert len(answers) == cfg.queries * cfg.values
    # Keys and values are unique (one key per value set); distractors never repeat gold.
    values = [v for _, v in needles]
    assert len(set(values)) == len(values)
    keys = Counter(k for k, _ in needles)
    assert set(keys.values()) == {cfg.values}
    if cfg.haystack == "needle":
        assert len(needles) > 3 or length < 1000  # the haystack itself is needles
    else:
        assert len(needles) == cfg.keys * cfg.values
    for value in answers:
        if cfg.value == "number":
            assert re.fullmatch(r"[1-9]\d{6}", value)
        else:
            assert re.fullmatch(r"[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", value)
    kind = cfg.value if cfg.values * cfg.queries == 1 else cfg.value + "s"
    assert text.endswith(f"special magic {kind} for {question.group(1)} mentioned in the text "
                         f"above {'is' if cfg.values * cfg.queries == 1 else 'are'}:")
    # Needles sit at sentence boundaries; the haystack is the task's kind.
    for m in NEEDLE.finditer(context):
        before = context[:m.start()]
        assert before.endswith(("\n", ". ", "afterwards.")), before[-40:]
    noise = ruler.NOISE[:9]  # at the shortest lengths only part of a noise line fits
    assert (noise in context) == (cfg.haystack == "noise")


def _check_vt(text: str, answers: list[str]) -> None:
    head = "Keep track of the chain of variable assignments"
    assert text.count(head) == 2  # the one-shot example, then the task
    task = text[text.rindex(head):]
    value = re.search(r"Which variables are assigned the value (\d{5}) in the text above\?",
                      task).group(1)
    binding: dict[str, str] = {}
    for name, rhs in re.findall(r"^VAR ([A-Z]{5}) = (\d{5}|VAR [A-Z]{5})$", task, re.M):
        assert name not in binding
        binding[name] = rhs.removeprefix("VAR ")

    def resolve(name: str) -> str:
        while name in binding:
            name = binding[name]
        return name

    bound = [n for n in binding if resolve(n) == value]
    assert bound == answers and len(answers) == ruler.VT_HOPS + 1
    assert task.endswith(f"5 variables are assigned the value {value}; they are:")
    example = text[:text.rindex(head)]
    assert f" {value} " not in example  # the example's chain has another value


def _list_counts(listing: str) -> Counter:
    entries = re.findall(r"(?:^| )(\d+)\. ([a-z]+)", listing)
    assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
    return Counter(w for _, w in entries)


def _check_cwe(text: str, answers: list[str], length: int) -> Counter:
    head = "Here is a numbered list of words."
    task = text[text.rindex(head):]
    listing = task[task.index("\n") + 1:task.index("\nQuestion:")]
    counts = _list_counts(listing)
    assert len(answers) == len(set(answers)) == 10
    rest = [c for w, c in counts.items() if w not in answers]
    assert min(counts[a] for a in answers) > max(rest)  # strictly the 10 most common
    # RULER's repeats: 6 and 1 below 4096 tokens, 30 and 3 from there on (once they fit).
    common = {counts[a] for a in answers}
    assert common == {6} or common == {30} and length >= 4096
    assert set(rest) == {1 if common == {6} else 3} and len(rest) >= 10
    # The one-shot example uses other words, and shows its own answer.
    example = text[:text.rindex(head)]
    assert not set(answers) & set(re.findall(r"[a-z]+", example))
    assert text.endswith("The 10 words that occur most often in the list above are:")
    return counts


def _check_fwe(text: str, answers: list[str]) -> Counter:
    coded = text[text.index("occur most often.") + len("occur most often."):
                 text.index("\nQuestion:")]
    counts = Counter(w for w in coded.split() if re.fullmatch(r"[a-z]{6}", w))
    assert len(answers) == 3 and all(re.fullmatch(r"[a-z]{6}", a) for a in answers)
    rest = [c for w, c in counts.items() if w not in answers]
    assert min(counts[a] for a in answers) > max(rest, default=0)
    assert set(coded.split()) - set(counts) <= {"...", "..", "."}  # dots are the noise
    assert text.endswith("The three words that occur most often in the coded text above are:")
    return counts


def _check(task: str, text: str, sample) -> None:
    if task in NIAH:
        _check_niah(task, text, sample.answers, sample.length)
    elif task == "vt":
        _check_vt(text, sample.answers)
    elif task == "cwe":
        _check_cwe(text, sample.answers, sample.length)
    else:
        _check_fwe(text, sample.answers)
    for answer in sample.answers:  # every gold string is in the context, not only the prompt
        assert answer in text


# ---- exact length and gold structure -------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_exact_length_and_gold_answers_with_the_byte_tokenizer(tok, task):
    spec = TASKS[task]
    shortest = min_length(task, tok)
    lengths = sorted({max(n, shortest) for n in (512, 1000, 2048)} | {shortest, 5000})
    for length in lengths:
        for index in range(3):
            s = make_sample(task, tok, length, index, seed=0)
            assert (s.task, s.length, s.index) == (task, length, index)
            assert len(s.prompt_ids) + spec.max_new_tokens == length
            _check(task, _text(tok, s), s)


@pytest.mark.parametrize("task", list(TASKS))
def test_exact_length_and_gold_answers_with_a_subword_tokenizer(bpe, task):
    spec = TASKS[task]
    bos = bpe.bos_token_id if bpe("a")["input_ids"][0] == bpe.bos_token_id else None
    for length in (min_length(task, bpe), 1777, 4096, 6001):
        if length < min_length(task, bpe):
            continue
        for index in range(2):
            s = make_sample(task, bpe, length, index, seed=1)
            assert len(s.prompt_ids) + spec.max_new_tokens == length
            assert (s.prompt_ids[0] == bos) if bos is not None else (
                bpe.bos_token_id not in s.prompt_ids)
            _check(task, _text(bpe, s), s)


def test_long_samples_stay_exact(tok):
    for task in ("niah_multikey_2", "niah_multiquery", "vt", "cwe", "fwe"):
        s = make_sample(task, tok, 40_000, 0, seed=0)
        assert len(s.prompt_ids) + TASKS[task].max_new_tokens == 40_000
        _check(task, _text(tok, s), s)


def test_content_grows_with_length(tok):
    def cwe_words(n):
        s = make_sample("cwe", tok, n, 0, 0)
        return _check_cwe(_text(tok, s), s.answers, n)

    def fwe_words(n):
        s = make_sample("fwe", tok, n, 0, 0)
        return len(set(_check_fwe(_text(tok, s), s.answers)))

    def vt_lines(n):
        return _text(tok, make_sample("vt", tok, n, 0, 0)).count(ruler.NOISE)

    entries = [sum(cwe_words(n).values()) for n in (2500, 3500, 9000, 20000)]
    assert entries == sorted(set(entries))
    assert fwe_words(1000) < fwe_words(4000) < fwe_words(16000)
    assert vt_lines(1500) < vt_lines(4000) < vt_lines(16000)
    # The list repeats common words 6 times below 4096 tokens, 30 times from there on; bytes
    # are so fine-grained that the larger setting only fits from about 7,900.
    assert max(cwe_words(4095).values()) == max(cwe_words(7000).values()) == 6
    assert max(cwe_words(9000).values()) == 30


def test_needle_depths_cover_the_haystack(tok):
    # Over many samples the single needle lands from the start to the end of the haystack.
    where = []
    for index in range(40):
        text = _text(tok, make_sample("niah_single_2", tok, 3000, index, seed=0))
        where.append(text.index("One special magic") / len(text))
    assert min(where) < 0.15 and max(where) > 0.8


def test_word_lists_are_prefix_free():
    for words in (ruler.ADJECTIVES, ruler.NOUNS):
        assert len(words) > 150
        assert not [(a, b) for a in words for b in words if a != b and b.startswith(a)]
        assert all(re.fullmatch(r"[a-z]+", w) for w in words)


# ---- determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_same_arguments_same_sample_other_index_other_sample(tok, task):
    length = max(2500, min_length(task, tok))
    a = make_sample(task, tok, length, 3, seed=5)
    assert make_sample(task, tok, length, 3, seed=5) == a
    assert make_sample(task, tok, length, 4, seed=5).prompt_ids != a.prompt_ids
    assert make_sample(task, tok, length, 3, seed=6).prompt_ids != a.prompt_ids


def test_a_sample_does_not_depend_on_samples_made_before(tok):
    alone = make_sample("niah_multivalue", tok, 1500, 2, seed=0)
    for task in TASKS:
        make_sample(task, tok, 2500, 0, seed=0)
    random.seed(123)  # nor on the global random state
    assert make_sample("niah_multivalue", tok, 1500, 2, seed=0) == alone


# ---- length checks -------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_min_length_is_accepted_and_one_less_refused(tok, bpe, task):
    for tokenizer in (tok, bpe):
        shortest = min_length(task, tokenizer)
        assert shortest > TASKS[task].max_new_tokens
        for index in range(4):
            s = make_sample(task, tokenizer, shortest, index, seed=0)
            assert len(s.prompt_ids) + TASKS[task].max_new_tokens == shortest
        with pytest.raises(ValueError, match=f"too short.*{task}.*at least {shortest:,}"):
            make_sample(task, tokenizer, shortest - 1, 0, seed=0)


def test_unknown_task_lists_the_known_ones(tok):
    for call in (lambda: make_sample("niah_single_9", tok, 4096, 0, 0),
                 lambda: min_length("qa_1", tok),
                 lambda: score("nope", "x", ["x"])):
        with pytest.raises(ValueError, match="unknown RULER task") as err:
            call()
        assert all(name in str(err.value) for name in TASKS)


def test_task_table():
    assert list(TASKS) == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
        "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
        "vt", "cwe", "fwe"]
    assert {t: s.max_new_tokens for t, s in TASKS.items() if not t.startswith("niah")} == {
        "vt": 30, "cwe": 120, "fwe": 50}
    assert all(TASKS[t].max_new_tokens == 128 for t in NIAH)
    assert all(s.name == t and s.metric == "all" and s.description for t, s in TASKS.items())


# ---- scoring -------------------------------------------------------------------------------


def test_score_all_and_part():
    answers = ["1234567", "7654321", "1111111", "2222222"]
    assert score("niah_multivalue", " 1234567, 7654321, 1111111 and 2222222.", answers) == 1.0
    assert score("niah_multivalue", " 1234567 and 7654321", answers) == 0.5
    assert score("niah_multivalue", " I do not know.", answers) == 0.0
    assert score("niah_single_1", "", ["1234567"]) == 0.0
    assert score("cwe", "1. Apple 2. BANANA", ["apple", "banana"]) == 1.0  # case-insensitive
    assert score("vt", "ABCDE fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    assert match_score("x\x00 1234567\t", ["1234567"], "all") == 1.0
    # "part" (RULER's QA metric): any one gold answer is enough.
    assert match_score("Paris, I think", ["paris", "Lyon"], "part") == 1.0
    assert match_score("Rome", ["paris", "Lyon"], "part") == 0.0
    with pytest.raises(ValueError, match="metric"):
        match_score("x", ["x"], "some")
    with pytest.raises(ValueError, match="gold answer"):
        score("fwe", "x", [])


def test_gold_answers_score_full_marks(tok):
    for task in TASKS:
        s = make_sample(task, tok, max(2500, min_length(task, tok)), 1, seed=0)
        assert score(task, " " + ", ".join(s.answers), s.answers) == 1.0
        assert score(task, " none of them", s.answers) == 0.0


def test_ruler_average():
    assert ruler_average({"niah_single_1": 1.0, "vt": 0.5, "cwe": 0.0}) == 0.5
    with pytest.raises(ValueError):
        ruler_average({})
