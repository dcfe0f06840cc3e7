"""ProTrainTrainer with a GPU budget plans for the heaviest micro-batch of its training data
(protrain.train.heaviest_batch through the Trainer's own collator, at
per_device_train_batch_size rows), logs which rows and why in one line, and leaves the
batches the Trainer then yields, and every random state, as they were without the plan."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler
from transformers import LlamaConfig, LlamaForCausalLM

from protrain.integrations.transformers import ProTrainConfig, ProTrainTrainer
from protrain.integrations.transformers.planning import planning_batch

from .test_hf_trainer import MODEL_JSON, PlainTrainer, arguments

LENGTHS = [9, 31, 14, 40, 22, 7, 37, 18]  # rows 3 and 6 are the longest


def two_layer_model() -> torch.nn.Module:
    """The quickstart model with two layers: the plan's trace is most of these tests' time."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**json.loads(MODEL_JSON.read_text()), "num_hidden_layers": 2})
    return LlamaForCausalLM(config)


def ragged_rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(3, 512, (n,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return rows


def masking_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Pads to the longest row and masks labels at random from torch's and Python's global
    generators, as a random-masking collator does."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        pad = width - len(r["input_ids"])
        out["input_ids"].append(torch.cat([r["input_ids"], r["input_ids"].new_zeros(pad)]))
        out["attention_mask"].append(torch.cat([r["attention_mask"], torch.zeros(pad).long()]))
        labels = torch.cat([r["labels"], torch.full((pad,), -100)])
        labels[torch.rand(width) < 0.2] = -100
        labels[: int(random.random() * 3)] = -100
        out["labels"].append(labels)
    return {k: torch.stack(v) for k, v in out.items()}


class InputsRecorder:
    """Keeps a copy of the micro-batches training_step receives."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.inputs.append({k: v.clone() for k, v in inputs.items()})
        return super().training_step(model, inputs, num_items_in_batch)


class PlainRecorder(InputsRecorder, PlainTrainer):
    pass


class PlannedRecorder(InputsRecorder, ProTrainTrainer):
    losses: list[float]


def _collect(name: str):
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(name)
    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return records, lambda: (logger.removeHandler(handler), logger.setLevel(level))


def test_plans_the_heaviest_micro_batch_and_leaves_the_trainers_batches(tmp_path):
    def run(cls, **kw):
        trainer = cls(
            model=two_layer_model(),
            args=arguments(
                tmp_path / cls.__name__, 1.0, max_steps=3, gradient_accumulation_steps=1
            ),
            train_dataset=ragged_rows(),
            data_collator=masking_collate,
            **kw,
        )
        trainer.inputs, trainer.losses = [], []
        trainer.train()
        return trainer

    plain = run(PlainRecorder)
    records, stop = _collect("protrain.integrations")
    try:
        planned = run(PlannedRecorder, protrain_config=ProTrainConfig(gpu_budget="100MiB"))
    finally:
        stop()
    assert planned.plan is not None
    chosen = [m for m in records if m.startswith("planning micro-batch")]
    assert chosen == [
        "planning micro-batch: rows [3, 6] of 8, the longest (40, 37 tokens), 40 tokens wide "
        "(the longest row, 3: 40 tokens)"
    ]
    assert sum(m.startswith("protrain memory plan for the planning micro-batch 2x40:")
               for m in records) == 1  # fmt: skip
    # the Trainer's own batches (order, padding, random masks) are the plain Trainer's
    assert len(planned.inputs) == len(plain.inputs) == 3
    for got, want in zip(planned.inputs, plain.inputs, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    planned.close()


def test_choosing_reads_no_stream_and_no_random_state():
    rows = ragged_rows()
    loader = DataLoader(rows, batch_size=2, sampler=RandomSampler(rows), collate_fn=masking_collate)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    batch = planning_batch(loader, torch.device("cpu"), ProTrainConfig(gpu_budget="1GiB"), 2)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert torch.equal(batch["input_ids"][0], rows[3]["input_ids"])
    assert torch.equal(batch["input_ids"][1, :37], rows[6]["input_ids"])
    # plan_sequence_len widens it with untrained padding
    wide = planning_batch(
        loader, torch.device("cpu"), ProTrainConfig(gpu_budget="1GiB", plan_sequence_len=48), 2
    )
    assert wide["input_ids"].shape == (2, 48) and (wide["labels"][:, 40:] == -100).all()
    assert (wide["attention_mask"][:, 40:] == 0).all()


def test_rows_without_input_ids_plan_from_the_first_batch_and_say_so():
    """Rows the collator tokenizes (as TRL's vision-language rows) cannot be sized: the
    loader's first batch, peeked without moving any random state, and the log says why."""
    texts = [{"text": "x" * n} for n in LENGTHS]

    def tokenize(rows):
        width = max(len(r["text"]) for r in rows)
        ids = torch.stack([torch.arange(width) % 7 + (torch.rand(width) < 0.5) for _ in rows])
        return {"input_ids": ids, "labels": ids}

    loader = DataLoader(texts, batch_size=2, sampler=RandomSampler(texts), collate_fn=tokenize)
    records, stop = _collect("protrain.integrations")
    try:
        torch.manual_seed(4)
        state = torch.get_rng_state()
        batch = planning_batch(loader, torch.device("cpu"), ProTrainConfig(gpu_budget="1GiB"), 2)
        assert torch.equal(torch.get_rng_state(), state)
        first = next(iter(loader))
    finally:
        stop()
    assert torch.equal(batch["input_ids"], first["input_ids"])
    assert records == [
        "planning micro-batch: the loader's first batch (its rows carry no input_ids to size "
        "them by, the collator makes them; the plan holds for batches no heavier than this one)"
    ]


def test_a_sampler_that_changes_the_rows_per_micro_batch_is_refused(tmp_path):
    args = arguments(tmp_path, 1.0, train_sampling_strategy="batch_rebalance")
    with pytest.raises(ValueError, match="train_sampling_strategy='batch_rebalance'"):
        ProTrainTrainer(
            model=two_layer_model(),
            args=args,
            train_dataset=ragged_rows(),
            protrain_config=ProTrainConfig(gpu_budget="1GiB"),
        )


def test_trl_sft_plans_its_longest_tokenized_rows(tmp_path):
    """TRL's SFTTrainer tokenizes the chat rows itself: the plan is for its two longest
    tokenized rows, through its own collator."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from protrain.integrations.transformers.sft import ProTrainSFTTrainer

    from .test_trl_sft import QUICKSTART, chat_rows, sft_args

    args = sft_args(tmp_path, 1.0)
    args.max_steps = 1
    records, stop = _collect("protrain.integrations")
    try:
        trainer = ProTrainSFTTrainer(
            model=two_layer_model(),
            args=args,
            train_dataset=chat_rows(),
            processing_class=AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer"),
            protrain_config=ProTrainConfig(gpu_budget="100MiB"),
        )
        trainer.train()
    finally:
        stop()
    lengths = [len(row["input_ids"]) for row in trainer.train_dataset]
    longest = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[:2]
    width = lengths[longest[0]]
    chosen = [m for m in records if m.startswith("planning micro-batch")]
    assert len(chosen) == 1 and chosen[0].startswith(
        f"planning micro-batch: rows {longest} of {len(lengths)}, the longest "
        f"({lengths[longest[0]]}, {lengths[longest[1]]} tokens), {width} tokens wide"
    )
    assert sum(m.startswith(f"protrain memory plan for the planning micro-batch 2x{width}:")
               for m in records) == 1  # fmt: skip
    trainer.close()


def test_an_arrow_dataset_is_sized_from_its_column_in_its_own_order():
    """A shuffled, selected datasets.Dataset: the token counts read from the Arrow column
    are those of its rows, in its order (row by row takes seconds per 10k rows)."""
    from datasets import Dataset

    from protrain.integrations.transformers.planning import ArrowSizedRows, arrow_sized
    from protrain.train.heaviest_batch import row_sizes

    rows = [{"input_ids": r["input_ids"].tolist(), "labels": r["labels"].tolist()}
            for r in ragged_rows()]  # fmt: skip
    data = Dataset.from_list(rows).shuffle(seed=5).select(range(6))
    sized = arrow_sized(data)
    assert isinstance(sized, ArrowSizedRows)
    assert [s.tokens for s in row_sizes(sized)] == [len(r["input_ids"]) for r in data]
    assert row_sizes(sized) == row_sizes(data)
    assert arrow_sized(data.with_format("torch")) is not sized  # tensors: read row by row


class PackingSampler:
    """axolotl 0.21.0's MultipackBatchSampler as the loader sees it: ``batch_size`` packs
    per micro-batch, each a list of row indices of at most ``batch_max_len`` tokens (first
    fit here; axolotl's bin packing is another order, the same bound)."""

    def __init__(self, lengths: list[int], batch_size: int, batch_max_len: int):
        self.batch_size, self.batch_max_len = batch_size, batch_max_len
        packs, current, used = [], [], 0
        for i, n in enumerate(lengths):
            if used + n > batch_max_len:
                packs.append(current)
                current, used = [], 0
            current.append(i)
            used += n
        packs.append(current)
        self.batches = [packs[i : i + batch_size] for i in range(0, len(packs), batch_size)]
        self.batches = [b for b in self.batches if len(b) == batch_size]  # drop_last

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class PackedRows(list):
    """Rows that a pack of indices reads as the list of its rows, as the packs reach
    axolotl's collator."""

    def __getitem__(self, index):
        if isinstance(index, list):
            return [super(PackedRows, self).__getitem__(i) for i in index]
        return super().__getitem__(index)


def pack_collate(pad_to_multiple_of: int):
    """axolotl's V2BatchSamplerDataCollatorForSeq2Seq: the rows of each pack end to end
    (a plain list of rows: one pack)
    (attention mask numbered by row), packs padded to the longest, rounded up to
    ``pad_to_multiple_of`` (with pad_to_sequence_len: sequence_len rounded up to 64)."""

    def collate(packs: list[list[dict]]) -> dict[str, torch.Tensor]:
        if not isinstance(packs[0], list):  # a list of rows is one pack, as axolotl's
            packs = [packs]
        rows = [
            {
                "input_ids": torch.cat([r["input_ids"] for r in pack]),
                "labels": torch.cat([r["labels"] for r in pack]),
                "attention_mask": torch.cat(
                    [(i + 1) * r["attention_mask"] for i, r in enumerate(pack)]
                ),
            }
            for pack in packs
        ]
        width = (
            -(-max(len(r["input_ids"]) for r in rows) // pad_to_multiple_of) * pad_to_multiple_of
        )
        fill = {"input_ids": 0, "labels": -100, "attention_mask": 0}
        return {
            k: torch.stack(
                [torch.cat([r[k], r[k].new_full((width - len(r[k]),), v)]) for r in rows]
            )
            for k, v in fill.items()
        }

    collate.pad_to_multiple_of = pad_to_multiple_of
    return collate


@pytest.mark.parametrize("attention_packs", [True, False], ids=["flash", "sdpa"])
def test_axolotl_sample_packing_plans_the_packed_micro_batch(attention_packs):
    """axolotl's sample_packing with pad_to_sequence_len (micro_batch_size 2, sequence_len 64):
    with an attention that takes packed rows, one pack of 2 x 64 tokens per micro-batch, else
    (multipack_real_batches) 2 packs of 64 (axolotl/core/trainers/base.py,
    _create_multipack_sampler). Rows of 16 tokens fill every pack: the planned micro-batch
    has the shape of every trained one."""
    micro_batch_size, sequence_len = 2, 64
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(40):
        ids = torch.randint(3, 512, (16,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    packs, width = (1, 2 * sequence_len) if attention_packs else (micro_batch_size, sequence_len)
    sampler = PackingSampler([16] * len(rows), batch_size=packs, batch_max_len=width)
    loader = DataLoader(
        PackedRows(rows), batch_sampler=sampler, collate_fn=pack_collate(sequence_len)
    )
    planned = planning_batch(loader, torch.device("cpu"), ProTrainConfig(gpu_budget="1GiB"), 2)
    trained = {tuple(b["input_ids"].shape) for b in loader}
    assert trained == {tuple(planned["input_ids"].shape)} == {(packs, width)}
