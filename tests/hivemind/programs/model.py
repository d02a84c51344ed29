"""The model, tokenizer and batches: a tiny ALBERT (`transformers`) on the offline data of
prepare_data.py, or, where `transformers` is not installed, a tiny masked language model
in plain torch with the same inputs and the same `.loss` output."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

try:
    import transformers
    from transformers import DataCollatorForLanguageModeling
    from transformers.models.albert import AlbertConfig, AlbertForPreTraining, AlbertTokenizerFast
    from transformers.optimization import get_linear_schedule_with_warmup
except ImportError:
    transformers = None

IGNORE_INDEX = -100


class TinyMaskedLM(torch.nn.Module):
    """Embeddings, a GRU and two heads (masked tokens, sentence order)."""

    def __init__(self, vocab_size: int, hidden_size: int = 32):
        super().__init__()
        self.embeddings = torch.nn.Embedding(vocab_size, hidden_size)
        self.encoder = torch.nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.predictions = torch.nn.Linear(hidden_size, vocab_size)
        self.sop = torch.nn.Linear(hidden_size, 2)

    def forward(self, input_ids, labels, sentence_order_label, **unused):
        hidden, last = self.encoder(self.embeddings(input_ids))
        mlm = torch.nn.functional.cross_entropy(
            self.predictions(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )
        sop = torch.nn.functional.cross_entropy(self.sop(last[0]), sentence_order_label)
        return type("Output", (), {"loss": mlm + sop})()


class TinyTokenizer:
    def __init__(self, tokenizer_path: str):
        vocab = json.loads((Path(tokenizer_path) / "tokenizer.json").read_text())["model"]["vocab"]
        self.size = len(vocab)
        self.pad_token_id, self.mask_token_id = 0, 4

    def __len__(self) -> int:
        return self.size


def mask_tokens(examples: list[dict], tokenizer, probability: float = 0.15) -> dict:
    """Pad, then mask 15% of the ordinary tokens (the torch-only collator)."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
    labels = ids.clone()
    chosen = (torch.rand(ids.shape) < probability) & (ids > tokenizer.mask_token_id)
    labels[~chosen] = IGNORE_INDEX
    ids[chosen] = tokenizer.mask_token_id
    order = torch.tensor([e["sentence_order_label"] for e in examples])
    return {"input_ids": ids, "labels": labels, "sentence_order_label": order}


def load_config(config_path: str):
    if transformers is not None:
        return AlbertConfig.from_pretrained(config_path)
    return json.loads((Path(config_path) / "config.json").read_text())


def load_tokenizer(tokenizer_path: str):
    if transformers is not None:
        return AlbertTokenizerFast.from_pretrained(tokenizer_path)
    return TinyTokenizer(tokenizer_path)


def new_model(config, tokenizer) -> torch.nn.Module:
    if transformers is not None:
        model = AlbertForPreTraining(config)
        model.resize_token_embeddings(len(tokenizer))
        return model
    return TinyMaskedLM(len(tokenizer))


def load_model(checkpoint_dir: str) -> torch.nn.Module:
    if transformers is not None:
        return AlbertForPreTraining.from_pretrained(checkpoint_dir)
    return torch.load(os.path.join(checkpoint_dir, "model.pt"), weights_only=False)


def save_model(model: torch.nn.Module, directory: str) -> None:
    if transformers is not None:
        model.save_pretrained(directory)
    else:
        torch.save(model, os.path.join(directory, "model.pt"))


def data_collator(tokenizer):
    if transformers is not None:
        return DataCollatorForLanguageModeling(tokenizer=tokenizer)
    return lambda examples: mask_tokens(examples, tokenizer)


def linear_schedule_with_warmup(opt, num_warmup_steps: int, num_training_steps: int):
    if transformers is not None:
        return get_linear_schedule_with_warmup(opt, num_warmup_steps, num_training_steps)

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_dataset(path: str) -> dict[str, list[dict]]:
    return json.loads(Path(path).read_text())
