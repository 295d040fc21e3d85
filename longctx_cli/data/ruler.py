"""NVIDIA RULER's synthetic tasks, generated offline for any tokenizer, and RULER's scorer.

The eleven synthetic tasks of RULER's `synthetic.yaml` (its two QA tasks need downloaded data
sets and are left out):

* NIAH, needle in a haystack. A needle is "One special magic number for <key> is: <value>."
  Keys are adjective-noun words ("brave-otter") or uuids; values are 7-digit numbers or uuids.

  ===================  ============  ====  ======  =====================================
  task                 haystack      key   value   needles / question
  ===================  ============  ====  ======  =====================================
  niah_single_1        noise         word  number  1
  niah_single_2        essay         word  number  1
  niah_single_3        essay         word  uuid    1
  niah_multikey_1      essay         word  number  4 keys, one asked (3 distractors)
  niah_multikey_2      needles       word  number  1, hidden among distractor needles
  niah_multikey_3      needles       uuid  uuid    1, hidden among distractor needles
  niah_multivalue      essay         word  number  1 key with 4 values, all asked
  niah_multiquery      essay         word  number  4 keys, all asked
  ===================  ============  ====  ======  =====================================

  "noise" repeats "The grass is green. ..."; "essay" is prose from a seeded grammar (RULER
  uses Paul Graham's essays, a download); "needles" is nothing but needles with other keys.
  Needles sit at sentence boundaries, at depths drawn from RULER's grid of 40 evenly spaced
  depths (distinct per needle).
* vt, variable tracking: a chain "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", ... (1 chain,
  4 hops) scattered through noise lines, after a one-shot example; answer: all 5 names.
* cwe, common words extraction: a numbered list where 10 words occur 30 times each and the
  others 3 times (6 and 1 below 4096 tokens, as RULER), after a one-shot example; answer: the
  10 common words.
* fwe, frequent words extraction: coded 6-letter words drawn from a Zipf distribution (alpha
  2), the most frequent one replaced by "..." noise; answer: the 3 most frequent coded words.

The templates paraphrase RULER's and keep its answer prefix: the prompt ends with e.g. "... the
special magic number for brave-otter mentioned in the text above is:", so the model's first
generated tokens are the answer.

The exact-length rule: a sample of `length` has `len(prompt_ids) == length -
max_new_tokens` (RULER counts the answer budget inside the sequence length). Every piece of
text is tokenized on its own and the ids concatenated (house style, see `passkey.py`), so the
count is exact for any tokenizer. Filler takes up what the content leaves, cut at token level:
for NIAH and vt the last haystack unit is cut (never a needle or a chain line, which all sit
before it); for cwe the few tokens a whole list entry cannot fill lead the prompt as a noise
fragment and a line break; for fwe they are more "..." noise at the end of the coded text.
How much content a task has grows with the length as in RULER: more haystack, more noise
lines, more listed words, a larger coded vocabulary. `min_length` is the smallest length
every sample of a task fits in: exact for the fixed text, and for random content (numbers,
uuids, variable names, coded words) a safe bound, what its characters cost alone plus one.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longctx_cli.data.formats import bos_prefix, text_ids
from longctx_cli.data.passkey import FILLER

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TaskSpec:
    name: str
    max_new_tokens: int  # RULER's tokens_to_generate
    metric: str  # "all" (string_match_all) or "part" (string_match_part)
    description: str


@dataclass(frozen=True)
class RulerSample:
    task: str
    length: int  # len(prompt_ids) + TASKS[task].max_new_tokens
    prompt_ids: list[int]  # ends with the answer prefix; bos first if the tokenizer has one
    answers: list[str]  # the gold strings (RULER's "outputs")
    index: int


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec("niah_single_1", 128, "all", "one needle (word key, number) in repeated noise"),
        TaskSpec("niah_single_2", 128, "all", "one needle (word key, number) in essay text"),
        TaskSpec("niah_single_3", 128, "all", "one needle (word key, uuid) in essay text"),
        TaskSpec("niah_multikey_1", 128, "all", "the asked needle among 3 with other keys, essay"),
        TaskSpec("niah_multikey_2", 128, "all", "one needle in a haystack of other needles"),
        TaskSpec("niah_multikey_3", 128, "all", "one needle (uuid key, uuid) among other needles"),
        TaskSpec("niah_multivalue", 128, "all", "all 4 values of one key, essay text"),
        TaskSpec("niah_multiquery", 128, "all", "the values of 4 keys, essay text"),
        TaskSpec("vt", 30, "all", "variable tracking: every name bound to a value (4 hops)"),
        TaskSpec("cwe", 120, "all", "the 10 most common words of a numbered list"),
        TaskSpec("fwe", 50, "all", "the 3 most frequent coded words (Zipf, alpha 2)"),
    ]
}

NOISE = FILLER.strip()  # RULER's noise haystack, the passkey filler

# ---- scoring ------------------------------------------------------------------------------


def match_score(prediction: str, answers: list[str], metric: str) -> float:
    """RULER's string match for one sample: "all" = share of answers found in the prediction,
    "part" = 1.0 if any is found; case-insensitive substrings, control characters as breaks."""
    if not answers:
        raise ValueError("a RULER sample needs at least one gold answer to score against")
    if metric not in ("all", "part"):
        raise ValueError(f"unknown RULER metric {metric!r}; use 'all' or 'part'")
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    found = [a.lower() in pred for a in answers]
    return sum(found) / len(found) if metric == "all" else float(any(found))


def score(task: str, prediction: str, answers: list[str]) -> float:
    """The task's RULER metric for one prediction, in [0, 1] (RULER reports it times 100)."""
    return match_score(prediction, answers, _spec(task).metric)


def ruler_average(scores: dict[str, float]) -> float:
    """RULER's headline number: the unweighted mean of the per-task scores."""
    if not scores:
        raise ValueError("no RULER task scores to average")
    return sum(scores.values()) / len(scores)


# ---- public entry points ------------------------------------------------------------------


def make_sample(
    task: str, tokenizer: PreTrainedTokenizerBase, length: int, index: int, seed: int
) -> RulerSample:
    """Sample `index` of `task` at `length` tokens, deterministic in (task, length, index, seed)
    and independent of any other sample. ValueError for an unknown task or a length below
    `min_length`."""
    spec = _spec(task)
    enc = _Enc(tokenizer)
    need = _min_length(enc, task)
    if length < need:
        raise ValueError(
            f"length {length:,} is too short for RULER task {task!r}: with this tokenizer it "
            f"needs at least {need:,} tokens ({spec.max_new_tokens} of them the answer budget)"
        )
    # A stable hash, not hash(): str hashes are salted per process.
    digest = hashlib.sha256(f"ruler|{task}|{length}|{index}|{seed}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    budget = length - spec.max_new_tokens
    body, answers = _BUILDERS[_family(task)](enc, task, budget - len(enc.bos), rng)
    prompt = enc.bos + body
    if len(prompt) != budget:  # the construction guarantees it; a loud failure if not
        raise RuntimeError(f"RULER {task}: built {len(prompt)} prompt tokens, not {budget}")
    return RulerSample(task, length, prompt, answers, index)


def min_length(task: str, tokenizer: PreTrainedTokenizerBase) -> int:
    """The smallest `length` that `make_sample` accepts for `task` with this tokenizer."""
    _spec(task)
    return _min_length(_Enc(tokenizer), task)


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[task]


def _family(task: str) -> str:
    return "niah" if task.startswith("niah_") else task


def _min_length(enc: _Enc, task: str) -> int:
    return _MIN_BUDGET[_family(task)](enc, task) + len(enc.bos) + TASKS[task].max_new_tokens


# ---- tokenizing pieces --------------------------------------------------------------------


class _Rand(str):
    """A piece whose text is random: `min_length` bounds its tokens instead of counting them."""


class _Enc:
    """A tokenizer with memoized piece ids (pieces repeat a lot) and batched encoding."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.tok = tok
        self.bos = bos_prefix(tok)
        self.memo: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        if text not in self.memo:
            self.memo[text] = text_ids(self.tok, text)
        return self.memo[text]

    def many(self, texts: list[str]) -> list[list[int]]:
        todo = list(dict.fromkeys(t for t in texts if t not in self.memo))
        if todo:  # one call for many strings: much faster than one call each
            out = self.tok(todo, add_special_tokens=False)["input_ids"]
            self.memo.update((t, list(i)) for t, i in zip(todo, out, strict=True))
        return [self.memo[t] for t in texts]

    def join(self, pieces: list[str]) -> list[int]:
        self.many(pieces)
        return [i for p in pieces for i in self.memo[p]]

    def bound(self, pieces: list[str]) -> int:
        """Tokens of `pieces` at most: exact for fixed text; for a random piece, what its
        characters cost on their own plus one (no merge makes more tokens than characters,
        and the one covers a tokenizer's prefix marker)."""
        fixed = [p for p in pieces if not isinstance(p, _Rand)]
        total = sum(len(i) for i in self.many(fixed))
        for p in pieces:
            if isinstance(p, _Rand):
                total += 1 + sum(self.char_cost(c) for c in p)
        return total

    def char_cost(self, c: str) -> int:
        return max(1, len(self.ids(c)))

    def worst(self, chars: str, n: int) -> str:
        """`n` copies of the character of `chars` with the most tokens on its own."""
        return max(chars, key=self.char_cost) * n


# ---- word lists (written for this module) -------------------------------------------------

_ADJECTIVES = """
able absent active agile amber ample ancient angry arctic austere awake aware bashful bitter
bland blissful blunt bold bouncy brave breezy brief bright brisk broad bronze brown bumpy busy
calm candid careful casual cheerful chilly civic classic clean clever cloudy clumsy coastal
cold comfy cosmic cozy crafty creamy crisp crooked crowded cuddly curious curly cyan damp
dapper daring dark dazzling decent deep dense distant dizzy dusty eager early earnest easy
elastic elegant empty epic even exact fair faithful famous fancy fearless feisty fierce fine
firm flat fluffy fond foggy formal fragile frank fresh friendly frosty frozen funny fuzzy
gentle giant giddy gifted glad glossy golden graceful grand grassy great green grumpy hairy
handy happy hardy harsh hasty hazy healthy hearty heavy hidden hollow honest humble hungry icy
idle jolly jovial juicy keen kind lanky large late lavish lazy lean legal level light limber
little lively local lofty lonely loud lovely loyal lucky lunar magenta major mellow merry
mighty mild misty modern modest moody muddy murky narrow native neat nervous nimble noble
noisy normal nutty odd orange ordinary oval pale patient peaceful perfect plain plucky polite
proud purple quick quiet quirky radiant rapid rare raspy ready regal rich rigid ripe robust
rocky rosy rough round royal rural rustic sandy scarlet secret serene shaggy shiny short shy
silent silky silver simple sleepy slim slow small smart smooth snowy soft solar solid sour
sparkly spicy splendid steady steep sticky stormy stout strange strict strong sturdy subtle
sudden sunny sweet swift tall tame tangy tender thick thin thirsty tidy tiny tough tranquil
tropical true twin unique upbeat urban usual vast velvet vivid warm wary wavy weary wide wild
windy wise witty wooden young zany zealous
"""
_NOUNS = """
acorn actor album almond anchor ankle antelope apple apricot apron arcade archer armchair
arrow artist atlas attic avocado badge bagel bakery balcony ballet bamboo banana banjo banner
barn barrel basket beacon beaver beetle bench bicycle biscuit blanket blossom boat bonnet boot
bottle boulder bracelet branch bread breeze brick bridge broom bucket buffalo bungalow butter
button cabin cactus camel camera candle canoe canyon captain caravan carpet carrot castle cedar
cello chair cherry chestnut chimney circus citizen cliff clock cloud clover coconut comet
compass cookie copper coral cottage cotton cousin cradle crane crayon cricket crown cucumber
cupboard curtain cushion daisy dancer desert diamond dinosaur doctor dolphin donkey dragon drum
eagle easel elephant elbow engine falcon farmer feather fence ferry fiddle fig flamingo flute
forest fountain fox garden garlic gazelle geyser giraffe glacier goat gondola gorilla guitar
hammer harbor harp hedgehog helmet heron hill honey horizon horse island ivy jacket jaguar jar
jelly jewel kangaroo kettle kitten koala ladder lagoon lake lantern lemon leopard lighthouse
lily lion lizard llama lobster locket magnet mango maple marble meadow melon mermaid mirror
mitten monkey moose mountain muffin mushroom napkin necklace nest noodle notebook nutmeg oak
oasis ocean octopus onion orchard ostrich otter owl oyster paddle palace panda panther parrot
peach peacock pebble pelican pencil penguin pepper piano pickle pigeon pillow pilot pine pirate
planet plum pocket pond poppy potato pumpkin puppet puzzle quilt rabbit raccoon radish rainbow
raven ribbon river robin rocket saddle sailor salmon sandal scarf seal shark shell shovel
skate sled slipper snail sparrow spider spoon squirrel statue stone storm sunflower swan
sweater table teapot temple tiger tomato tortoise tower tractor trumpet tulip turtle umbrella
unicorn valley vase violin volcano wagon walnut walrus waterfall whale wheel whistle willow
window wizard wolf yacht zebra
"""
_VERBS = """
accept admire advise agree allow amuse answer appear argue arrange arrive attach attend bake
balance bathe behave believe belong bless blink boil borrow bounce breathe brush build bump
calculate camp carry carve celebrate change chase cheer chew choose clap climb collect comb
complain cook copy cough count cover crawl cross cycle dance decide deliver describe design
dig discover dive draw dream dress drift drink drive earn enjoy enter escape explain explore
fasten fetch fill find fix float fold follow forgive gather giggle glow grab greet grow guard
guess guide hang harvest help hike hop hug hum hunt hurry imagine invent invite jog join
juggle jump kick kneel knit knock laugh learn lift listen mend march measure melt mix nod
notice obey offer open order paint pause peel pick plant play polish pour print promise pull
push question race reach read relax remember repair rescue rest return ride row sail scribble
search sew shake share shiver shout sing sit skip sleep smile sneeze solve sort spell spin
splash stack stir stretch study swim swing talk teach think throw tickle travel tumble turn
unlock untie visit wait walk wander wash watch wave weave whisper wink wish wonder work worry
write yawn yell
"""


def _prefix_free(words: str) -> list[str]:
    """Sorted unique words, dropping any that begins another: then no key is the start of
    another key, so a needle cut at the haystack's end cannot spell out a gold key."""
    unique = sorted(set(words.split()))
    return [w for i, w in enumerate(unique) if i + 1 == len(unique) or
            not unique[i + 1].startswith(w)]


ADJECTIVES = _prefix_free(_ADJECTIVES)
NOUNS = _prefix_free(_NOUNS)
CWE_WORDS = sorted(set(_ADJECTIVES.split()) | set(_NOUNS.split()) | set(_VERBS.split()))

# ---- essay-like filler: a small seeded grammar about ordinary things ----------------------

_E = {
    "name": "Anna|Ben|Clara|Daniel|Elena|Felix|Grace|Henry|Iris|Jonas|Kate|Leo|Maria|Nora|"
    "Oscar|Paula|Rosa|Sam|Tara|Victor|Wendy|the baker|my neighbor|the teacher|our landlord|"
    "the mayor|an old friend|the librarian|the gardener|my aunt|the new student|the captain",
    "place": "the market|the library|the park|the harbor|the train station|the village square|"
    "the old mill|the beach|the museum|the kitchen|the garden|the bakery|the school|the office|"
    "the river bank|the hills|the city center|the post office|the small cafe|the town hall",
    "thing": "umbrella|bicycle|notebook|lamp|chair|teapot|map|coat|radio|clock|basket|letter|"
    "photograph|kettle|ladder|painting|suitcase|guitar|blanket|mirror|compass|bookshelf",
    "topic": "the weather|gardening|old movies|the price of bread|city planning|music lessons|"
    "long walks|cooking|the history of the town|bird watching|good manners|the next holiday|"
    "public transport|local politics|children's books|cheap furniture|the football season|"
    "learning languages|saving money|quiet evenings|the new bridge|growing vegetables",
    "activity": "reading|painting the fence|fixing the roof|baking bread|writing letters|"
    "cleaning the attic|walking the dog|planting tomatoes|sorting old photos|practicing the "
    "piano|repairing the bicycle|knitting a scarf|washing the windows|reading the newspaper",
    "time": "in the morning|after lunch|on Sunday|late at night|before dawn|last winter|every "
    "weekend|during the holidays|in early spring|yesterday|a few years ago|on rainy days",
    "season": "spring|summer|autumn|winter",
    "food": "soup|bread|apples|cheese|rice|pancakes|fish|salad|chocolate|noodles|tea|coffee|"
    "plums|honey cake|roasted potatoes",
    "animal": "the cat|the old dog|a small bird|the neighbor's goat|a red fox|the tired horse|"
    "a grey rabbit",
    "feeling": "happy|tired|curious|nervous|proud|calm|relieved|surprised|bored|hopeful",
    "nature": "the clouds|the river|the trees|the sea|the hills|the stars|the fields|the lake|"
    "the orchard",
    "group": "the neighbors|the students|the farmers|the musicians|the old friends|the "
    "tourists|the children|the workers|the teachers|the volunteers",
    "skill": "cooking|swimming|painting|chess|singing|sewing|drawing|carpentry|photography|"
    "gardening|baking",
}
_ESSAY_WORDS = {k: v.split("|") for k, v in _E.items()}
_ESSAY_TEMPLATES = [
    "{name} walked to {place} {time}.",
    "There was {a_adj} {thing} near {place}, and nobody knew who had left it there.",
    "{name} said that {topic} mattered more than most people think.",
    "In {season}, {place} is usually {adj} and {adj2}.",
    "Most of {group} agree that {topic} takes patience.",
    "{name} spent the afternoon {activity} and felt {feeling} afterwards.",
    "If you want to get better at {skill}, practice a little every day.",
    "{group} at {place} talked about {topic} for hours.",
    "{name} likes {food} more than {food2}, especially in {season}.",
    "A good {thing} can last for many years if you take care of it.",
    "After the rain stopped, {name} went out to look at {nature}.",
    "Nobody expected the talk about {topic} to be so {adj}.",
    "{name} wrote a long letter about {topic} but never sent it.",
    "{animal} slept by the door while {name} was {activity}.",
    "Some people think {topic} is simple, but it rarely is.",
    "Every week {group} meet at {place} to discuss {topic}.",
    "{name} found an old {thing} at {place} and decided to keep it.",
    "Learning {skill} changed the way {name} thought about {topic}.",
    "The {thing} in the hallway looked {adj}, and it made {name} smile.",
    "{time}, {name} and {name2} shared {food} at {place}.",
    "It is often easier to buy a new {thing} than to repair an old one.",
    "{name} believes that {topic} says a lot about a town.",
    "When {name} was young, {place} seemed much bigger than it does now.",
    "The view of {nature} from {place} was {adj} that day.",
    "Nobody at {place} could remember a {season} as {adj} as this one.",
    "{name} keeps {a_adj} {thing} on the shelf, next to a box of old letters.",
]


def _essay_sentence(rng: random.Random) -> str:
    w = _ESSAY_WORDS

    def pick(k: str) -> str:
        return rng.choice(w[k])

    adj = rng.choice(ADJECTIVES)
    text = rng.choice(_ESSAY_TEMPLATES).format(
        name=pick("name"), name2=pick("name"), place=pick("place"), thing=pick("thing"),
        topic=pick("topic"), activity=pick("activity"), time=pick("time"),
        season=pick("season"), food=pick("food"), food2=pick("food"), animal=pick("animal"),
        feeling=pick("feeling"), nature=pick("nature"), group=pick("group"),
        skill=pick("skill"), adj=adj, adj2=rng.choice(ADJECTIVES),
        a_adj=("an " if adj[0] in "aeiou" else "a ") + adj,
    )
    return text[0].upper() + text[1:]


# ---- haystack assembly --------------------------------------------------------------------


def _units(make: Callable[[int], list[str]], enc: _Enc) -> Iterator[list[int]]:
    """Token ids of filler units, made and tokenized in growing batches (few tokenizer calls
    for long haystacks, little waste for short ones)."""
    batch = 8
    while True:
        yield from enc.many(make(batch))
        batch = min(batch * 2, 1024)


def _fill(units: Iterator[list[int]], target: int) -> tuple[list[int], list[int]]:
    """`target` filler tokens and the offsets of the unit boundaries in them: 0 and the end
    of every complete unit (the last unit may be cut; nothing is inserted after a cut)."""
    ids: list[int] = []
    bounds = [0]
    while len(ids) < target:
        ids.extend(next(units))
        if len(ids) <= target:
            bounds.append(len(ids))
    del ids[target:]
    return ids, bounds


def _insert(filler: list[int], bounds: list[int], slots: list[int],
            inserts: list[list[int]]) -> list[int]:
    """`inserts[i]` placed at boundary `slots[i]` (slots ascending), in order."""
    out: list[int] = []
    prev = 0
    for slot, ids in zip(slots, inserts, strict=True):
        out += filler[prev:bounds[slot]] + ids
        prev = bounds[slot]
    return out + filler[prev:]


def _haystack(enc: _Enc, size: int, units: Iterator[list[int]], slots: Callable[[int], list[int]],
              inserts: list[list[int]]) -> list[int]:
    """Exactly `size` tokens: filler units with `inserts` at the boundaries `slots(n)` picks
    among the n + 1 boundaries of the n complete units."""
    filler, bounds = _fill(units, size - sum(len(i) for i in inserts))
    return _insert(filler, bounds, slots(len(bounds) - 1), inserts)


# ---- NIAH ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Niah:
    haystack: str  # noise | essay | needle
    key: str  # word | uuid
    value: str  # number | uuid
    keys: int = 1
    values: int = 1
    queries: int = 1


_NIAH = {
    "niah_single_1": _Niah("noise", "word", "number"),
    "niah_single_2": _Niah("essay", "word", "number"),
    "niah_single_3": _Niah("essay", "word", "uuid"),
    "niah_multikey_1": _Niah("essay", "word", "number", keys=4),
    "niah_multikey_2": _Niah("needle", "word", "number"),
    "niah_multikey_3": _Niah("needle", "uuid", "uuid"),
    "niah_multivalue": _Niah("essay", "word", "number", values=4),
    "niah_multiquery": _Niah("essay", "word", "number", keys=4, queries=4),
}
# RULER's depth grid: 40 evenly spaced percentages from 0 to 100.
DEPTHS = [round(100 * i / 39) for i in range(40)]
_HEX = "0123456789abcdef-"

Key = tuple[str, str] | str  # (adjective, noun) or a uuid


def _key_pieces(key: Key) -> list[str]:
    # A word key is two pieces so its token count is exactly bounded by the longest words.
    return [" " + key[0], "-" + key[1]] if isinstance(key, tuple) else [_Rand(" " + key)]


def _key_text(key: Key) -> str:
    return f"{key[0]}-{key[1]}" if isinstance(key, tuple) else key


def _needle(cfg: _Niah, key: Key, value: str) -> list[str]:
    sep = " " if cfg.haystack == "essay" else "\n"
    return [f"{sep}One special magic {cfg.value} for", *_key_pieces(key), " is:",
            _Rand(" " + value), "."]


def _niah_frame(cfg: _Niah, queried: list[Key]) -> tuple[list[str], list[str]]:
    """(head, tail) pieces; the tail ends with the answer prefix."""
    one = cfg.values * cfg.queries == 1
    kind = cfg.value if one else cfg.value + "s"
    head = (f"The text below hides {'a' if one else 'some'} special magic {kind}. Memorize "
            f"{'it' if one else 'them'}; you will be asked about the {kind} afterwards.")
    query: list[str] = []
    for i, key in enumerate(queried):
        if i:
            query.append(", and" if i == len(queried) - 1 else ",")
        query += _key_pieces(key)
    tail = [f"\n{'What is the' if one else 'What are all the'} special magic {kind} for",
            *query, " mentioned in the text above?", f" The special magic {kind} for", *query,
            f" mentioned in the text above {'is' if one else 'are'}:"]
    return [head], tail


def _niah_worst(enc: _Enc, cfg: _Niah) -> tuple[Key, str]:
    if cfg.key == "word":
        adj = max(ADJECTIVES, key=lambda a: len(enc.ids(" " + a)))
        key: Key = (adj, max(NOUNS, key=lambda n: len(enc.ids("-" + n))))
    else:
        key = enc.worst(_HEX, 36)
    value = enc.worst(string.digits, 7) if cfg.value == "number" else enc.worst(_HEX, 36)
    return key, value


def _niah_budget(enc: _Enc, task: str) -> int:
    cfg = _NIAH[task]
    enc.many([" " + a for a in ADJECTIVES] + ["-" + n for n in NOUNS])  # one batched call
    key, value = _niah_worst(enc, cfg)
    head, tail = _niah_frame(cfg, [key] * cfg.queries)
    needles = [p for _ in range(cfg.keys * cfg.values) for p in _needle(cfg, key, value)]
    return enc.bound(head + needles + tail)


class _Draw:
    """Random keys and values, each unique within a sample (so distractors never equal gold)."""

    def __init__(self, rng: random.Random, cfg: _Niah) -> None:
        self.rng, self.cfg = rng, cfg
        self.keys: set[str] = set()
        self.values: set[str] = set()

    def key(self) -> Key:
        if self.cfg.key == "uuid":
            return self._unique(self._uuid, self.keys)
        if len(self.keys) > 0.9 * len(ADJECTIVES) * len(NOUNS):
            raise ValueError("this length needs more distinct needle keys than the word lists "
                             "hold; use a shorter length for this task")
        while True:
            key = (self.rng.choice(ADJECTIVES), self.rng.choice(NOUNS))
            if _key_text(key) not in self.keys:
                self.keys.add(_key_text(key))
                return key

    def value(self) -> str:
        if self.cfg.value == "uuid":
            return self._unique(self._uuid, self.values)
        return self._unique(lambda: str(self.rng.randint(10**6, 10**7 - 1)), self.values)

    def _uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    @staticmethod
    def _unique(make: Callable[[], str], seen: set[str]) -> str:
        while (x := make()) in seen:
            pass
        seen.add(x)
        return x


def _niah_units(enc: _Enc, cfg: _Niah, draw: _Draw) -> Iterator[list[int]]:
    rng = draw.rng
    if cfg.haystack == "noise":
        line = enc.ids("\n" + NOISE)
        while True:
            yield line
    if cfg.haystack == "needle":
        def needles(n: int) -> list[list[int]]:
            pieces = [_needle(cfg, draw.key(), draw.value()) for _ in range(n)]
            enc.many([p for ps in pieces for p in ps])  # one batched call for the values
            return [enc.join(ps) for ps in pieces]
        batch = 8
        while True:
            yield from needles(batch)
            batch = min(batch * 2, 1024)
    # Essay: sentences in paragraphs of 3 to 7 (a paragraph starts with a line break).
    state = {"left": 0}

    def sentences(n: int) -> list[str]:
        out = []
        for _ in range(n):
            sep = " "
            if state["left"] == 0:
                sep, state["left"] = "\n", rng.randint(3, 7)
            state["left"] -= 1
            out.append(sep + _essay_sentence(rng))
        return out

    yield from _units(sentences, enc)


def _build_niah(enc: _Enc, task: str, size: int, rng: random.Random) -> tuple[list[int], list[str]]:
    cfg = _NIAH[task]
    draw = _Draw(rng, cfg)
    keys = [draw.key() for _ in range(cfg.keys)]
    values = [[draw.value() for _ in range(cfg.values)] for _ in keys]
    needles = [(k, v) for k, vs in zip(keys, values, strict=True) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(range(cfg.keys), cfg.queries)
    answers = [v for i in asked for v in values[i]]
    head, tail = _niah_frame(cfg, [keys[i] for i in asked])
    head_ids, tail_ids = enc.join(head), enc.join(tail)
    context = _haystack(
        enc, size - len(head_ids) - len(tail_ids), _niah_units(enc, cfg, draw),
        lambda n: [n * d // 100 for d in depths],
        [enc.join(_needle(cfg, k, v)) for k, v in needles])
    return head_ids + context + tail_ids, answers


# ---- variable tracking --------------------------------------------------------------------

VT_HOPS = 4
VT_EXAMPLE_LINES = 5  # noise lines of the one-shot example (RULER sizes it to ~500 tokens)


def _vt_chain(names: list[str], value: str) -> list[list[str]]:
    lines = [["\nVAR", _Rand(" " + names[0]), " =", _Rand(" " + value)]]
    lines += [["\nVAR", _Rand(" " + b), " = VAR", _Rand(" " + a)]
              for a, b in zip(names, names[1:], strict=False)]
    return lines


def _vt_frame(value: str) -> tuple[list[str], list[str]]:
    head = ["Keep track of the chain of variable assignments hidden in the text below.\n"]
    tail = ["\nQuestion: Which variables are assigned the value", _Rand(" " + value),
            " in the text above?",
            f" Answer: Following the chain of assignments in the text above, {VT_HOPS + 1} "
            "variables are assigned the value", _Rand(" " + value), "; they are:"]
    return head, tail


def _vt_example(names: list[str], value: str) -> list[str]:
    # The chain lines interleave with the noise lines: one before each (5 lines, 5 links).
    head, tail = _vt_frame(value)
    lines = [p for link in _vt_chain(names, value) for p in [*link, "\n" + NOISE]]
    return head + lines + tail + [_Rand(" " + n) for n in names] + ["\n\n"]


def _vt_budget(enc: _Enc, task: str) -> int:
    big, digit = enc.worst(string.ascii_uppercase, 5), enc.worst(string.digits, 5)
    head, tail = _vt_frame(digit)
    chain = [p for line in _vt_chain([big] * (VT_HOPS + 1), digit) for p in line]
    example = _vt_example([big[:3]] * (VT_HOPS + 1), digit)
    return enc.bound(example + head + chain + tail)


def _build_vt(enc: _Enc, task: str, size: int, rng: random.Random) -> tuple[list[int], list[str]]:
    def names(k: int, avoid: set[str]) -> list[str]:
        out: list[str] = []
        while len(out) < VT_HOPS + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=k))
            if name not in avoid and name not in out:
                out.append(name)
        return out

    chain_names = names(5, set())
    value = str(rng.randint(10000, 99998))
    example_value = value
    while example_value == value:
        example_value = str(rng.randint(10000, 99998))
    example = enc.join(_vt_example(names(3, set()), example_value))
    head, tail = _vt_frame(value)
    head_ids, tail_ids = example + enc.join(head), enc.join(tail)
    lines = [enc.join(line) for line in _vt_chain(chain_names, value)]

    def slots(n: int) -> list[int]:
        # RULER: distinct noise lines, in chain order (fewer lines than links: some share).
        if n >= len(lines):
            return sorted(rng.sample(range(n), len(lines)))
        return sorted(rng.choices(range(n + 1), k=len(lines)))

    line = enc.ids("\n" + NOISE)
    context = _haystack(enc, size - len(head_ids) - len(tail_ids), _repeat(line), slots, lines)
    return head_ids + context + tail_ids, chain_names


def _repeat(ids: list[int]) -> Iterator[list[int]]:
    while True:
        yield ids


# ---- common words extraction --------------------------------------------------------------

CWE_COMMON = 10
# (repeats of a common word, of an uncommon one) for the example and the task, and the
# example's word count: RULER's settings below and from 4096 tokens.
_CWE_SMALL = ((3, 1, 20), (6, 1))
_CWE_LARGE = ((10, 3, 40), (30, 3))
_CWE_MIN_WORDS = 2 * CWE_COMMON  # the task list has at least as many rare words as common


def _cwe_frame() -> tuple[str, str]:
    head = ("Here is a numbered list of words. Some of the words occur more often than others; "
            "memorize the ones that occur most often.\n")
    tail = (f"\nQuestion: Which {CWE_COMMON} words occur most often in the list above?"
            f" Answer: The {CWE_COMMON} words that occur most often in the list above are:")
    return head, tail


def _number(i: int, first: bool) -> str:
    return f"{i}." if first and i == 1 else f" {i}."


def _cwe_fixed(enc: _Enc, setting: tuple) -> tuple[int, list[int]]:
    """(tokens of the fixed text and numbering, repeats of each distinct word) of the example
    plus a task list of the fewest words."""
    (ex_c, ex_u, ex_n), (cw, uw) = setting
    head, tail = _cwe_frame()
    ex_entries = CWE_COMMON * ex_c + (ex_n - CWE_COMMON) * ex_u
    entries = CWE_COMMON * cw + (_CWE_MIN_WORDS - CWE_COMMON) * uw
    numbers = ([_number(i, True) for i in range(1, ex_entries + 1)]
               + [_number(i, False) for i in range(1, CWE_COMMON + 1)]
               + [_number(i, True) for i in range(1, entries + 1)])
    fixed = 2 * len(enc.ids(head)) + 2 * len(enc.ids(tail)) + len(enc.ids("\n"))
    fixed += sum(len(i) for i in enc.many(numbers))
    repeats = ([ex_c + 1] * CWE_COMMON + [ex_u] * (ex_n - CWE_COMMON) + [cw] * CWE_COMMON
               + [uw] * (_CWE_MIN_WORDS - CWE_COMMON))
    return fixed, repeats


def _cwe_need(enc: _Enc, setting: tuple) -> int:
    fixed, repeats = _cwe_fixed(enc, setting)
    # The worst case pairs the most repeated slots with the longest words of the list.
    lengths = sorted((len(i) for i in enc.many([" " + w for w in CWE_WORDS])), reverse=True)
    return fixed + sum(r * n for r, n in zip(sorted(repeats, reverse=True), lengths,
                                             strict=False))


def _cwe_setting(enc: _Enc, size: int, length: int) -> tuple:
    # RULER switches to 30/3 repeats at 4096 tokens; a tokenizer so fine-grained that the
    # larger setting does not fit there keeps the smaller one until it does.
    large = length >= 4096 and size >= _cwe_need(enc, _CWE_LARGE)
    return _CWE_LARGE if large else _CWE_SMALL


def _cwe_budget(enc: _Enc, task: str) -> int:
    return _cwe_need(enc, _CWE_SMALL)


def _pseudo_words(rng: random.Random, avoid: set[str]) -> Iterator[str]:
    """Pronounceable made-up words, once the word list is used up (RULER falls back on a
    large English word list, a download)."""
    while True:
        word = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
        if word not in avoid:
            avoid.add(word)
            yield word


class _Lazy:
    """Token ids of the items an index-to-text function names, tokenized in batches."""

    def __init__(self, enc: _Enc, text: Callable[[int], str]) -> None:
        self.enc, self.text, self.ids = enc, text, []

    def __getitem__(self, i: int) -> list[int]:
        while i >= len(self.ids):
            n = len(self.ids)
            self.ids += self.enc.many([self.text(j) for j in range(n, n + max(256, n))])
        return self.ids[i]


def _build_cwe(enc: _Enc, task: str, size: int, rng: random.Random) -> tuple[list[int], list[str]]:
    length = size + len(enc.bos) + TASKS[task].max_new_tokens
    (ex_c, ex_u, ex_n), (cw, uw) = _cwe_setting(enc, size, length)
    head, tail = _cwe_frame()
    pool = list(CWE_WORDS)
    rng.shuffle(pool)
    ex_words, words = pool[:ex_n], pool[ex_n:]
    extra = _pseudo_words(rng, set(CWE_WORDS))

    def word(i: int) -> str:
        while i >= len(words):
            words.append(next(extra))
        return words[i]

    def entries(common: list[str], rare: list[str], c: int, u: int) -> list[str]:
        out = common * c + rare * u
        rng.shuffle(out)
        return out

    def listing(items: list[str], first: bool) -> list[str]:
        return [p for i, w in enumerate(items, 1) for p in (_number(i, first), " " + w)]

    ex_common = ex_words[:CWE_COMMON]
    example = ([head] + listing(entries(ex_common, ex_words[CWE_COMMON:], ex_c, ex_u), True)
               + [tail] + listing(ex_common, False) + ["\n"])
    fixed = len(enc.join(example)) + len(enc.ids(head)) + len(enc.ids(tail))
    # As many words as fit (RULER's search for the largest list), counted exactly.
    numbers = _Lazy(enc, lambda j: _number(j + 1, True))
    word_ids = _Lazy(enc, lambda j: " " + word(j))
    n_entries = CWE_COMMON * cw + (_CWE_MIN_WORDS - CWE_COMMON) * uw
    total = fixed + sum(len(numbers[j]) for j in range(n_entries))
    total += sum((cw if j < CWE_COMMON else uw) * len(word_ids[j]) for j in range(_CWE_MIN_WORDS))
    n_words = _CWE_MIN_WORDS
    while True:
        more = uw * len(word_ids[n_words]) + sum(len(numbers[n_entries + j]) for j in range(uw))
        if total + more > size:
            break
        total, n_words, n_entries = total + more, n_words + 1, n_entries + uw
    common = [word(j) for j in range(CWE_COMMON)]
    items = entries(common, [word(j) for j in range(CWE_COMMON, n_words)], cw, uw)
    body = [i for j, w in enumerate(items) for i in numbers[j] + enc.ids(" " + w)]
    # The few tokens left over lead the prompt: filler text ending in a line break.
    pad = size - total
    newline = enc.ids("\n")
    if pad > len(newline):
        noise, _ = _fill(_repeat(enc.ids(NOISE + " ")), pad - len(newline))
        lead = noise + newline
    else:
        lead = (newline * pad)[:pad]
    prompt = lead + enc.join(example) + enc.ids(head) + body + enc.ids(tail)
    return prompt, common


# ---- frequent words extraction ------------------------------------------------------------

FWE_ALPHA = 2.0
FWE_WORD_LEN = 6
FWE_NOISE = "..."  # RULER replaces the most frequent coded word by dots


def _zeta(s: float, n: int = 1000) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin after n terms; no scipy needed)."""
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


_ZETA = _zeta(FWE_ALPHA)


def _fwe_counts(n: int, vocab: int) -> list[int]:
    """RULER's counts: the word of rank k occurs int(n * k^-alpha / zeta(alpha)) times."""
    return [int(n * k ** -FWE_ALPHA / _ZETA) for k in range(1, vocab + 1)]


def _fwe_min_words() -> int:
    # The fewest draws from which on the answers (ranks 2-4) are strictly the 3 most frequent
    # coded words: rank 4 must occur more often than rank 5.
    bad = [n for n in range(1, 2000) if (c := _fwe_counts(n, 5))[3] <= c[4]]
    return max(bad) + 1


FWE_MIN_WORDS = _fwe_min_words()
FWE_MIN_VOCAB = 5  # dots, 3 answers and at least one other word


def _fwe_frame() -> tuple[str, str]:
    head = ("Read the coded text below and keep count of how often each coded word occurs; "
            "find the three coded words that occur most often.")
    tail = ("\nQuestion: Give no explanation, and ignore the dots '....'. Which three words "
            "occur most often in the coded text above? Answer: The three words that occur "
            "most often in the coded text above are:")
    return head, tail


def _fwe_budget(enc: _Enc, task: str) -> int:
    head, tail = _fwe_frame()
    counts = _fwe_counts(FWE_MIN_WORDS, FWE_MIN_WORDS)
    word = _Rand(" " + enc.worst(string.ascii_lowercase, FWE_WORD_LEN))
    words = counts[0] * len(enc.ids(" " + FWE_NOISE)) + sum(counts[1:]) * enc.bound([word])
    need = len(enc.ids(head)) + len(enc.ids(tail)) + words
    # RULER's vocabulary is a fiftieth of the length: at least FWE_MIN_VOCAB words.
    return max(need, 50 * FWE_MIN_VOCAB - len(enc.bos))


def _build_fwe(enc: _Enc, task: str, size: int, rng: random.Random) -> tuple[list[int], list[str]]:
    vocab_size = (size + len(enc.bos)) // 50
    coded: list[str] = []
    seen: set[str] = set()
    while len(coded) < vocab_size - 1:
        w = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN))
        if w not in seen:
            seen.add(w)
            coded.append(w)
    vocab = [FWE_NOISE, *coded]
    head, tail = _fwe_frame()
    room = size - len(enc.ids(head)) - len(enc.ids(tail))
    lengths = [len(i) for i in enc.many([" " + w for w in vocab])]

    def tokens(n: int) -> int:
        return sum(c * t for c, t in zip(_fwe_counts(n, vocab_size), lengths, strict=True))

    # The most words that fit (tokens(n) grows with n): binary search.
    lo, hi = FWE_MIN_WORDS, FWE_MIN_WORDS + 2 * room + vocab_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokens(mid) <= room else (lo, mid - 1)
    drawn = [w for w, c in zip(vocab, _fwe_counts(lo, vocab_size), strict=True) for _ in range(c)]
    rng.shuffle(drawn)
    body = [i for w in drawn for i in enc.ids(" " + w)]
    # The tokens left over are more dots (the noise word) at the end of the coded text.
    dots, _ = _fill(_repeat(enc.ids(" " + FWE_NOISE)), room - len(body))
    return enc.ids(head) + body + dots + enc.ids(tail), vocab[1:4]


_BUILDERS: dict[str, Callable[[_Enc, str, int, random.Random], tuple[list[int], list[str]]]] = {
    "niah": _build_niah, "vt": _build_vt, "cwe": _build_cwe, "fwe": _build_fwe}
# Prompt tokens (without bos) a task needs at least.
_MIN_BUDGET: dict[str, Callable[[_Enc, str], int]] = {
    "niah": _niah_budget, "vt": _vt_budget, "cwe": _cwe_budget, "fwe": _fwe_budget}
