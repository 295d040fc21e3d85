"""A sequence-classification reward model scored under SP equals its own Hugging Face forward on
TRL's padded batch (`GRPOTrainer._calculate_rewards`), at sp 1 and sp 2 (ring, zigzag ring,
Ulysses), for plain and conversational prompts; bad entries are refused in one paragraph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longctx_cli.errors import UserError
from longctx_cli.parallel.mesh import ParallelState
from longctx_cli.train.reward_model import RewardModel
from tests.distributed import run_distributed

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}

# Different lengths; the first is longer than a rank's share of any row at sp 2 (rows are no
# longer than the longest sequence). "<pad>" and "</s>" are the byte tokenizer's pad (0) and
# eos (1): HF pools at the last token that is not the pad id, so the fourth reward is read
# one token before its end.
PROMPTS = ["Summarise: " + "the quick brown fox jumps over the lazy dog. " * 6,
           "2+2=", "Name a colour: ", "Say hi", "Q: " + "why? " * 20]
COMPLETIONS = [" A fox jumps.", " 4", " teal" * 9, " hi<pad>", " because</s>"]
CHAT_PROMPTS = [[{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Tell me about rivers. " * 8}],
                [{"role": "user", "content": "hello"}]]
CHAT_COMPLETIONS = [[{"role": "assistant", "content": "They flow."}],
                    [{"role": "assistant", "content": "hi there, how can I help?"}]]


def run_config():
    from longctx_cli.config.schema import Config

    return Config.model_validate({"base_model": "unused", "dtype": "float32",
                                  "datasets": [{"path": "unused.jsonl", "type": "completion"}]})


def save_model(path: Path, architecture: str = "LlamaForSequenceClassification",
               vocab_size: int = 384, **config) -> Path:
    import transformers

    torch.manual_seed(0)
    settings = {"vocab_size": vocab_size, "num_labels": 1, "pad_token_id": 0, **TINY, **config}
    model = getattr(transformers, architecture)(transformers.LlamaConfig(**settings))
    model.save_pretrained(path)
    return path


def save_byte_tokenizer(path: Path) -> Path:
    from longctx_cli.data.tokenizer import byte_tokenizer

    byte_tokenizer().save_pretrained(path)  # it carries a small chat template
    return path


def word_tokenizer(eos: str | None):
    """A word-level tokenizer built in memory, with no pad token (and eos or not)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>"] + "alpha beta gamma delta epsilon zeta eta theta".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=eos)


def trl_texts(tokenizer, prompts, completions) -> list[str]:
    """The texts TRL 1.16 builds (grpo_trainer.py `_calculate_rewards`, data_utils.py
    `apply_chat_template` with a `messages` example)."""
    if isinstance(prompts[0], list):
        return [tokenizer.apply_chat_template(p + c, tools=None, tokenize=False)
                for p, c in zip(prompts, completions, strict=True)]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def hf_rewards(path: Path, prompts, completions) -> list[float]:
    """The model's own forward on TRL's batch: loaded as TRL loads it, pad set as TRL sets it,
    right-padded, no special tokens added, `logits[:, 0]` (eager attention, float32)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    inputs = tok(text=trl_texts(tok, prompts, completions), return_tensors="pt", padding=True,
                 padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return model(**inputs).logits[:, 0].tolist()


def assert_equal_rewards(ours: list[float], theirs: list[float], what: str = "") -> None:
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "tiny-rm"
    save_model(path)
    return save_byte_tokenizer(path)


def test_sp1_equals_hf_forward(reward_dir):
    state = ParallelState()
    rm = RewardModel.load(str(reward_dir) + "/", run_config(), state)
    assert rm.name == "tiny-rm"  # TRL's metric name: rewards/tiny-rm/mean
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training
    assert_equal_rewards(rm.score(PROMPTS, COMPLETIONS, state),
                         hf_rewards(reward_dir, PROMPTS, COMPLETIONS))
    assert_equal_rewards(rm.score(CHAT_PROMPTS, CHAT_COMPLETIONS, state),
                         hf_rewards(reward_dir, CHAT_PROMPTS, CHAT_COMPLETIONS))


def _sp_worker(rank: int, world: int, path: str) -> dict[str, list[list[float]]]:
    from tests.layouts import sp_state

    states = {"ring": sp_state(sp=world), "zigzag": sp_state(sp=world, layout="zigzag"),
              "ulysses": sp_state(sp=world, mode="ulysses")}
    rm = RewardModel.load(path, run_config(), states["ring"])
    longest = max(len(ids) for ids in rm.token_ids(rm.texts(PROMPTS, COMPLETIONS)))
    held: list[int] = []  # tokens of each forward's hidden states on this rank
    decoder = getattr(rm.model, rm.model.base_model_prefix)
    decoder.register_forward_hook(lambda m, a, out: held.append(out.last_hidden_state.shape[1]))
    out = {name: [rm.score(PROMPTS, COMPLETIONS, state),
                  rm.score(CHAT_PROMPTS, CHAT_COMPLETIONS, state)]
           for name, state in states.items()}
    # No rank ever holds a whole long sequence: each holds its share of a row.
    assert max(held) <= (longest + 2 * world) // world < longest, (held, longest)
    return out


def test_sp2_equals_hf_forward(reward_dir):
    expected = [hf_rewards(reward_dir, PROMPTS, COMPLETIONS),
                hf_rewards(reward_dir, CHAT_PROMPTS, CHAT_COMPLETIONS)]
    for ranks in run_distributed(_sp_worker, 2, str(reward_dir), timeout_s=90):
        for name, (plain, chat) in ranks.items():
            assert_equal_rewards(plain, expected[0], name)
            assert_equal_rewards(chat, expected[1], f"{name}, chat")


def test_pad_token_from_eos(tmp_path):
    """TRL pads with eos when the tokenizer has no pad token, and the model scores the last
    token that is not eos."""
    path = save_model(tmp_path / "rm", vocab_size=16, pad_token_id=None)
    word_tokenizer("</s>").save_pretrained(path)
    state = ParallelState()
    rm = RewardModel.load(str(path), run_config(), state)
    assert rm.tokenizer.pad_token == "</s>" and rm.model.config.pad_token_id == 1
    prompts, completions = ["alpha beta gamma", "zeta", "eta theta"], [" delta </s>", " eta", ""]
    assert_equal_rewards(rm.score(prompts, completions, state),
                         hf_rewards(path, prompts, completions))


def test_no_pad_and_no_eos_refused(tmp_path):
    path = save_model(tmp_path / "rm", vocab_size=16)
    word_tokenizer(None).save_pretrained(path)
    with pytest.raises(UserError, match="no pad token and no eos token"):
        RewardModel.load(str(path), run_config(), ParallelState())


def test_missing_folder_refused(tmp_path):
    with pytest.raises(UserError, match="not a folder that exists") as e:
        RewardModel.load(str(tmp_path / "nothing" / "here"), run_config(), ParallelState())
    assert e.value.where == "trl.reward_funcs"


def test_folder_without_config_refused(tmp_path):
    path = save_byte_tokenizer(tmp_path / "only-tokenizer")
    with pytest.raises(UserError, match="no config.json.*tokenizer_config.json"):
        RewardModel.load(str(path), run_config(), ParallelState())


def test_uncached_hub_id_refused():
    with pytest.raises(UserError, match="local Hugging Face cache.*does not download"):
        RewardModel.load("longctx-tests/no-such-reward-model", run_config(), ParallelState())


def test_causal_lm_refused(tmp_path):
    path = save_byte_tokenizer(save_model(tmp_path / "clm", "LlamaForCausalLM"))
    with pytest.raises(UserError, match="is a LlamaForCausalLM.*not a sequence-classification"):
        RewardModel.load(str(path), run_config(), ParallelState())


def test_two_labels_refused_as_trl_refuses(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path = save_byte_tokenizer(save_model(tmp_path / "two", num_labels=2))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # TRL's own load
        AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    with pytest.raises(UserError, match="head of 2 labels.*num_labels=1"):
        RewardModel.load(str(path), run_config(), ParallelState())


def test_tokenizer_mismatch_refused(tmp_path):
    path = save_byte_tokenizer(save_model(tmp_path / "small-vocab", vocab_size=200))
    with pytest.raises(UserError, match="384 tokens but the reward model .* embeds only 200"):
        RewardModel.load(str(path), run_config(), ParallelState())


def test_unsupported_family_refused(tmp_path):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    path = tmp_path / "gpt2-rm"
    GPT2ForSequenceClassification(GPT2Config(
        vocab_size=384, n_embd=32, n_layer=1, n_head=4, num_labels=1, pad_token_id=0,
    )).save_pretrained(path)
    save_byte_tokenizer(path)
    with pytest.raises(UserError, match="GPT2ForSequenceClassification"):
        RewardModel.load(str(path), run_config(), ParallelState())
