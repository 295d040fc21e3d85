"""KTO examples as longctx prepares them, against TRL's `KTOTrainer` dataset: the same prompt,
completion and KL completion ids (its rotation within each batch), and Axolotl's prompt
strings for its KTO types."""

from __future__ import annotations

import pytest

from longctx_cli.config.sections.data import KTO_TYPES
from longctx_cli.data.kto import kl_completions, kto_ids, kto_sample, kto_texts
from longctx_cli.errors import UserError
from tests.test_preference import base_model, lora_config, tokenizer

RECORDS = [  # Axolotl's `ultra` KTO records (argilla/ultrafeedback-...-kto's fields)
    {"prompt": "Two plus two is", "completion": "four.", "label": True},
    {"prompt": "Name the colour of the sky.", "completion": "Green.", "label": False,
     "system": "Answer in one word."},
    {"prompt": "The capital of France is", "completion": "Paris.", "label": True},
    {"prompt": "Count to three.", "completion": "1, 2, 3", "label": True},
    {"prompt": "Say no.", "completion": "Yes!", "label": False},
]
BATCH = 2  # TRL's per_device_train_batch_size: the KL rotation's chunk (the last one is 1 long)


def test_axolotl_prompt_strings():
    """The llama3 and chatml blocks Axolotl's KTO transforms write."""
    prompt, completion, label = kto_texts(RECORDS[1], "llama3.ultra", "r")
    assert prompt == ("<|start_header_id|>system<|end_header_id|>\n\nAnswer in one word.<|eot_id|>"
                      "<|start_header_id|>user<|end_header_id|>\n\nName the colour of the sky."
                      "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert (completion, label) == ("Green.<|eot_id|>", False)
    record = {"instruction": "Hi", "completion": "Hello", "label": True}
    assert kto_texts(record, "chatml.argilla", "r")[:2] == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello<|im_end|>")
    chat = {"completion": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello"}], "label": True}
    assert kto_texts(chat, "chatml.argilla_chat", "r")[:2] == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello<|im_end|>")
    assert {"llama3.intel", "chatml.prompt_pairs"} <= set(KTO_TYPES)


def test_label_must_be_boolean():
    with pytest.raises(UserError, match="boolean `label`"):
        kto_texts({"prompt": "a", "completion": "b", "label": "yes"}, "chatml.ultra",
                  "data.jsonl:3")
    with pytest.raises(UserError, match="`completion`"):
        kto_texts({"prompt": "a", "label": True}, "llama3.ultra", "data.jsonl:3")


def test_ids_and_kl_completions_match_trl():
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    tok = tokenizer()
    texts = [kto_texts(r, "llama3.ultra", f"r{i}") for i, r in enumerate(RECORDS)]
    data = Dataset.from_list([{"prompt": p, "completion": c, "label": d} for p, c, d in texts])
    args = KTOConfig(output_dir="/tmp/longctx-trl-kto-data", report_to=[], use_cpu=True,
                     per_device_train_batch_size=BATCH, max_length=None)
    trainer = KTOTrainer(model=base_model(), args=args, train_dataset=data,
                         processing_class=tok, peft_config=lora_config())
    rows = [trainer.train_dataset[i] for i in range(len(RECORDS))]
    mine = [kto_ids(tok, p, c) for p, c, _ in texts]
    assert [m[0] for m in mine] == [r["prompt_ids"] for r in rows]
    assert [m[1] for m in mine] == [r["completion_ids"] for r in rows]
    kl = kl_completions([m[1] for m in mine], BATCH)
    assert kl == [r["KL_completion_ids"] for r in rows]
    assert kl[-1] == mine[-1][1]  # a chunk of one is its own KL completion, as in TRL

    ids, labels, positions = kto_sample(mine[0][0], mine[0][1], kl[0])
    prompt, completion = mine[0]
    assert ids == prompt + completion + prompt + kl[0]
    assert labels == [-100] * len(prompt) + completion + [-100] * len(prompt) + kl[0]
    assert positions == [*range(len(prompt) + len(completion)), *range(len(prompt) + len(kl[0]))]


def test_prepared_rows_keep_trls_batches(tmp_path):
    """`prepare` under `rl: kto`: one sample a row with its label, in file order, each KL
    completion from its own micro-batch; a micro-batch holding a sample longer than
    sequence_len is dropped whole and counted, and the next batches keep their pairing."""
    import json

    from longctx_cli.config.load import config_from_dict
    from longctx_cli.data.prepare import prepare

    records = [{**r, "prompt": r["prompt"] * (30 if i == 2 else 1)}
               for i, r in enumerate(RECORDS)]
    records.append({"prompt": "One more.", "completion": "Done.", "label": True})
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = config_from_dict({
        "model_config": {"model_type": "llama"}, "tokenizer": "byte", "sequence_len": 600,
        "dataset_prepared_path": str(tmp_path / "prepared"), "rl": "kto", "adapter": "lora",
        "datasets": [{"path": str(path), "type": "llama3.ultra"}], "sample_packing": False,
        "shuffle_merged_datasets": False, "micro_batch_size": BATCH})
    tok = tokenizer()
    prepared = prepare(config, tok, progress=False)
    rows = prepared.train
    kept = [0, 1, 4, 5]  # examples 2 and 3 were one micro-batch, with a long prompt in it
    assert rows["kto_label"] == [records[i]["label"] for i in kept]
    ids = [kto_ids(tok, *kto_texts(records[i], "llama3.ultra", "r")[:2]) for i in kept]
    for row, (prompt, completion), (_, partner) in zip(
            range(4), ids, [ids[1], ids[0], ids[3], ids[2]], strict=True):
        assert rows[row]["input_ids"] == kto_sample(prompt, completion, partner)[0]
    stats = prepared.report.datasets[0]
    assert (stats.dropped, stats.too_long, stats.samples) == (2, 1, 4)
