#!/usr/bin/env python3
"""Builds, offline and in a second, what the ALBERT programs read: a small English-like
text set, a whole-word unigram tokenizer for it (in Hugging Face's format, loadable with
AlbertTokenizerFast), a tiny ALBERT config, and the tokenized sentence pairs with their
sentence-order labels (ALBERT's two pre-training tasks) in DATA_DIR/tokenized.json, and,
where the `datasets` package is installed, also in DATA_DIR/albert_tokenized (the
`load_from_disk` format hivemind's original run_trainer.py reads). Needs `tokenizers`.

    python prepare_data.py DATA_DIR
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SUBJECTS = ["the fox", "a cat", "the old dog", "my neighbour", "the small bird", "a farmer"]
VERBS = ["sees", "follows", "feeds", "counts", "paints", "greets"]
OBJECTS = ["the river", "two apples", "a red barn", "the morning sun", "three sheep"]
PLACES = ["in the valley", "near the hill", "at noon", "after the rain", "by the lake"]


def make_text(num_stories: int, seed: int = 0) -> list[list[str]]:
    """Stories of a few sentences each whose order carries meaning (an actor, what it
    does, then what happens next), so sentence-order prediction is learnable."""
    rng = random.Random(seed)
    stories = []
    for _ in range(num_stories):
        subject, place = rng.choice(SUBJECTS), rng.choice(PLACES)
        first, second = rng.sample(OBJECTS, 2)
        stories.append(
            [
                f"{subject} wakes up {place} .",
                f"then {subject} {rng.choice(VERBS)} {first} .",
                f"later {subject} {rng.choice(VERBS)} {second} .",
                f"finally {subject} sleeps .",
            ]
        )
    return stories


def prepare(data_dir: str | Path, num_stories: int = 400) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    data_dir = Path(data_dir)
    stories = make_text(num_stories)
    (data_dir / "text").mkdir(parents=True, exist_ok=True)
    (data_dir / "text" / "train.txt").write_text(
        "\n\n".join("\n".join(story) for story in stories) + "\n"
    )

    # A unigram vocabulary of whole words in sentencepiece's spelling ("\u2581word"),
    # the model ALBERT's tokenizer is built on; special tokens first (unk is id 1).
    words = sorted({w for story in stories for s in story for w in s.split()})
    vocab = [(token, 0.0) for token in SPECIAL] + [("\u2581" + w, -1.0) for w in words]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=False))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always"),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tokenizer_dir = data_dir / "tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    special = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
        "bos_token": "[CLS]",
        "eos_token": "[SEP]",
    }
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "AlbertTokenizerFast", "do_lower_case": True, **special})
    )
    (tokenizer_dir / "special_tokens_map.json").write_text(json.dumps(special))

    config_dir = data_dir / "config"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "albert",
                "architectures": ["AlbertForPreTraining"],
                "vocab_size": tokenizer.get_vocab_size(),
                "embedding_size": 16,
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "max_position_embeddings": 64,
                "pad_token_id": 0,
                "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0,
            }
        )
    )

    rng = random.Random(1)
    examples = []
    for story in stories:
        for a, b in itertools.pairwise(story):
            swapped = rng.random() < 0.5
            encoding = tokenizer.encode(*((b, a) if swapped else (a, b)))
            examples.append(
                {
                    "input_ids": encoding.ids,
                    "token_type_ids": encoding.type_ids,
                    "sentence_order_label": int(swapped),
                }
            )
    (data_dir / "tokenized.json").write_text(json.dumps({"train": examples}))
    try:  # the same examples where hivemind's original run_trainer.py looks (load_from_disk)
        import datasets
    except ImportError:
        return
    train = datasets.Dataset.from_list(examples)
    datasets.DatasetDict({"train": train}).save_to_disk(str(data_dir / "albert_tokenized"))


if __name__ == "__main__":
    prepare(sys.argv[1])
